# ruff: noqa: B023 - the probe's closures run inside the loop iteration that made them
"""tpu_probe's memory and attention families: how HBM pads a 64-wide minor dimension, the dense-cache
attention forms against the ragged paged kernel per block size."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tpu_probe_harness import SHAPES, TINY, left, section, timeit_compiled  # noqa: E402

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
