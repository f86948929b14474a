"""List + watch of one Kubernetes resource, one daemon thread per namespace (or one for all of them).

The official client is synchronous, so each watched namespace gets a daemon thread running list -> watch
from that resourceVersion -> relist when the watch ends (the server closes it every
`watch_timeout_seconds`, or it fails, e.g. 410 Gone). A full relist each cycle costs one small request and
repairs anything a broken watch missed. Subclasses say what to list and what a listing or an event means;
their updates reach the table on the event loop through `post` (`call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .table import EndpointTable

log = logging.getLogger(__name__)

Post = Callable[..., None]


class ListWatcher:
    """Threads that list then watch; subclasses implement `list_call`, `on_list` and `on_event`."""

    what = "objects"

    def __init__(
        self,
        namespaces: Sequence[str] = (),
        *,
        watch_timeout_seconds: int = 300,
        connect_timeout: float = 10.0,
        max_backoff: float = 30.0,
    ) -> None:
        self.namespaces: list[str | None] = list(dict.fromkeys(namespaces)) or [None]
        self.watch_timeout_seconds = watch_timeout_seconds
        self.connect_timeout = connect_timeout
        self.max_backoff = max_backoff
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: list[Any] = []

    # -- subclass hooks

    def list_call(self, namespace: str | None) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        raise NotImplementedError

    def on_start(self, namespace: str | None, table: EndpointTable) -> None:
        """Called on the event loop before the thread starts (e.g. to declare a source)."""

    def on_list(
        self, namespace: str | None, items: list[dict[str, Any]], table: EndpointTable, post: Post
    ) -> None:
        raise NotImplementedError

    def on_event(
        self, namespace: str | None, kind: str, obj: dict[str, Any], table: EndpointTable, post: Post
    ) -> None:
        raise NotImplementedError

    def on_failure(
        self, namespace: str | None, error: Exception, table: EndpointTable, post: Post
    ) -> float | None:
        """A list or watch failed: the seconds to wait before relisting (None: the usual backoff)."""
        return None

    # -- threads

    async def start(self, table: EndpointTable) -> None:
        loop = asyncio.get_running_loop()

        def post(fn: Callable[..., None], *args: Any) -> None:
            loop.call_soon_threadsafe(fn, *args)

        for ns in self.namespaces:
            self.on_start(ns, table)
            t = threading.Thread(
                target=self._run,
                args=(ns, table, post),
                name=f"vsurge-router-watch-{self.what}-{ns or 'all'}",
                daemon=True,
            )
            self._threads.append(t)
            t.start()

    async def stop(self) -> None:
        # The threads may sit in a blocking read; they are daemons and stop at their next event or timeout.
        self._stop.set()
        for w in list(self._watches):
            w.stop()

    def _run(self, namespace: str | None, table: EndpointTable, post: Post) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                fn, args, kwargs = self.list_call(namespace)
                listing = fn(*args, **kwargs, _request_timeout=(self.connect_timeout, 30))
                self.on_list(namespace, listing.get("items") or [], table, post)
                rv = (listing.get("metadata") or {}).get("resourceVersion")
                backoff = 0.5
                self._watch(namespace, rv, table, post)
            except Exception as e:  # any failure: log, back off, relist; discovery must not die
                if self._stop.is_set():
                    break
                wait = self.on_failure(namespace, e, table, post)
                if wait is None:
                    wait = backoff
                    backoff = min(backoff * 2, self.max_backoff)
                    log.warning(
                        "%s watch (%s) failed: %s; relisting in %.1fs",
                        self.what,
                        namespace or "all namespaces",
                        _describe(e),
                        wait,
                    )
                self._stop.wait(wait)
            except BaseException:  # interpreter shutdown
                break

    def _watch(self, namespace: str | None, rv: str | None, table: EndpointTable, post: Post) -> None:
        import kubernetes

        fn, args, kwargs = self.list_call(namespace)
        w = kubernetes.watch.Watch()
        self._watches.append(w)
        kwargs = {
            **kwargs,
            "timeout_seconds": self.watch_timeout_seconds,
            "allow_watch_bookmarks": True,
            # Read timeout past the server-side timeout: a silent, half-open connection ends too.
            "_request_timeout": (self.connect_timeout, self.watch_timeout_seconds + 30),
        }
        if rv:
            kwargs["resource_version"] = rv
        try:
            for event in w.stream(fn, *args, **kwargs):
                if self._stop.is_set():
                    break
                if not isinstance(event, dict):
                    continue
                obj = event.get("raw_object") or event.get("object") or {}
                kind = event.get("type")
                if kind in ("ADDED", "MODIFIED", "DELETED") and isinstance(obj, dict):
                    self.on_event(namespace, kind, obj, table, post)
        finally:
            w.stop()
            self._watches.remove(w)


def _describe(e: BaseException) -> str:
    status = getattr(e, "status", None)
    if status is not None:
        return f"Kubernetes API answered {status} {getattr(e, 'reason', '') or ''}".strip()
    return f"{type(e).__name__}: {e}"
