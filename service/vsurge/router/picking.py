"""Replica picking: the upstream with the fewest requests in flight.

`pick_upstream` is a pure function of the candidates, the in-flight counts, what was already tried for
this request and which upstreams were recently ejected. `LoadTracker` only keeps those numbers.

Why fewest-in-flight: a vSurge replica has a fixed number of decode slots and generation lengths vary a lot,
so round robin piles long requests on one replica; counting open requests (streams included, until their
last byte) follows the real load with no extra traffic. Ties rotate (`turn`) so that an idle pool is used
evenly. An upstream that refused a connection is ejected for a few seconds, so the next requests do not
pay a failed connect each; when every candidate is ejected they are tried anyway, since a stale ejection
costs one connect and a refusal costs the whole request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence


def pick_upstream(
    upstreams: Sequence[str],
    in_flight: Mapping[str, int],
    *,
    exclude: Collection[str] = (),
    ejected: Collection[str] = (),
    turn: int = 0,
) -> str | None:
    """The upstream to try next, or None when every one was tried (`exclude`).

    Among the candidates not ejected (all candidates if each one is), the one with the fewest requests in
    flight; ties are broken by `turn` modulo the number tied, in the given order.
    """
    candidates = [u for u in upstreams if u not in exclude]
    if not candidates:
        return None
    healthy = [u for u in candidates if u not in ejected] or candidates
    least = min(in_flight.get(u, 0) for u in healthy)
    tied = [u for u in healthy if in_flight.get(u, 0) == least]
    return tied[turn % len(tied)]


class LoadTracker:
    """Requests in flight per upstream, and ejections after connection failures."""

    def __init__(self, eject_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.eject_seconds = eject_seconds
        self.clock = clock
        self.in_flight: dict[str, int] = {}
        self._ejected_until: dict[str, float] = {}
        self._turn = 0

    def ejected(self) -> set[str]:
        now = self.clock()
        for u in [u for u, until in self._ejected_until.items() if until <= now]:
            del self._ejected_until[u]
        return set(self._ejected_until)

    def pick(self, upstreams: Sequence[str], exclude: Collection[str] = ()) -> str | None:
        self._turn += 1
        return pick_upstream(
            upstreams, self.in_flight, exclude=exclude, ejected=self.ejected(), turn=self._turn
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
