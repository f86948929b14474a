# ruff: noqa: B023 - the probe's closures run inside the loop iteration that made them
"""tpu_probe's model family: the model's bare decode step against the engines' own decode programs (vEngine,
oEngine) at a shape, batch and context."""

from __future__ import annotations

import functools
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from device_check import random_model, weight_bytes  # noqa: E402
from flax import nnx  # noqa: E402
from tpu_probe_attention import rpa, xla_bucket, xla_flat  # noqa: E402
from tpu_probe_harness import RESULTS, SHAPES, TINY, left, section  # noqa: E402

# --------------------------------------------------------------------------------------------- models


@section("decode steps", need=90)
def decode_steps(shape: str, batch: int, context: int, m: int, reduced: bool, peak: float | None):
    """The model's bare decode step (argmax) with the current dense attention, the bucketed einsum, and the
    ragged kernel over pages; then vEngine's and oEngine's own decode programs at the same batch."""
    from vsurge.models.attention import DenseDecodeAttention

    cfg = SHAPES[shape] if not reduced else TINY
    model = random_model(cfg, jnp.bfloat16, "none")
    graphdef, state = nnx.split(model)
    wbytes = weight_bytes(model)
    kvh, d = cfg.num_kv_heads, cfg.head_dim
    kv_bytes = batch * context * cfg.num_layers * 2 * kvh * d * 2
    rows = []
    positions = jnp.full((batch,), context - 1, jnp.int32)

    def bare(backend, caches, meta):
        @functools.partial(jax.jit, donate_argnums=(1,))
        def step(state, caches, tokens, meta):
            mdl = nnx.merge(graphdef, state)
            hidden, caches = mdl(tokens[:, None], positions[:, None], backend, caches, meta)
            return jnp.argmax(mdl.compute_logits(hidden[:, 0]), axis=-1).astype(jnp.int32), caches

        return step, caches, meta

    def run(name, step, caches, meta, n=10):
        tokens = jnp.zeros((batch,), jnp.int32)
        t0 = time.perf_counter()
        tokens, caches = step(state, caches, tokens, meta)
        jax.block_until_ready(tokens)
        comp = time.perf_counter() - t0
        for _ in range(2):
            tokens, caches = step(state, caches, tokens, meta)
        jax.block_until_ready(tokens)
        t0 = time.perf_counter()
        for _ in range(n):
            tokens, caches = step(state, caches, tokens, meta)
        jax.block_until_ready(tokens)
        sec = (time.perf_counter() - t0) / n
        gbps = (wbytes + kv_bytes) / sec / 1e9
        row = dict(shape=shape, form=name, step_ms=sec * 1e3, tok_s=batch / sec, compile_s=comp, gbps=gbps)
        if peak:
            row["pct_roofline"] = 100 * gbps / peak
        rows.append(row)
        print(
            f"{shape:6} b{batch} ctx{context} {name:34} {sec * 1e3:8.3f} ms {batch / sec:9.1f} tok/s "
            f"{gbps:7.1f} GB/s"
            + (f" {100 * gbps / peak:5.1f}%" if peak else "")
            + f" (first call {comp:.1f}s)",
            flush=True,
        )
        return caches

    shape_kv = (batch, m, kvh, d)

    class Bucketed:
        """Write at positions, then xla_bucket over the first `bucket` positions."""

        def __init__(self, bucket):
            self.bucket = bucket

        def __call__(self, q, k, v, cache, meta):
            kc, vc = cache
            pos = meta
            rows_ = jnp.arange(q.shape[0])
            kc = kc.at[rows_, pos].set(k[:, 0].astype(kc.dtype))
            vc = vc.at[rows_, pos].set(v[:, 0].astype(vc.dtype))
            out = xla_bucket(q[:, 0], kc, vc, pos + 1, bucket=self.bucket)
            return out[:, None].astype(q.dtype), (kc, vc)

    class Flat:
        """Cache [S, M, KVH*D]: write the token's heads flat, then xla_flat over the first `bucket`."""

        def __init__(self, bucket):
            self.bucket = bucket

        def __call__(self, q, k, v, cache, meta):
            kc, vc = cache
            pos = meta
            rows_ = jnp.arange(q.shape[0])
            kc = kc.at[rows_, pos].set(k[:, 0].reshape(q.shape[0], -1).astype(kc.dtype))
            vc = vc.at[rows_, pos].set(v[:, 0].reshape(q.shape[0], -1).astype(vc.dtype))
            out = xla_flat(q[:, 0], kc, vc, pos + 1, bucket=self.bucket)
            return out[:, None].astype(q.dtype), (kc, vc)

    bucket = min(m, int(-(-context // 128) * 128))
    for name, backend, kv_shape in [
        ("bare dense current", DenseDecodeAttention(window=None), shape_kv),
        (f"bare xla_bucket{bucket}", Bucketed(bucket), shape_kv),
        (f"bare xla_flat{bucket}", Flat(bucket), (batch, m, kvh * d)),
    ]:
        if left() < 40:
            break
        try:
            caches = [
                (jnp.zeros(kv_shape, jnp.bfloat16), jnp.zeros(kv_shape, jnp.bfloat16))
                for _ in range(cfg.num_layers)
            ]
            step, caches, meta = bare(backend, caches, positions)
            caches = run(name, step, caches, meta)
            del caches
        except Exception as e:  # noqa: BLE001
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)

    # the ragged kernel over combined pages, head_dim padded to 128
    interpret = jax.default_backend() != "tpu"
    dpad = max(128, -(-d // 128) * 128)
    best = RESULTS.get("best_rpa", {}).get(shape, (None, None, 128))
    kvb, qb, ps = best
    if reduced:
        kvb, qb, ps = 2, 8, 16

    class Paged:
        def __call__(self, q, k, v, cache, meta):
            table = meta
            per = table.shape[1]
            pos = positions
            page = table[jnp.arange(q.shape[0]), pos // ps]
            kk, vv = k[:, 0], v[:, 0]
            if dpad != d:
                kk = jnp.pad(kk, [(0, 0), (0, 0), (0, dpad - d)])
                vv = jnp.pad(vv, [(0, 0), (0, 0), (0, dpad - d)])
            comb = jnp.stack([kk, vv], axis=2).reshape(q.shape[0], 2 * kvh, dpad)
            cache = cache.at[page, pos % ps].set(comb.astype(cache.dtype))
            del per
            out = rpa(q[:, 0], cache, pos + 1, table, kvb=kvb, qb=qb, interpret=interpret, d=d)
            return out[:, None].astype(q.dtype), cache

    if left() > 40:
        try:
            per_row = m // ps
            caches = [
                jnp.zeros((batch * per_row, ps, 2 * kvh, dpad), jnp.bfloat16) for _ in range(cfg.num_layers)
            ]
            table = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
            step, caches, meta = bare(Paged(), caches, table)
            caches = run(f"bare rpa ps={ps} kvb={kvb} qb={qb}", step, caches, meta)
            del caches
        except Exception as e:  # noqa: BLE001
            print(f"bare rpa: {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3)

    # the engines' own decode programs on the same model (greedy rows, top-20 logprobs as the server asks)
    if left() > 60:
        try:
            rows += engine_decode(model, shape, batch, context, m, wbytes, kv_bytes, peak)
        except Exception as e:  # noqa: BLE001
            print(f"engine decode: {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=5)
    return rows


def engine_decode(model, shape, batch, context, m, wbytes, kv_bytes, peak):
    from vsurge.engines.vengine import vEngine

    rows = []
    eng = vEngine(model, None, max_concurrent_decodes=batch, max_length=m, prefill_lengths=[min(128, m // 2)])
    st = eng.init_decode_state()
    st = st._replace(positions=jnp.full((batch,), context - 1, jnp.int32))
    eng._active[:] = True
    eng._pos[:] = context - 1
    r = eng.decode_rows[-1]
    lengths = np.full(r, context, np.int32)
    fn = eng._decode[r]
    params = eng.step_params(r)
    t0 = time.perf_counter()
    st, out = fn(params, st, lengths)
    jax.block_until_ready(out)
    comp = time.perf_counter() - t0
    for _ in range(2):
        st, out = fn(params, st, lengths)
    jax.block_until_ready(out)
    n = 10
    t0 = time.perf_counter()
    for _ in range(n):
        st, out = fn(params, st, lengths)
    jax.block_until_ready(out)
    sec = (time.perf_counter() - t0) / n
    # the same through engine.decode() (host bookkeeping + dispatch), async like the step thread
    eng._pos[:] = context - 1
    st = st._replace(positions=jnp.full((batch,), context - 1, jnp.int32))
    t0 = time.perf_counter()
    host = 0.0
    for _ in range(n):
        h0 = time.perf_counter()
        st, out = eng.decode(st)
        host += time.perf_counter() - h0
        for leaf in out:
            leaf.copy_to_host_async()
    jax.block_until_ready(out)
    sec2 = (time.perf_counter() - t0) / n
    for name, s_ in [("vEngine._decode program", sec), ("vEngine.decode() async loop", sec2)]:
        gbps = (wbytes + kv_bytes) / s_ / 1e9
        row = dict(shape=shape, form=name, step_ms=s_ * 1e3, tok_s=batch / s_, compile_s=comp, gbps=gbps)
        if peak:
            row["pct_roofline"] = 100 * gbps / peak
        rows.append(row)
        print(
            f"{shape:6} b{batch} ctx{context} {name:34} {s_ * 1e3:8.3f} ms {batch / s_:9.1f} tok/s "
            + (f"{100 * gbps / peak:5.1f}%" if peak else ""),
            flush=True,
        )
    print(f"  host time in engine.decode() per step: {host / n * 1e3:.3f} ms", flush=True)
    rows.append(dict(shape=shape, form="vEngine.decode host ms", value=host / n * 1e3))
    del st, eng
    if model.config.head_dim % 128 == 0 and left() > 40:
        rows += oengine_decode(model, shape, batch, context, m, wbytes, kv_bytes, peak)
    return rows


def oengine_decode(model, shape, batch, context, m, wbytes, kv_bytes, peak):
    from vsurge.engines.oengine import oEngine

    rows = []
    ps = 128
    per = m // ps
    eng = oEngine(
        model,
        None,
        attention="pallas",
        max_concurrent_decodes=batch,
        max_length=m,
        page_size=ps,
        kv_cache_bytes=(batch * per + 2)
        * ps
        * model.config.num_layers
        * 2
        * model.config.num_kv_heads
        * model.config.head_dim
        * 2,
        prefill_lengths=[128],
    )
    st = eng.init_decode_state()
    st = st._replace(positions=jnp.full((batch,), context - 1, jnp.int32))
    table = jnp.asarray(
        1 + np.arange(batch * per, dtype=np.int32).reshape(batch, per) % (eng.manager.num_pages - 1)
    )
    r = eng.step_rows[-1]
    fn = eng._mixed[(r, 0)]
    from vsurge.engines.mixed_step import pack_meta

    meta = pack_meta(eng._layout(r, 0), [], np.ones(r, np.int32))
    t0 = time.perf_counter()
    pages, logits, _ = fn(eng.params, st.pages, st.tokens, st.positions, table, meta)
    st = st._replace(pages=pages)
    st, out = eng._sample[r](st, logits)
    jax.block_until_ready(out)
    comp = time.perf_counter() - t0
    pages, logits, _ = fn(eng.params, st.pages, st.tokens, st.positions, table, meta)
    st = st._replace(pages=pages)
    st, out = eng._sample[r](st, logits)
    jax.block_until_ready(out)
    n = 10
    for label, with_sampler in [
        ("oEngine mixed step program", False),
        ("oEngine mixed step + sampler", True),
    ]:
        t0 = time.perf_counter()
        for _ in range(n):
            pages, logits, _ = fn(eng.params, st.pages, st.tokens, st.positions, table, meta)
            st = st._replace(pages=pages)
            if with_sampler:
                st, out = eng._sample[r](st, logits)
        jax.block_until_ready((st.pages, logits))
        sec = (time.perf_counter() - t0) / n
        gbps = (wbytes + kv_bytes) / sec / 1e9
        row = dict(shape=shape, form=label, step_ms=sec * 1e3, tok_s=batch / sec, compile_s=comp, gbps=gbps)
        if peak:
            row["pct_roofline"] = 100 * gbps / peak
        rows.append(row)
        print(
            f"{shape:6} b{batch} ctx{context} {label:34} {sec * 1e3:8.3f} ms {batch / sec:9.1f} tok/s "
            + (f"{100 * gbps / peak:5.1f}%" if peak else "")
            + f" (first {comp:.1f}s)",
            flush=True,
        )
    del st, eng
    return rows
