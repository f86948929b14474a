"""Pod picking by load (pure), and the small tracker of requests in flight and ejections.

A pod's load is what the router knows for sure plus what the pod reports (its `GET /load`, polled by
`loadpoll`): the requests this router has open to it, and the pod's waiting and running requests, decode
slots and KV-cache use. The report is a few hundred milliseconds old, so the router corrects it with its
own traffic since: requests it opened since the report are not in it yet, requests it saw finish since
are. Headroom is then the tighter of the two resources a request needs, a decode slot and KV pages:
`pressure = max(requests / slots, kv_usage)`, lowest first.

Without a fresh report for every candidate (polling off, a pod just added, an old server) the pods are
compared by the router's own in-flight counts, as before `/load` existed: a vSurge replica has a fixed
number of decode slots and generation lengths vary a lot, so counting open requests (streams included,
until their last byte) follows the real load where round robin piles long requests on one replica.

Ties rotate (`turn`) so that an idle pool is used evenly. A pod that refused a connection is ejected for a
few seconds and a pod that reports it is not ready (draining) is avoided; when every candidate is to be
avoided they are tried anyway, since a stale ejection costs one connect and a refusal the whole request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoadReport:
    """One pod's `/load` answer, summed over its models, as the router received it."""

    at: float  # the router's monotonic clock when it arrived
    status: str  # the server's state: starting, ready, draining, stopped
    waiting: int
    running: int
    slots_total: int
    kv_usage: float
    in_flight_then: int  # this router's requests open to the pod when the report arrived
    drivers: Mapping[str, str] = field(default_factory=dict)  # served model -> vdriver | odriver

    @property
    def ready(self) -> bool:
        return self.status == "ready"


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return max(0, int(value))


def parse_load(body: Any, *, at: float, in_flight_then: int) -> LoadReport | None:
    """A `/load` JSON body -> LoadReport; None when it is not one (another server's route, garbage)."""
    if not isinstance(body, Mapping) or not isinstance(body.get("status"), str):
        return None
    kv = body.get("kv_usage")
    kv_usage = float(kv) if isinstance(kv, int | float) and not isinstance(kv, bool) else 0.0
    if not math.isfinite(kv_usage):
        kv_usage = 0.0
    models = body.get("models")
    drivers: dict[str, str] = {}
    if isinstance(models, Mapping):
        for name, m in models.items():
            if isinstance(m, Mapping) and isinstance(m.get("driver"), str):
                drivers[str(name)] = m["driver"]
    return LoadReport(
        at=at,
        status=body["status"],
        waiting=_int(body.get("requests_waiting")),
        running=_int(body.get("requests_running")),
        slots_total=_int(body.get("slots_total")),
        kv_usage=min(1.0, max(0.0, kv_usage)),
        in_flight_then=max(0, in_flight_then),
        drivers=drivers,
    )


def estimated_load(in_flight: int, report: LoadReport | None) -> int:
    """Requests on the pod now: its report corrected by this router's traffic since, never below what this
    router itself has open there."""
    if report is None:
        return max(0, in_flight)
    return max(in_flight, report.waiting + report.running + in_flight - report.in_flight_then, 0)


def pressure(in_flight: int, report: LoadReport) -> float:
    """How full the pod is, 0 = idle: the tighter of decode slots and KV pages."""
    load = estimated_load(in_flight, report)
    slots = load / report.slots_total if report.slots_total > 0 else float(load)
    return max(slots, report.kv_usage)


def usable(
    upstreams: Sequence[str], *, exclude: Collection[str] = (), avoid: Collection[str] = ()
) -> list[str]:
    """The candidates for this attempt: not yet tried, and not to be avoided unless every one is."""
    candidates = [u for u in dict.fromkeys(upstreams) if u not in exclude]
    return [u for u in candidates if u not in avoid] or candidates


def _rotate(tied: Sequence[str], turn: int) -> str:
    return tied[turn % len(tied)]


def pick_least_load(
    candidates: Sequence[str],
    in_flight: Mapping[str, int],
    reports: Mapping[str, LoadReport] | None = None,
    *,
    turn: int = 0,
) -> str | None:
    """The candidate with the most headroom (see the module docstring); ties broken by `turn`."""
    if not candidates:
        return None
    reports = reports or {}
    if all(u in reports for u in candidates):
        scores: dict[str, float] = {u: pressure(in_flight.get(u, 0), reports[u]) for u in candidates}
    else:
        scores = {u: float(in_flight.get(u, 0)) for u in candidates}
    best = min(scores.values())
    return _rotate([u for u in candidates if scores[u] == best], turn)


def pick_round_robin(candidates: Sequence[str], *, turn: int = 0) -> str | None:
    """Each candidate in turn, whatever its load (the baseline the benchmarks compare against)."""
    return _rotate(candidates, turn) if candidates else None


def pick_upstream(
    upstreams: Sequence[str],
    in_flight: Mapping[str, int],
    *,
    exclude: Collection[str] = (),
    ejected: Collection[str] = (),
    turn: int = 0,
    reports: Mapping[str, LoadReport] | None = None,
) -> str | None:
    """The upstream to try next by load, or None when every one was tried (`exclude`)."""
    return pick_least_load(usable(upstreams, exclude=exclude, avoid=ejected), in_flight, reports, turn=turn)


class LoadTracker:
    """Requests in flight per upstream, and ejections after connection failures."""

    def __init__(self, eject_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.eject_seconds = eject_seconds
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self._ejected_until: dict[str, float] = {}
        self._turn = 0

    def next_turn(self) -> int:
        self._turn += 1
        return self._turn

    def ejected(self) -> set[str]:
        now = self.clock()
        for u in [u for u, until in self._ejected_until.items() if until <= now]:
            del self._ejected_until[u]
        return set(self._ejected_until)

    def pick(self, upstreams: Sequence[str], exclude: Collection[str] = ()) -> str | None:
        """Fewest in flight among those not ejected (no reports): the picker's fallback, and the tests'."""
        return pick_upstream(
            upstreams, self.in_flight, exclude=exclude, ejected=self.ejected(), turn=self.next_turn()
        )

    def acquire(self, upstream: str) -> None:
        self.in_flight[upstream] = self.in_flight.get(upstream, 0) + 1

    def release(self, upstream: str) -> None:
        n = self.in_flight.get(upstream, 0) - 1
        if n > 0:
            self.in_flight[upstream] = n
        else:
            self.in_flight.pop(upstream, None)

    def eject(self, upstream: str) -> None:
        self._ejected_until[upstream] = self.clock() + self.eject_seconds

    def reinstate(self, upstream: str) -> None:
        """An upstream that answered is healthy again, whatever an earlier failure said."""
        self._ejected_until.pop(upstream, None)
