"""Where a start's compile time goes, from JAX's own monitoring events (no patching).

JAX reports, per program, the seconds spent tracing to a jaxpr, lowering the jaxpr to an MLIR module, and
in the backend step (a compile, or on a persistent-cache hit the key, the read and the executable's load
onto the device), plus the cache's retrieval time on a hit. Summed they say how much of a start is
Python under the GIL (trace, lower) and how much the backend; their time spans, merged, say how much wall
clock each phase covered while the start's threads ran in parallel.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "backend",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
}


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds of wall clock inside at least one span."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class StartBreakdown:
    """Collects JAX's compile events between construction and `close()`."""

    def __init__(self) -> None:
        import jax.monitoring as m

        self._m = m
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        m.register_event_duration_secs_listener(self._duration)
        m.register_event_time_span_listener(self._span)

    def _duration(self, event: str, secs: float, **_: Any) -> None:
        name = EVENTS.get(event)
        if name:
            with self._lock:
                self.seconds[name] += secs
                self.counts[name] += 1

    def _span(self, event: str, start: float, end: float, **_: Any) -> None:
        name = EVENTS.get(event)
        if name:
            with self._lock:
                self.spans[name].append((start, end))

    def close(self) -> dict[str, Any]:
        for unregister, fn in (
            (self._m.unregister_event_duration_listener, self._duration),
            (self._m.unregister_event_time_span_listener, self._span),
        ):
            try:
                unregister(fn)
            except Exception:  # noqa: BLE001 - a listener JAX already dropped
                pass
        with self._lock:
            out = {
                name: dict(
                    sum_s=round(self.seconds[name], 2),
                    count=self.counts[name],
                    wall_s=round(_covered(self.spans[name]), 2) if self.spans[name] else None,
                )
                for name in EVENTS.values()
                if self.counts[name]
            }
            out["cache_hits"] = self.counts["cache_read"]  # JAX times a cache read only on a hit
        return out
