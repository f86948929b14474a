"""What the pods say about their load: `GET /load` on every known upstream, every `interval` seconds.

`vsurge serve` answers `/load` from host-side counters in well under a millisecond (server/load.py), so
polling every 200 ms costs the pod nothing and the router sees a queue build up within a fraction of a
second. The alternative, load headers on each response, only refreshes a pod's figures when a response
from it ends, which is exactly when nothing is sent to a busy pod.

The poller is a discovery-style source: it starts with the app and follows the endpoint table, one task
per upstream, started when a pod appears and cancelled when it goes. A poll that cannot connect ejects
the pod at once (a killed pod is noticed within one interval, before a request has to fail on it); an
answer reinstates it. A report older than `stale_after` is ignored. An upstream whose `/load` is not a
vSurge load report (404 from an older server, another server) is polled only every 10 s, and picked by
in-flight counts meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from .load_picking import LoadReport, LoadTracker, parse_load
from .metrics import RouterMetrics
from .upstream_polls import UpstreamPollers

log = logging.getLogger(__name__)

NOT_A_LOAD_ROUTE_BACKOFF = 10.0


class LoadBook:
    """The latest report of each upstream."""

    def __init__(self, stale_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after = stale_after
        self.clock = clock
        self._reports: dict[str, LoadReport] = {}

    def put(self, upstream: str, report: LoadReport) -> None:
        self._reports[upstream] = report

    def drop(self, upstream: str) -> None:
        self._reports.pop(upstream, None)

    def fresh(self, upstreams: Iterable[str]) -> dict[str, LoadReport]:
        """The reports of `upstreams` that are recent enough to trust."""
        now = self.clock()
        out = {}
        for u in upstreams:
            r = self._reports.get(u)
            if r is not None and now - r.at <= self.stale_after:
                out[u] = r
        return out

    def driver(self, model: str, upstreams: Iterable[str]) -> str | None:
        """The driver the pods of `model` report (the first fresh report that names it), else None."""
        for r in self.fresh(upstreams).values():
            d = r.drivers.get(model)
            if d:
                return d
        return None


class LoadPoller(UpstreamPollers):
    """Polls `/load` of every upstream in the table; plugs into the app like a discovery source."""

    name = "vsurge-router-load"

    def __init__(
        self,
        client: httpx.AsyncClient,
        book: LoadBook,
        tracker: LoadTracker,
        metrics: RouterMetrics | None = None,
        *,
        interval: float = 0.2,
        timeout: float = 1.0,
    ) -> None:
        super().__init__()
        self.client = client
        self.book = book
        self.tracker = tracker
        self.metrics = metrics
        self.interval = interval
        self.timeout = timeout

    async def _poll(self, upstream: str) -> None:
        url = f"{upstream}/load"
        while True:
            delay = self.interval
            in_flight_then = self.tracker.in_flight.get(upstream, 0)
            try:
                response = await self.client.get(url, timeout=self.timeout)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self.book.drop(upstream)
                if upstream not in self.tracker.ejected():
                    log.info("load poll: %s unreachable (%s); ejected", upstream, type(e).__name__)
                self.tracker.eject(upstream)
                self._count("unreachable")
            except httpx.HTTPError as e:  # a slow or broken answer: no report this round
                self.book.drop(upstream)
                self._count("error")
                log.debug("load poll of %s failed: %s", upstream, e)
            else:
                report = self._report(response, in_flight_then)
                if report is None:
                    self.book.drop(upstream)
                    self._count("not_a_report")
                    delay = max(delay, NOT_A_LOAD_ROUTE_BACKOFF)
                else:
                    self.book.put(upstream, report)
                    if report.ready:
                        self.tracker.reinstate(upstream)
                    self._count("ok")
            await asyncio.sleep(delay)

    def _report(self, response: httpx.Response, in_flight_then: int) -> LoadReport | None:
        if response.status_code != 200:
            return None
        try:
            body: Any = response.json()
        except ValueError:
            return None
        return parse_load(body, at=self.book.clock(), in_flight_then=in_flight_then)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.load_polls.labels(outcome).inc()
