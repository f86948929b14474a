"""Time one on-device sampling step (`vsurge.engines.sampling.sample`) over all decode slots.

    PYTHONPATH=service python benchmarks/sampling_bench.py [--slots 32] [--vocab 49152] [--iters 30]

Scenarios are timed round-robin in one process (timings on these machines drift up to ~40% between
processes, so only side-by-side numbers compare). "peaked" logits put most of the mass on a handful of
tokens, as a trained LM usually does; "flat" logits (N(0, 1.5^2)) make top_p's nucleus thousands of tokens
wide, which forces the exact (bisection) path on every slot: the worst case.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from vsurge.engines.sampling import make_slot_sampling, sample_jit, seed_key_data
from vsurge.sampling_params import SamplingParams as SP


def peaked_logits(rng: np.random.Generator, s: int, v: int) -> np.ndarray:
    x = rng.normal(size=(s, v)).astype(np.float32) * 2.0
    for i in range(s):
        x[i, rng.choice(v, 16, replace=False)] += rng.uniform(8.0, 14.0, size=16)
    return x


def scenarios(s: int) -> dict[str, tuple[list[SP], bool, str]]:
    """name -> (per-slot params, carry counts/prompt mask, logits kind)."""
    mixed = []
    for i in range(s):
        mixed.append(
            [
                SP(temperature=0.0),
                SP(temperature=0.7, top_p=0.9),
                SP(temperature=0.8, top_k=50, repetition_penalty=1.1),
                SP(temperature=1.0, min_p=0.05, presence_penalty=0.5),
            ][i % 4]
        )
    return {
        "greedy": ([SP(temperature=0.0)] * s, False, "peaked"),
        "greedy + penalties": ([SP(temperature=0.0, repetition_penalty=1.1)] * s, True, "peaked"),
        "temperature only": ([SP(temperature=0.8)] * s, False, "peaked"),
        "top_k=50": ([SP(temperature=0.8, top_k=50)] * s, False, "peaked"),
        "top_p=0.9 (peaked)": ([SP(temperature=0.8, top_p=0.9)] * s, False, "peaked"),
        "mixed + penalties": (mixed, True, "peaked"),
        "top_p=0.95 (flat, exact path)": ([SP(temperature=1.0, top_p=0.95)] * s, False, "flat"),
        "top_k=1000 (exact path)": ([SP(temperature=1.0, top_k=1000)] * s, False, "flat"),
        "1 of 32 slots exact, rest greedy": (
            [SP(temperature=1.0, top_p=0.95)] + [SP(temperature=0.0)] * (s - 1),
            False,
            "flat",
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    s, v = args.slots, args.vocab
    rng = np.random.default_rng(0)
    logits = {
        "peaked": jnp.asarray(peaked_logits(rng, s, v)),
        "flat": jnp.asarray(rng.normal(size=(s, v)).astype(np.float32) * 1.5),
    }
    counts = jnp.asarray(rng.integers(0, 2, size=(s, v)) * (rng.random((s, v)) < 0.005), jnp.int32)
    pmask = jnp.asarray(rng.random((s, v)) < 0.005)
    cases = {}
    for name, (sps, hist, kind) in scenarios(s).items():
        params = make_slot_sampling(sps, keys=[seed_key_data(i) for i in range(s)])
        args_ = (logits[kind], params, counts if hist else None, pmask if hist else None)
        cases[name] = args_

    step = jnp.zeros((s,), jnp.int32)
    t0 = time.perf_counter()
    for a in cases.values():  # compile every variant first
        sample_jit(*a, step).tokens.block_until_ready()
    compile_s = time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, a in cases.items():
            out = sample_jit(*a, step)
            out.tokens.block_until_ready()
            t = time.perf_counter()
            for i in range(args.iters):
                out = sample_jit(*a, step + i)
            out.tokens.block_until_ready()
            times[name].append((time.perf_counter() - t) / args.iters * 1e3)

    print(f"sample() step, S={s} slots, V={v}, jax {jax.__version__} on {jax.devices()[0].platform}")
    print(
        f"(compile of all variants: {compile_s:.1f} s; median of {args.rounds} rounds x {args.iters} steps)"
    )
    for name, ts in times.items():
        print(f"  {name:36s} {statistics.median(ts):8.2f} ms   (min {min(ts):.2f})")


if __name__ == "__main__":
    main()
