# ruff: noqa: B023 - the probe's closures run inside the loop iteration that made them
"""tpu_probe's sampler and int8 families: a many-row step's sampler over a large vocabulary, and whether int8
weights are read as int8 (per channel against per group)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tpu_probe_harness import section, timeit_compiled  # noqa: E402

# --------------------------------------------------------------------------------------------- sampler


@section("sampler", need=30)
def sampler(s: int, v: int):
    from vsurge.engines.sampling import make_slot_sampling, sample
    from vsurge.sampling_params import SamplingParams

    logits = jax.random.normal(jax.random.key(1), (s, v), jnp.float32) * 3
    counts = jnp.zeros((s, v), jnp.int32)
    pmask = jnp.zeros((s, v), bool)
    step = jnp.zeros((s,), jnp.int32)
    rows = []
    for name, params, top in [
        ("greedy top20", SamplingParams(temperature=0.0), 20),
        ("greedy top0", SamplingParams(temperature=0.0), 0),
        ("T0.8 top_p0.9 top0", SamplingParams(temperature=0.8, top_p=0.9), 0),
        ("T1 top20", SamplingParams(temperature=1.0), 20),
    ]:
        sp = make_slot_sampling([params] * s)
        f = jax.jit(functools.partial(sample, num_top_logprobs=top))
        comp, sec = timeit_compiled(f, logits, sp, counts, pmask, step)
        rows.append(dict(case=name, ms=sec * 1e3, compile_s=comp))
        print(f"sample [{s},{v}] {name:22} {sec * 1e3:8.3f} ms (compile {comp:.1f}s)", flush=True)
    f = jax.jit(lambda x: jnp.argmax(x, axis=-1))
    comp, sec = timeit_compiled(f, logits)
    rows.append(dict(case="jnp.argmax", ms=sec * 1e3, compile_s=comp))
    print(f"jnp.argmax [{s},{v}] {sec * 1e3:8.3f} ms", flush=True)
    return rows


# --------------------------------------------------------------------------------------------- int8


@section("int8 matmuls", need=40)
def int8_matmuls(batch: int, reduced: bool, peak: float | None):
    """Eight different weights of each 8B shape per call (so a call is ms, not dispatch): bf16, int8 per
    channel (G=1) and int8 in groups of 64."""
    from vsurge.models.quantization import int8_matmul, quantize

    shapes = [(4096, 14336), (14336, 4096), (4096, 4096)] if not reduced else [(128, 256)]
    reps = 2 if reduced else 8
    rows = []
    for din, dout in shapes:
        xin = jax.random.normal(jax.random.key(4), (batch, din), jnp.bfloat16)
        ws = [
            jax.random.normal(jax.random.key(10 + i), (din, dout), jnp.bfloat16) * 0.02 for i in range(reps)
        ]
        variants = {
            "bf16": (
                lambda x, ws: sum(jnp.dot(x, w, preferred_element_type=jnp.float32) for w in ws),
                (xin, ws),
            )
        }
        for groups in (1, din // 64):
            qs = [quantize(w, 0, groups) for w in ws]
            variants[f"int8 G={groups}"] = (
                lambda x, qs: sum(int8_matmul(x, q, sc) for q, sc in qs),
                (xin, qs),
            )
        del ws
        for name, (f, args) in variants.items():
            comp, sec = timeit_compiled(jax.jit(f), *args, n=10)
            sec /= reps
            nbytes = din * dout * (2 if name == "bf16" else 1)
            gbps = nbytes / sec / 1e9
            rows.append(dict(shape=f"{din}x{dout}", form=name, ms=sec * 1e3, gbps=gbps))
            print(
                f"matmul [{batch},{din}]x[{din},{dout}] {name:10} {sec * 1e3:8.3f} ms {gbps:7.1f} GB/s"
                + (f" {100 * gbps / peak:5.1f}%" if peak else ""),
                flush=True,
            )
        del variants
    return rows
