"""The decode step under the layer scan, by cache layout, against the unrolled layers.

    python benchmarks/tpu_layer_layouts.py --shape 1b64 --out $OUT/unroll.json     # on the TPU machine, ~2 min
    python benchmarks/tpu_layer_layouts.py --reduced                               # CPU smoke test

One process, random weights made on the device (benchmarks/device_check.py's `random_model`), greedy
decode steps of `batch` rows at `context` positions as vdriver runs them (flat dense rows, the backend's
read), the layers run four ways: unrolled with one cache per layer (the engine before the scan), unrolled
over the stacked cache, unrolled over stacked weights (static slices), and under the scan; the stacked
cache rows first [S, L, M, KVH * D] or layers first [L, S, M, KVH * D] (`kv_stack.LAYER_AXIS`). Per
variant: compile seconds and the best of two passes' ms per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(model, variant: str, axis: int, batch: int, context: int, max_length: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from vsurge.models import kv_stack, layer_stack
    from vsurge.models.attention import DenseDecodeAttention
    from vsurge.models.kv_stack import StackedKV

    cfg = model.config
    kv_stack.LAYER_AXIS = axis
    if variant in ("scan", "stacked-weights-unrolled"):
        layer_stack.stack_layers(model)
        layer_stack.SCAN_CACHED = variant == "scan"
    else:
        layer_stack.unstack_layers(model)
    graphdef, params = nnx.split(model)
    dt = model.dtype
    f = cfg.num_kv_heads * cfg.head_dim
    if variant == "per-layer":
        one = (batch, max_length, f)
        caches = tuple((jnp.zeros(one, dt), jnp.zeros(one, dt)) for _ in range(cfg.num_layers))
    else:
        shape = (
            (batch, cfg.num_layers, max_length, f) if axis == 1 else (cfg.num_layers, batch, max_length, f)
        )
        caches = StackedKV(jnp.zeros(shape, dt), jnp.zeros(shape, dt))
    backend = DenseDecodeAttention(window=cfg.sliding_window)

    def step(params, caches, tokens, pos):
        m = nnx.merge(graphdef, params)
        hidden, new = m(tokens[:, None], pos[:, None], backend, caches, (pos, pos + 1))
        nxt = jnp.argmax(m.compute_logits(hidden[:, 0]), axis=-1).astype(jnp.int32)
        return (new if isinstance(new, StackedKV) else tuple(new)), nxt

    step = jax.jit(step, donate_argnums=(1,))
    tokens = jnp.ones((batch,), jnp.int32)
    pos = jnp.full((batch,), context - 1, jnp.int32)
    t0 = time.perf_counter()
    caches, tokens = step(params, caches, tokens, pos)
    tokens.block_until_ready()
    compile_s = time.perf_counter() - t0
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(steps):
            caches, tokens = step(params, caches, tokens, pos)
        tokens.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / steps)
    del caches
    layer_stack.SCAN_CACHED = True
    out = dict(variant=variant, cache=("rows first" if axis == 1 else "layers first"))
    return dict(out, compile_s=round(compile_s, 2), step_ms=round(best * 1e3, 3))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1b64")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reduced", action="store_true", help="a tiny model (CPU smoke test)")
    p.add_argument("--out")
    args = p.parse_args(argv)

    import jax.numpy as jnp
    from device_check import random_model
    from tpu_probe_harness import SHAPES, TINY

    if args.reduced:
        cfg, dt = replace(TINY, num_layers=4), jnp.float32
        args.batch, args.context, args.max_length, args.steps = 4, 24, 64, 2
    else:
        cfg, dt = SHAPES[args.shape], jnp.bfloat16
    model = random_model(cfg, dt, "none")
    variants = [("per-layer", 1), ("scan", 0), ("stacked-weights-unrolled", 1), ("scan", 1)]
    variants += [("stacked-weights-unrolled", 0), ("stacked-unrolled", 0), ("per-layer", 1)]
    rows = []
    for variant, axis in variants:
        try:
            row = measure(model, variant, axis, args.batch, args.context, args.max_length, args.steps)
        except Exception as e:  # noqa: BLE001 - each variant stands alone
            row = dict(variant=variant, axis=axis, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(
                json.dumps(dict(shape=args.shape, batch=args.batch, rows=rows), indent=1)
            )
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
