"""One polling task per upstream of the endpoint table: the shape the `/load` and LoRA pollers share.

A poller plugs into the app like a discovery source: it follows the table, starts a task when a pod
appears, cancels it and forgets the pod's report (`book.drop`) when the pod goes. Subclasses give `_poll`
(the task's loop) and may act on each sync (`synced`) and re-sync on a timer (`resync_every`) as well as on
table changes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from .table import EndpointTable


class UpstreamPollers:
    """Keeps one `_poll(upstream)` task per upstream of the table; `self.book` holds their reports."""

    name = "vsurge-router-poll"  # task names: f"{name}-follow", f"{name} {upstream}"
    resync_every: float | None = None  # seconds between syncs with no table change (None: only on changes)
    book: Any

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._follow: asyncio.Task[None] | None = None

    async def start(self, table: EndpointTable) -> None:
        self._follow = asyncio.create_task(self._follow_table(table), name=f"{self.name}-follow")

    async def stop(self) -> None:
        tasks = [t for t in (self._follow, *self._tasks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()

    async def _follow_table(self, table: EndpointTable) -> None:
        while True:
            changed = table.changed_event()
            wanted = {u for view in table.models() for u in view.upstreams}
            for u in [u for u in self._tasks if u not in wanted]:
                self._tasks.pop(u).cancel()
                self.book.drop(u)
            for u in wanted - set(self._tasks):
                self._tasks[u] = asyncio.create_task(self._poll(u), name=f"{self.name} {u}")
            self.synced(table)
            try:
                await asyncio.wait_for(changed.wait(), timeout=self.resync_every)
            except TimeoutError:
                pass

    def synced(self, table: EndpointTable) -> None:
        """After each sync with the table (tasks started and stopped)."""

    async def _poll(self, upstream: str) -> None:
        raise NotImplementedError
