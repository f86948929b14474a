# ruff: noqa: B023 - the probe's closures run inside the loop iteration that made them
"""Where a TPU decode step's time goes: attention forms, the ragged kernel's block sizes, the sampler, int8
matmuls and the engines' own decode programs, each timed alone on the chip (one process, a time budget).

    python benchmarks/tpu_probe.py --out results.json          # on the TPU machine (<= ~8 min)
    python benchmarks/tpu_probe.py --reduced                   # tiny shapes on CPU (a smoke test)

It answers the questions a TPU engine's design turns on, with numbers from the chip rather than guesses:
which dense-cache attention form reads the KV cache at HBM speed for head_dim 64 and 128; how fast JAX's
ragged paged attention kernel is per block size (head_dim 64 padded to the 128 lanes); what the sampler
adds to a 64-row step over a 128k vocabulary; whether int8 weights are read as int8 (per channel against
per group of 64); and how far the engines' decode programs are from the model's bare step.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from device_check import SHAPES, peak_gbps, random_model, weight_bytes  # noqa: E402
from flax import nnx  # noqa: E402

RESULTS: dict[str, Any] = {"sections": {}, "errors": []}
DEADLINE = [float("inf")]


def left() -> float:
    return DEADLINE[0] - time.perf_counter()


def section(name: str, need: float = 5.0):
    """Run a section if `need` seconds are left; record its result or its error."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*a, **kw):
            if left() < need:
                print(f"## {name}: skipped (time budget, {left():.0f}s left)", flush=True)
                RESULTS["sections"][name] = "skipped"
                return None
            t0 = time.perf_counter()
            print(f"## {name}", flush=True)
            try:
                out = fn(*a, **kw)
                RESULTS["sections"][name] = out
                return out
            except Exception as e:  # noqa: BLE001 - every section stands alone
                msg = f"{name}: {type(e).__name__}: {str(e)[:400]}"
                print("ERROR", msg, flush=True)
                traceback.print_exc(limit=4)
                RESULTS["errors"].append(msg)
                return None
            finally:
                print(f"## {name} took {time.perf_counter() - t0:.1f}s", flush=True)

        return run

    return wrap


def timeit(fn, *args, n: int = 10, warm: int = 2) -> float:
    """Median seconds per call (block_until_ready each), after warm-up calls (compile included there)."""
    out = None
    for _ in range(warm):
        out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def timeit_compiled(fn, *args, n: int = 10) -> tuple[float, float]:
    t0 = time.perf_counter()
    c = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    return compile_s, timeit(c, *args, n=n)


# --------------------------------------------------------------------------------------------- shapes

SHAPES = dict(SHAPES)
SHAPES["1b64"] = SHAPES["1b"]
SHAPES["1b128"] = replace(SHAPES["1b"], num_heads=16, head_dim=128)
TINY = replace(SHAPES["tiny"], head_dim=64, num_heads=4, num_kv_heads=2, hidden_size=256)


# --------------------------------------------------------------------------------------------- memory


@section("hbm padding of a 64-wide minor dim")
def memory_layout():
    dev = jax.devices()[0]
    if not hasattr(dev, "memory_stats") or dev.memory_stats() is None:
        return "no memory_stats"
    out = {}
    for shape in [(1 << 20, 64), (1 << 20, 128), (1 << 16, 8, 128), (1 << 16, 8, 64), (1 << 16, 16, 64)]:
        before = dev.memory_stats()["bytes_in_use"]
        x = jnp.zeros(shape, jnp.bfloat16)
        x.block_until_ready()
        after = dev.memory_stats()["bytes_in_use"]
        out[str(shape)] = dict(logical=int(np.prod(shape)) * 2, allocated=int(after - before))
        del x
    print(json.dumps(out), flush=True)
    return out


# --------------------------------------------------------------------------------------------- attention


def _attn_inputs(cfg, s: int, m: int, lengths: np.ndarray, layers: int, dp: int | None = None):
    kvh, d, h = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    key = jax.random.key(0)
    q = jax.random.normal(key, (s, h, d), jnp.bfloat16)
    kc = [jax.random.normal(jax.random.fold_in(key, i), (s, m, kvh, d), jnp.bfloat16) for i in range(layers)]
    vc = [
        jax.random.normal(jax.random.fold_in(key, 100 + i), (s, m, kvh, d), jnp.bfloat16)
        for i in range(layers)
    ]
    return q, kc, vc, jnp.asarray(lengths, jnp.int32)


def xla_bucket(q, kc, vc, lengths, *, bucket: int):
    """Dense rows, one einsum pair over the first `bucket` positions of every row (bf16 in, f32 acc)."""
    s, h, d = q.shape
    kvh = kc.shape[2]
    qg = q.reshape(s, kvh, h // kvh, d)
    k, v = kc[:, :bucket], vc[:, :bucket]
    sc = jnp.einsum("skgd,slkd->skgl", qg, k, preferred_element_type=jnp.float32) / np.sqrt(d)
    ok = jnp.arange(bucket)[None, :] < lengths[:, None]
    sc = jnp.where(ok[:, None, None, :], sc, -1e30)
    p = jax.nn.softmax(sc, axis=-1).astype(v.dtype)
    return jnp.einsum("skgl,slkd->skgd", p, v, preferred_element_type=jnp.float32).reshape(s, h, d)


def xla_headmajor(q, kc, vc, lengths, *, bucket: int):
    """As xla_bucket over a [S, KVH, M, D] cache."""
    s, h, d = q.shape
    kvh = kc.shape[1]
    qg = q.reshape(s, kvh, h // kvh, d)
    k, v = kc[:, :, :bucket], vc[:, :, :bucket]
    sc = jnp.einsum("skgd,skld->skgl", qg, k, preferred_element_type=jnp.float32) / np.sqrt(d)
    ok = jnp.arange(bucket)[None, :] < lengths[:, None]
    sc = jnp.where(ok[:, None, None, :], sc, -1e30)
    p = jax.nn.softmax(sc, axis=-1).astype(v.dtype)
    return jnp.einsum("skgl,skld->skgd", p, v, preferred_element_type=jnp.float32).reshape(s, h, d)


def xla_flat(q, kc, vc, lengths, *, bucket: int):
    """Dense rows stored [S, M, KVH*D] (lane-dense for head_dim 64): a block-diagonal query against every
    head's lanes, then the diagonal blocks of the output."""
    s, h, d = q.shape
    c = kc.shape[-1]
    kvh = c // d
    g = h // kvh
    eye = jnp.eye(kvh, dtype=q.dtype)
    qb = (q.reshape(s, kvh, g, 1, d) * eye[None, :, None, :, None]).reshape(s, h, c)
    k, v = kc[:, :bucket], vc[:, :bucket]
    sc = jnp.einsum("shc,slc->shl", qb, k, preferred_element_type=jnp.float32) / np.sqrt(d)
    ok = jnp.arange(bucket)[None, :] < lengths[:, None]
    sc = jnp.where(ok[:, None, :], sc, -1e30)
    p = jax.nn.softmax(sc, axis=-1).astype(v.dtype)
    o = jnp.einsum("shl,slc->shc", p, v, preferred_element_type=jnp.float32).reshape(s, kvh, g, kvh, d)
    return jnp.einsum("skgjd,kj->skgd", o, eye.astype(jnp.float32)).reshape(s, h, d)


def current_dense(q, kc, vc, lengths):
    from vsurge.models.attention import read_dense_rows

    s, h, d = q.shape
    kvh = kc.shape[2]
    qg = q.reshape(s, 1, kvh, h // kvh, d).astype(jnp.float32) / np.sqrt(d)
    pos = (lengths - 1)[:, None]
    return read_dense_rows(qg, kc, vc, pos, lengths, window=None, chunk=128, size=kc.shape[1]).reshape(
        s, h, d
    )


def to_pages(kc, vc, page_size: int, dpad: int):
    """Dense rows K, V [S, M, KVH, D] -> combined pages [S*M/ps, ps, 2*KVH, dpad] (K even, V odd heads)."""
    s, m, kvh, d = kc.shape
    if dpad != d:
        pad = [(0, 0)] * 3 + [(0, dpad - d)]
        kc, vc = jnp.pad(kc, pad), jnp.pad(vc, pad)
    comb = jnp.stack([kc, vc], axis=3).reshape(s, m, 2 * kvh, dpad)
    return comb.reshape(s * m // page_size, page_size, 2 * kvh, dpad)


def rpa(q, pages, lengths, table, *, kvb, qb, interpret: bool, d: int):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    s, h, _ = q.shape
    dpad = pages.shape[-1]
    if dpad != q.shape[-1]:
        q = jnp.pad(q, [(0, 0), (0, 0), (0, dpad - q.shape[-1])])
    cu = jnp.arange(s + 1, dtype=jnp.int32)
    kw = {}
    if kvb is not None:
        kw = dict(num_kv_pages_per_block=min(kvb, table.shape[1]), num_queries_per_block=qb)
    if interpret:
        from jax.experimental.pallas import tpu as pltpu

        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            out = ragged_paged_attention(
                q, pages, lengths, table, cu, jnp.array([s], jnp.int32), sm_scale=1 / np.sqrt(d), **kw
            )
    else:
        out = ragged_paged_attention(
            q, pages, lengths, table, cu, jnp.array([s], jnp.int32), sm_scale=1 / np.sqrt(d), **kw
        )
    return out[..., :d]


def decode_pa(q, kp, vp, lengths, table, *, ppcb, d):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    return paged_attention(q, kp, vp, lengths, table, pages_per_compute_block=ppcb)[..., :d]


@section("attention forms", need=60)
def attention_forms(shape: str, s: int, m: int, layers: int, reduced: bool, peak: float | None):
    cfg = SHAPES[shape] if not reduced else TINY
    rng = np.random.RandomState(0)
    cases = {
        "fixed400": np.full(s, min(400, m - 1)),
        "mixed32-768": rng.randint(32, min(768, m), size=s),
    }
    rows = []
    kvh, d = cfg.num_kv_heads, cfg.head_dim
    for case, lengths in cases.items():
        q, kc, vc, lens = _attn_inputs(cfg, s, m, lengths, layers)
        ideal = int(lengths.sum()) * kvh * d * 2 * 2 * layers
        bucket = min(m, int(-(-int(lengths.max()) // 128) * 128))

        def over_layers(f):
            @jax.jit
            def run(q, kc, vc, lens):
                acc = jnp.zeros(q.shape, jnp.float32)
                for i in range(len(kc)):
                    acc = acc + f(q, kc[i], vc[i], lens).astype(jnp.float32)
                return acc

            return run

        forms = {
            "current_dense": over_layers(current_dense),
            "xla_bucket": over_layers(functools.partial(xla_bucket, bucket=bucket)),
        }
        khm = [jnp.swapaxes(k, 1, 2) for k in kc]
        vhm = [jnp.swapaxes(v, 1, 2) for v in vc]
        kfl = [k.reshape(s, m, kvh * d) for k in kc]
        vfl = [v.reshape(s, m, kvh * d) for v in vc]

        def report(name, sec, comp, extra=None):
            gbps = ideal / sec / 1e9
            row = dict(shape=shape, case=case, form=name, ms=sec * 1e3, compile_s=comp, gbps_ideal=gbps)
            if peak:
                row["pct_peak"] = 100 * gbps / peak
            row.update(extra or {})
            rows.append(row)
            print(
                f"{shape:6} {case:12} {name:28} {sec * 1e3:8.3f} ms  {gbps:7.1f} GB/s"
                + (f" {100 * gbps / peak:5.1f}%" if peak else "")
                + f"  (compile {comp:.1f}s)",
                flush=True,
            )

        for name, f in forms.items():
            if left() < 20:
                break
            try:
                comp, sec = timeit_compiled(f, q, kc, vc, lens)
                report(name, sec, comp)
            except Exception as e:  # noqa: BLE001
                print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        for name, f, args in [
            (
                "xla_headmajor",
                over_layers(functools.partial(xla_headmajor, bucket=bucket)),
                (q, khm, vhm, lens),
            ),
            (
                "xla_flat_blockdiag",
                over_layers(functools.partial(xla_flat, bucket=bucket)),
                (q, kfl, vfl, lens),
            ),
        ]:
            if left() < 20:
                break
            try:
                comp, sec = timeit_compiled(f, *args)
                report(name, sec, comp)
            except Exception as e:  # noqa: BLE001
                print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del khm, vhm, kfl, vfl
        # the ragged kernel over the same rows as pages (identity table), head_dim padded to 128
        interpret = jax.default_backend() != "tpu"
        dpad = max(128, -(-d // 128) * 128)
        for ps in [16] if reduced else [64, 128]:
            if left() < 30:
                break
            pages = [to_pages(k, v, ps, dpad) for k, v in zip(kc, vc, strict=True)]
            per_row = m // ps
            table = jnp.arange(s * per_row, dtype=jnp.int32).reshape(s, per_row)
            if reduced:
                blocks = [(2, 8)]
            elif ps == 128:
                blocks = [(None, None), (4, 8), (8, 32), (16, 64)]
            else:
                blocks = [(8, 32)]
            for kvb, qb in blocks:
                if left() < 20:
                    break
                f = jax.jit(
                    lambda q, pages, lens, table, kvb=kvb, qb=qb: sum(
                        rpa(q, p, lens, table, kvb=kvb, qb=qb, interpret=interpret, d=d).astype(jnp.float32)
                        for p in pages
                    )
                )
                try:
                    comp, sec = timeit_compiled(f, q, pages, lens, table, n=5 if reduced else 10)
                    report(f"rpa ps={ps} kvb={kvb} qb={qb}", sec, comp, dict(page_size=ps, kvb=kvb, qb=qb))
                except Exception as e:  # noqa: BLE001
                    print(f"rpa ps={ps} kvb={kvb} qb={qb}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            del pages
        # the decode-only paged kernel, head-major pages [KVH, P, ps, D]
        if not reduced and jax.default_backend() == "tpu":
            for ps, ppcb in [(128, 8)]:
                if left() < 20:
                    break
                kp = [jnp.swapaxes(k, 1, 2).swapaxes(0, 1).reshape(kvh, s * m // ps, ps, d) for k in kc]
                vp = [jnp.swapaxes(v, 1, 2).swapaxes(0, 1).reshape(kvh, s * m // ps, ps, d) for v in vc]
                table = jnp.arange(s * (m // ps), dtype=jnp.int32).reshape(s, m // ps)
                f = jax.jit(
                    lambda q, kp, vp, lens, table, ppcb=ppcb: sum(
                        decode_pa(q, a, b, lens, table, ppcb=ppcb, d=d).astype(jnp.float32)
                        for a, b in zip(kp, vp, strict=True)
                    )
                )
                try:
                    comp, sec = timeit_compiled(f, q, kp, vp, lens, table)
                    report(f"paged_attention ps={ps} ppcb={ppcb}", sec, comp)
                except Exception as e:  # noqa: BLE001
                    print(f"paged_attention ps={ps}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                del kp, vp
        del q, kc, vc
    return rows


# --------------------------------------------------------------------------------------------- sampler


@section("sampler", need=30)
def sampler(s: int, v: int):
    from vsurge.engines.sampling import SamplingParams, make_slot_sampling, sample

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reduced", action="store_true")
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", default="1b64,1b128")
    p.add_argument("--skip", default="", help="comma list of sections: attention,sampler,int8,decode,memory")
    a = p.parse_args(argv)
    DEADLINE[0] = time.perf_counter() + a.budget_s
    dev = jax.devices()[0]
    peak = peak_gbps(dev.device_kind)
    RESULTS.update(device=dev.device_kind, jax=jax.__version__, peak_gbps=peak)
    print(f"device {dev.device_kind} jax {jax.__version__} peak {peak}", flush=True)
    skip = set(a.skip.split(","))
    s, m, layers = (8, 64, 2) if a.reduced else (64, 1024, 16)
    shapes = ["tiny"] if a.reduced else a.shapes.split(",")
    if "memory" not in skip:
        memory_layout()
    if "int8" not in skip:
        int8_matmuls(8 if a.reduced else 64, a.reduced, peak)
    if "sampler" not in skip:
        sampler(s, 512 if a.reduced else 128256)
    for shape in shapes:
        if "attention" not in skip:
            rows = attention_forms(shape, s, m, 2 if a.reduced else layers, a.reduced, peak) or []
            rp = [r for r in rows if r["form"].startswith("rpa") and r["case"] == "fixed400" and r.get("kvb")]
            if rp:
                b = min(rp, key=lambda r: r["ms"])
                RESULTS.setdefault("best_rpa", {})[shape] = (b["kvb"], b["qb"], b["page_size"])
        if "decode" not in skip:
            decode_steps(shape, s, 32 if a.reduced else 400, m, a.reduced, peak)
        if a.out:
            Path(a.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    if a.out:
        Path(a.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    print("errors:", RESULTS["errors"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
