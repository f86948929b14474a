"""The TPU benchmark's workloads (tpu_worker.py): a fixed batch (every request in flight at once) and mixed
arriving traffic (twice as many requests as slots, a slot's worth in flight: a request arrives as one
finishes, so prompts are prefilled while others decode), run through `vSurge.complete` on one asyncio
loop as the server does, with TTFT, the decode phase's rate and each thread's CPU time; and the mixed
workload's limit, an estimate: decode steps at the raw loop's step time plus the prompts' matmul FLOPs at
the chip's measured matmul peak, counting only the parameters a token is multiplied by."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import numpy as np

ARRIVING = 2  # the mixed workload's requests per slot: more than the slots, as traffic that keeps coming

_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, summed by thread name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(task.name), "other")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


def run_requests(surge, prompts, outputs, max_in_flight: int, deadline: float) -> dict:
    """Every request through `vSurge.complete` on one asyncio loop (as the server does); tok/s over the
    whole run, TTFT per request. Requests still running at the deadline are cancelled."""
    from vsurge.seed_api.request import vSurgeRequest

    counts = [0] * len(prompts)
    ttft = [None] * len(prompts)
    stamps: list[tuple[float, int]] = []  # (when, tokens) of every item streamed
    first_at: list[float | None] = [None] * len(prompts)

    async def one(i, p, n, sem):
        async with sem:
            req = vSurgeRequest(
                prompt=list(map(int, p)),
                max_tokens=int(n),
                temperature=0.0,
                ignore_eos=True,
                is_client_side_tokenization=True,
            )
            t0 = time.perf_counter()
            async for items in surge.complete(req):
                for s in items:
                    now = time.perf_counter()
                    if counts[i] == 0 and len(s.token_ids):
                        ttft[i] = now - t0
                        first_at[i] = now
                    counts[i] += len(s.token_ids)
                    stamps.append((now, len(s.token_ids)))

    async def run():
        sem = asyncio.Semaphore(max_in_flight)
        tasks = [
            asyncio.create_task(one(i, p, n, sem))
            for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))
        ]
        _, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)

    cpu0 = thread_cpu()
    t0 = time.perf_counter()
    cut = asyncio.run(run())
    wall = time.perf_counter() - t0
    cpu1 = thread_cpu()
    tt = np.array([x for x in ttft if x is not None])
    threads = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
    # once every request has its first token, only decode runs: its rate, apart from the prefill's
    last_first = max((x for x in first_at if x is not None), default=None)
    after = [(t, n) for t, n in stamps if last_first is not None and t > last_first]
    span = (after[-1][0] - last_first) if after else 0.0
    return dict(
        wall_s=wall,
        tokens=sum(counts),
        tok_s=sum(counts) / wall,
        decode_tok_s=sum(n for _, n in after) / span if span > 0 else None,
        ttfts=sorted(round(float(x), 4) for x in tt),
        ttft_p50=float(np.percentile(tt, 50)) if tt.size else None,
        ttft_p90=float(np.percentile(tt, 90)) if tt.size else None,
        cancelled=cut,
        thread_cpu_s={k: round(v, 3) for k, v in threads.items() if v > 0.005},
    )


def workloads(
    vocab: int, batch: int, fixed_prompt: int, fixed_out: int, mixed_max_prompt: int, seed: int = 0
):
    """(fixed, mixed): ``batch`` prompts of ``fixed_prompt`` tokens x ``fixed_out`` tokens; and ARRIVING x
    ``batch`` requests of 32..mixed_max_prompt prompt tokens x 16..256 output tokens (run ``batch`` in flight)."""
    rng = np.random.default_rng(seed)
    hi = min(vocab, 30000)
    fixed = ([rng.integers(2, hi, fixed_prompt) for _ in range(batch)], [fixed_out] * batch)
    lens = rng.integers(32, mixed_max_prompt + 1, ARRIVING * batch)
    mixed = ([rng.integers(2, hi, n) for n in lens], list(rng.integers(16, 257, ARRIVING * batch)))
    return fixed, mixed


def matmul_params(model) -> int:
    """Parameters each token is multiplied by: the matrices (2-D and up; norms and int8 scales are
    elementwise), without the embedding table, which a token only gathers a row of, unless the table is
    also the LM head (tied), where it is multiplied once, as the head."""
    import jax
    from flax import nnx

    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if x.ndim >= 2)
    if model.lm_head is not None:  # untied: the table is gathered only
        total -= model.model.embed_tokens.embedding[...].size
    return int(total)


def matmul_peak(n: int = 8192, dtype: str = "bfloat16", repeats: int = 5) -> float:
    """The device's measured matmul rate in FLOP/s: a jitted n x n x n product of ``dtype``, the best of
    ``repeats`` (the chip's own figure, not its datasheet's)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype) * 0.5
    b = jnp.ones((n, n), dtype) * 0.25
    f = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(f(a, b))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, b))
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def mixed_limit(step_s: float, prompts, outputs, params: int, peak_flops: float, slots: int) -> float:
    """The mixed workload's limit, an estimate in seconds: its decode steps at the raw loop's step time
    (the longest output's, or every output token spread over full slots, whichever is more), plus the
    prompts' matmul FLOPs (2 x the multiplied parameters per token, `matmul_params`) at the measured
    ``peak_flops``. Attention's FLOPs and prefill overlapping decode are left out: a yardstick, not a bound."""
    steps = max(max(outputs), -(-sum(outputs) // slots))
    prefill = 2.0 * params * sum(len(p) for p in prompts) / peak_flops
    return steps * step_s + prefill
