"""The TPU benchmark's instruments on a built engine (tpu_worker.py): its prefill program alone per pack
size, a timeline of its calls during a run, the fixed and mixed runs again with larger busy prefill calls,
and where a start's compile time goes.

Where a start goes is read from JAX's own monitoring events (no patching): per program, the seconds spent
tracing to a jaxpr, lowering the jaxpr to an MLIR module, and in the backend step (a compile, or on a
persistent-cache hit the key, the read and the executable's load onto the device), plus the cache's
retrieval time on a hit. Summed they say how much of a start is Python under the GIL (trace, lower) and how
much the backend; their time spans, merged, say how much wall clock each phase covered while the start's
threads ran in parallel.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

from tpu_workloads import run_requests


def prefill_probe(engine, params: int, peak_flops: float, repeats: int = 3) -> list[dict]:
    """The engine's own prefill program, alone on the chip (compiled, nothing else running): per pack of
    r rows of prefill_pack_tokens and per larger bucket filled by one prompt, seconds per call, prompt tokens/s and the share of the matmul peak
    (2 x parameters per token)."""
    import jax

    from vsurge.contracts.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    width = min(engine.prefill_pack_tokens, engine.max_prompt_length)
    out = []
    # packs of r rows of width tokens, then one prompt filling each larger bucket
    shapes = [(r, width) for r in sorted({1, *engine.pack_rows})]
    shapes += [(1, min(n, engine.max_prompt_length)) for n in engine.prefill_lengths if n > width]
    for r, width in shapes:
        prompts = [[5 + i] * width for i in range(r)]

        def call(prompts=prompts, r=r):
            if r > 1:
                return engine.prefill_many(prompts, [greedy] * r)
            return engine.prefill(prompts[0], greedy)

        jax.block_until_ready(call().hidden)
        t0 = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(call().hidden)
        sec = (time.perf_counter() - t0) / repeats
        tokens = r * width
        out.append(
            dict(
                rows=r,
                tokens=tokens,
                call_s=sec,
                tok_s=tokens / sec,
                of_peak=2.0 * params * tokens / sec / peak_flops,
            )
        )
    return out


class Timeline:
    """Benchmark-side instrumentation of one engine: every call of its prefill, first-token, insert and
    decode-block methods (thread, start, return, rows), patched on the instance and removed after; where
    a run's time goes between the prefill thread, the transfer thread and the step thread."""

    NAMES = ("prefill", "prefill_many", "sample_firsts", "insert", "decode_block")

    def __init__(self, engine):
        self.engine, self.calls, self.t0 = engine, [], time.perf_counter()
        for name in self.NAMES:
            setattr(engine, name, self._wrap(name, getattr(engine, name)))

    def _wrap(self, name, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            rows = len(a[0]) if name in ("prefill_many",) else len(a[1]) if name == "sample_firsts" else 1
            self.calls.append(
                (name, threading.current_thread().name, t - self.t0, time.perf_counter() - self.t0, rows)
            )
            return out

        return call

    def close(self) -> dict:
        for name in self.NAMES:
            self.engine.__dict__.pop(name, None)
        out: dict[str, Any] = {}
        for name in self.NAMES:
            mine = [c for c in self.calls if c[0] == name]
            if mine:
                out[name] = dict(
                    calls=len(mine),
                    rows=sum(c[4] for c in mine),
                    host_s=round(sum(c[3] - c[2] for c in mine), 4),
                    first=round(mine[0][2], 4),
                    last=round(mine[-1][3], 4),
                )
        # the prefill-side calls in order (the decode blocks are counted above)
        out["sequence"] = [
            (c[0], c[1], round(c[2], 4), round(c[3], 4), c[4]) for c in self.calls if c[0] != "decode_block"
        ][:200]
        return out


def busy_rows_experiment(surge, engine, args, fixed, mixed, deadline: float) -> dict:
    """The fixed and mixed workloads again with vDriver's prefill calls as large while streams decode as
    on an idle engine (BUSY_PREFILL_PROMPTS / BUSY_PREFILL_ROWS raised to the idle bounds; the programs
    are compiled already): what the busy bounds cost or save on this chip."""
    from vsurge.drivers.dense import vdriver

    saved = vdriver.BUSY_PREFILL_PROMPTS, vdriver.BUSY_PREFILL_ROWS
    vdriver.BUSY_PREFILL_PROMPTS = engine.max_concurrent_prefill
    vdriver.BUSY_PREFILL_ROWS = max(engine.pack_rows, default=1)
    try:
        out = dict(prompts=vdriver.BUSY_PREFILL_PROMPTS, rows=vdriver.BUSY_PREFILL_ROWS)
        out["fixed"] = run_requests(surge, *fixed, max_in_flight=args.batch, deadline=deadline)
        if time.perf_counter() < deadline:
            out["mixed"] = run_requests(surge, *mixed, max_in_flight=args.batch, deadline=deadline)
        return out
    finally:
        vdriver.BUSY_PREFILL_PROMPTS, vdriver.BUSY_PREFILL_ROWS = saved


# JAX's monitoring events of a compile -> the phase StartBreakdown reports them under
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
