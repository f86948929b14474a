"""Attention backends. The model hands each layer's q, k, v and cache to a backend, so engines can swap
the cache layout (dense per-slot rows here, pages in the paged engine) without touching the model.

A backend is called as ``backend(q, k, v, cache, meta) -> (out, new_cache)`` with
q [B, T, H, D], k and v [B, T, KVH, D]; ``cache`` and ``meta`` are the backend's own.

The dense cache (vEngine's: one row per decode slot) is kept flat, K and V each [S, M, KVH * D]: the heads
of a position side by side in the minor axis. On TPU a [.., KVH, 64] minor pair makes XLA relayout or
scatter slowly (a 64-row decode step of Llama-3.2-1B measured 25.8 ms with [S, M, 8, 64] against 5.0 ms
flat, both with one einsum pair over the first 512 positions), while the flat rows are lane-dense for every
head_dim. The backends also take a [S, M, KVH, D] cache (tests, the reference) and return it as given.
Reads pick their form by backend (`dense_reader`): on CPU the per-head 4-d contractions XLA:CPU runs best;
on TPU `flat_read_rows` (block-diagonal queries against the flat rows).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from .target import target_backend

_NEG = -1e30

# A bfloat16 KV cache is kept as its bits (uint16) and widened with an integer shift when read: XLA:CPU
# runs a bf16 slice-convert-dot ~8x slower than the f32 one, while the shift costs ~nothing, so the
# cache's halved bytes become a faster decode step (a 32-row step at context 574: 175 -> 105 ms of attention).
KV_BITS = jnp.uint16


def kv_store(x: jnp.ndarray, cache_dtype) -> jnp.ndarray:
    """x as the cache stores it: bfloat16 bits for a KV_BITS cache, else cast to the cache's dtype."""
    if cache_dtype == KV_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), KV_BITS)
    return x.astype(cache_dtype)


def kv_load(x: jnp.ndarray) -> jnp.ndarray:
    """Cache entries as float32 (exact: bfloat16 is float32's upper half)."""
    if x.dtype == KV_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    return x.astype(jnp.float32)


def to_flat(x: jnp.ndarray) -> jnp.ndarray:
    """[..., KVH, D] -> [..., KVH * D]: K or V rows as the dense cache stores them."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def to_heads(x: jnp.ndarray, num_kv_heads: int) -> jnp.ndarray:
    """[..., KVH * D] -> [..., KVH, D]: flat cache rows per head. Take it of a chunk, not of a whole cache:
    XLA:CPU copies a whole cache to make this view of it (`read_rows`)."""
    return x.reshape(*x.shape[:-1], num_kv_heads, x.shape[-1] // num_kv_heads)


_READER: contextvars.ContextVar[str | None] = contextvars.ContextVar("vsurge_dense_reader", default=None)
READERS = ("heads", "flat")


def dense_reader() -> str:
    """How dense rows are read in the program being traced: ``flat`` on TPU (or lowering for one, see
    models/target.py), ``heads`` elsewhere, unless `use_dense_reader` chose one (tests run the TPU form on
    CPU with it)."""
    forced = _READER.get()
    if forced is not None:
        return forced
    return "flat" if target_backend() == "tpu" else "heads"


@contextlib.contextmanager
def use_dense_reader(name: str | None):
    """Trace dense reads with reader ``name`` (one of READERS; None: by backend)."""
    if name is not None and name not in READERS:
        raise ValueError(f"dense reader must be one of {', '.join(READERS)}, got {name!r}")
    token = _READER.set(name)
    try:
        yield
    finally:
        _READER.reset(token)


def flat_cache(cache) -> tuple[jnp.ndarray, jnp.ndarray, tuple[int, ...] | None]:
    """(K, V) flat, and the 4-d shape they came in (None: they were flat)."""
    kc, vc = cache
    if kc.ndim == 4:
        return to_flat(kc), to_flat(vc), kc.shape
    return kc, vc, None


def as_given(kc, vc, shape4) -> tuple[jnp.ndarray, jnp.ndarray]:
    return (kc, vc) if shape4 is None else (kc.reshape(shape4), vc.reshape(shape4))


def _group(q: jnp.ndarray, num_kv_heads: int) -> jnp.ndarray:
    b, t, h, d = q.shape
    return q.reshape(b, t, num_kv_heads, h // num_kv_heads, d)


def _allowed(q_pos: jnp.ndarray, k_pos: jnp.ndarray, window: int | None) -> jnp.ndarray:
    ok = k_pos <= q_pos
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


def prefill_block() -> int:
    """Queries a prefill computes per block of `PrefillAttention`, by the backend traced for: 64 on CPU
    (each block's scores stay in cache), 512 on TPU, where every block is unrolled into the program
    for each layer: at 64 the 1B shape's 1024-token prefill was 16 blocks x 16 layers, the slowest of
    the programs a start compiles (64 s of a 73 s cold start on a v5e), and a 64-row block fills half of
    the MXU's 128 rows."""
    return 512 if target_backend() == "tpu" else 64


@dataclasses.dataclass(frozen=True)
class PrefillAttention:
    """Causal attention within right-padded rows; returns the rows' K and V as the new cache.

    meta: (positions [B, T], lengths [B]) or (positions, lengths, segments [B, T]). Keys at or beyond a
    row's length are masked, so padding never changes a valid position's result. With segments, several
    prompts are packed one after another in a row (positions restart at 0 in each): a token attends only
    to earlier tokens of its own segment.

    Rows longer than ``block`` (default `prefill_block`: by backend) are computed a block of queries at a
    time, each against the keys up to the block's end: no scores above the diagonal's blocks, and each
    block's scores stay in cache. On XLA:CPU one [T, T] softmax over a 512-token row cost ~1.4x and over a
    1024-token row ~4x the blocked one.
    """

    window: int | None = None
    block: int | None = None

    def __call__(self, q, k, v, cache, meta):
        positions, lengths, *segments = meta
        b, t, h, d = q.shape
        kvh = k.shape[2]
        block = self.block or prefill_block()
        qg = _group(q, kvh).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))  # [B, T, KVH, G, D]
        kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
        outs = []
        for i in range(0, t, block):
            e = min(i + block, t)  # the queries [i, e) see keys [0, e) at most
            scores = jnp.einsum("btkgd,bskd->bkgts", qg[:, i:e], kf[:, :e])
            ok = _allowed(positions[:, i:e, None], positions[:, None, :e], self.window)
            ok &= jnp.arange(e)[None, None, :] < lengths[:, None, None]
            if segments:
                ok &= segments[0][:, i:e, None] == segments[0][:, None, :e]
            scores = jnp.where(ok[:, None, None, :, :], scores, _NEG)
            probs = jax.nn.softmax(scores, axis=-1)
            outs.append(jnp.einsum("bkgts,bskd->btkgd", probs, vf[:, :e]))
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
        return out.reshape(b, t, h, d).astype(q.dtype), (k, v)


@dataclasses.dataclass(frozen=True)
class ChunkAttention:
    """One chunk of a single sequence against that sequence's own dense row K, V [R, KVH, D].

    meta: (positions [1, C], start) — the chunk's absolute positions and where it begins. The chunk's K/V
    are written at [start, start + C) (the caller keeps start + C <= R), then each query attends to every
    row position <= its own: earlier chunks and its own chunk. Positions past the prompt hold padding's
    K/V, which no valid query can see. Used for prompts longer than the largest prefill bucket and for
    prompt logprobs (engines/chunked_prefill.py).
    """

    window: int | None = None

    def __call__(self, q, k, v, cache, meta):
        positions, start = meta
        kc, vc = cache
        _, t, h, d = q.shape
        kvh = k.shape[2]
        kc = jax.lax.dynamic_update_slice(kc, k[0].astype(kc.dtype), (start, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v[0].astype(vc.dtype), (start, 0, 0))
        qg = _group(q, kvh)[0].astype(jnp.float32)  # [C, KVH, G, D]
        scores = jnp.einsum("tkgd,skd->kgts", qg, kc.astype(jnp.float32)) / jnp.sqrt(jnp.float32(d))
        ok = _allowed(positions[0][:, None], jnp.arange(kc.shape[0])[None, :], self.window)  # [C, R]
        scores = jnp.where(ok[None, None], scores, _NEG)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("kgts,skd->tkgd", probs, vc.astype(jnp.float32))
        return out.reshape(1, t, h, d).astype(q.dtype), (kc, vc)


def read_chunk(chunk: int | None) -> int:
    """Positions a dense read takes per step: ``chunk``, else 128. On CPU each chunk then stays in cache;
    on a TPU v5e a decode walking the positions 128-384 of 64 rows ran faster at 128 than at 256 or 512
    (the 1B shape 4.76 / 4.96 / 5.31 ms a step, the 8B int8 shape 15.61 / 16.05 / 18.50 ms; 2026-12-06,
    `benchmarks/tpu_worker.py`'s raw walks): the loop's last chunk reads less past the longest row."""
    return 128 if chunk is None else chunk


# Rows a dense step reads together: sorted by how much of the cache each needs, each group of this many
# stops after its own longest row, so short and idle rows cost little (measured, a 32-row decode step of
# the 135M model with 19 live rows of contexts 50-700: 187 -> 127 ms; groups of 4: about the same)
READ_GROUP = 8


def read_rows(qj, pj, rows, need, kc, vc, *, window: int | None, chunk: int, size: int | None = None):
    """Attention of T queries per row against the first ``need[i]`` cache positions of one row each: the
    first R slots (``rows`` None) or the slots ``rows`` i32[R] (gathered). qj f32[R, T, KVH, G, D] (scaled),
    pj i32[R, T] the queries' positions. The cache is read in chunks with an online softmax, the loop's
    trip count (the longest ``need``) computed on the device. Returns f32[R, T, KVH, G, D].

    The T queries of a row are folded into its head groups ([R, KVH, T*G, D]), so every T runs the 4-d
    contractions of a decode step: XLA:CPU ran the 5-d ones of a 5-token verify step ~2x slower per
    position read."""
    if kc.ndim == 3 and dense_reader() == "flat":
        return flat_read_rows(qj, pj, rows, need, kc, vc, window=window, chunk=chunk, size=size)
    r, t, kvh, g, d = qj.shape
    # flat rows are viewed per head chunk by chunk: XLA:CPU copied a whole cache to view it 4-d (8 copies of
    # every layer's cache a step; one stream over 16 slots x 2048 positions at 0.02x the raw loop)
    heads = to_heads if kc.ndim == 3 else (lambda x, _: x)
    n = kc.shape[1] if size is None else min(size, kc.shape[1])
    c = min(chunk, n)
    most = -(-n // c)
    q4 = jnp.swapaxes(qj, 1, 2).reshape(r, kvh, t * g, d)
    q_pos = jnp.repeat(pj, g, axis=1)[:, None, :, None]  # [R, 1, T*G, 1], T-major as q4

    def body(i, carry):
        m, denom, acc = carry
        # the last chunk is shifted back to fit in n; positions an earlier chunk covered are masked
        start = jnp.minimum(i * c, n - c)
        if rows is None:
            ks = jax.lax.dynamic_slice_in_dim(kc[:r], start, c, axis=1)
            vs = jax.lax.dynamic_slice_in_dim(vc[:r], start, c, axis=1)
        else:
            cols = start + jnp.arange(c)
            ks, vs = kc[rows[:, None], cols[None, :]], vc[rows[:, None], cols[None, :]]
        ks, vs = kv_load(heads(ks, kvh)), kv_load(heads(vs, kvh))
        k_pos = start + jnp.arange(c)
        ok = _allowed(q_pos, k_pos, window) & (k_pos >= i * c) & (k_pos < need[:, None, None, None])
        scores = jnp.where(ok, jnp.einsum("skqd,snkd->skqn", q4, ks), _NEG)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.where(ok, jnp.exp(scores - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        acc = acc * scale[..., None] + jnp.einsum("skqn,snkd->skqd", p, vs)
        return m_new, denom * scale + p.sum(-1), acc

    trips = jnp.clip((jnp.max(need) + c - 1) // c, 0, most)
    init = (
        jnp.full((r, kvh, t * g), _NEG, jnp.float32),
        jnp.zeros((r, kvh, t * g), jnp.float32),
        jnp.zeros((r, kvh, t * g, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, trips, body, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]
    return jnp.swapaxes(out.reshape(r, kvh, t, g, d), 1, 2)


def _load_as(x: jnp.ndarray, dtype) -> jnp.ndarray:
    """Cache entries in the dtype the flat reader computes in (bfloat16 bits are bfloat16 already)."""
    if x.dtype == KV_BITS:
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.astype(dtype)


def flat_read_rows(qj, pj, rows, need, kc, vc, *, window: int | None, chunk: int, size: int | None = None):
    """`read_rows` over flat rows K, V [S', M, KVH * D] in the form TPUs run at memory speed.

    Each query row is spread over every head's lanes as a block-diagonal matrix ([R, T*H, KVH*D], zero
    outside its own head's D lanes), so scores and outputs are plain batched matmuls against whole flat
    rows, with no relayout of the cache: KVH x the minimal flops, which a decode step has to spare (at
    batch 64 the 1B model's attention is ~0.1 ms of MXU time against ~1 ms of reading the cache). The rows
    are read in chunks of ``chunk`` positions with an online softmax, the trip count (the longest ``need``)
    computed on the device. Inputs in the cache's dtype (bfloat16 on TPU), accumulation in float32.
    Returns f32[R, T, KVH, G, D] like `read_rows`."""
    r, t, kvh, g, d = qj.shape
    lanes = kc.shape[-1]
    dt = jnp.bfloat16 if kc.dtype in (KV_BITS, jnp.bfloat16) else jnp.float32
    n = kc.shape[1] if size is None else min(size, kc.shape[1])
    c = min(chunk, n)
    most = -(-n // c)
    eye = jnp.eye(kvh, dtype=dt)
    qb = (qj.astype(dt)[..., None, :] * eye[:, None, :, None]).reshape(r, t * kvh * g, lanes)
    q_pos = jnp.repeat(pj, kvh * g, axis=1)[:, :, None]  # [R, T*H, 1], T-major as qb

    def body(i, carry):
        m, denom, acc = carry
        start = jnp.minimum(i * c, n - c)  # the last chunk shifted back to fit; covered positions masked
        if rows is None:
            ks = jax.lax.dynamic_slice(kc, (0, start, 0), (r, c, lanes))
            vs = jax.lax.dynamic_slice(vc, (0, start, 0), (r, c, lanes))
        else:
            cols = start + jnp.arange(c)
            ks, vs = kc[rows[:, None], cols[None, :]], vc[rows[:, None], cols[None, :]]
        ks, vs = _load_as(ks, dt), _load_as(vs, dt)
        k_pos = start + jnp.arange(c)
        ok = _allowed(q_pos, k_pos, window) & (k_pos >= i * c) & (k_pos < need[:, None, None])
        scores = jnp.einsum("rqc,rnc->rqn", qb, ks, preferred_element_type=jnp.float32)
        scores = jnp.where(ok, scores, _NEG)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.where(ok, jnp.exp(scores - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        pv = jnp.einsum("rqn,rnc->rqc", p.astype(dt), vs, preferred_element_type=jnp.float32)
        return m_new, denom * scale + p.sum(-1), acc * scale[..., None] + pv

    trips = jnp.clip((jnp.max(need) + c - 1) // c, 0, most)
    th = t * kvh * g
    init = (
        jnp.full((r, th), _NEG, jnp.float32),
        jnp.zeros((r, th), jnp.float32),
        jnp.zeros((r, th, lanes), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, trips, body, init)
    out = (acc / jnp.maximum(denom, 1e-30)[..., None]).reshape(r, t, kvh, g, kvh, d)
    return jnp.einsum("rtkgjd,kj->rtkgd", out, eye.astype(jnp.float32))


def read_dense_rows(qg, kc, vc, q_pos, lengths, *, window: int | None, chunk: int, size: int | None = None):
    """Attention of T queries per row against the first ``lengths[s]`` positions of row s's cache.

    qg f32[S, T, KVH, G, D] (already scaled); kc/vc [S', M, KVH, D] (S' >= S: the step covers the first S
    slots); q_pos i32[S, T] (a query sees cache positions <= its own); lengths i32[S] (0: an idle row, read
    not at all, its output 0); ``size`` (static) caps the positions read. The cache is read in chunks with
    an online softmax, each loop's trip count computed on the device. With more than READ_GROUP rows, the
    rows are sorted by length and, when that skips enough, read in groups of READ_GROUP, each loop stopping
    after its group's longest row. Returns f32[S, T, KVH, G, D]."""
    s = qg.shape[0]
    read = partial(read_rows, kc=kc, vc=vc, window=window, chunk=chunk, size=size)

    # the grouped reads gather rows: on TPU a gather of whole rows costs more than reading them in place
    # (a 64-row step over mixed lengths 32-768 measured 22 ms grouped against 3 ms read in place)
    if s <= READ_GROUP or (kc.ndim == 3 and dense_reader() == "flat"):
        return read(qg, q_pos, None, lengths)
    order = jnp.argsort(lengths)

    def grouped(_):
        out = jnp.zeros(qg.shape, jnp.float32)
        for j in range(0, s, READ_GROUP):
            rows = order[j : j + READ_GROUP]
            out = out.at[rows].set(read(qg[rows], q_pos[rows], rows, lengths[rows]))
        return out

    # groups cost ~10% more per position read than one pass over every row (gathers, shorter loops):
    # they run only when they skip more than that
    starts = range(0, s, READ_GROUP)
    group_max = lengths[order[jnp.asarray([min(j + READ_GROUP, s) - 1 for j in starts])]]
    pays = 10 * jnp.sum(group_max) < 9 * len(starts) * jnp.max(lengths)
    return jax.lax.cond(pays, grouped, lambda _: read(qg, q_pos, None, lengths), None)


@dataclasses.dataclass(frozen=True)
class DenseDecodeAttention:
    """One new token per slot against a dense cache K, V [S, M, KVH * D] (or [S, M, KVH, D]).

    meta: positions [S] — where each slot's new token goes (its current length) — or (positions, lengths)
    where ``lengths`` i32[S] is how much of each row the step reads (its position + 1; 0 for an idle slot,
    which is then not read at all), or an i32 scalar bounding every row (idle rows keep stale positions).
    The new K/V are written in place (the caller donates the cache), then the slot attends to positions
    <= its own, read by `read_dense_rows`: in chunks with an online softmax, sorted rows in groups that
    each stop after their longest row, so one compiled program serves every length and a step reads
    about what its rows need. Chunks keep each step's working set in cache; on XLA:CPU this is ~5x faster
    than one softmax over the whole row. ``kv_len`` (static) caps the positions read, for callers that
    know rows never grow past it.
    """

    window: int | None = None
    kv_len: int | None = None
    chunk: int | None = None  # positions per read step (`read_chunk`: 128)

    def __call__(self, q, k, v, cache, meta):
        positions, lengths = meta if isinstance(meta, tuple) else (meta, None)
        kc, vc, shape4 = flat_cache(cache)
        s, _, h, d = q.shape  # s may be fewer than the cache's slots: the engine decodes the first s only
        kvh = k.shape[2]
        g = h // kvh
        rows = jnp.arange(s)
        kc = kc.at[rows, positions].set(kv_store(to_flat(k[:, 0]), kc.dtype))
        vc = vc.at[rows, positions].set(kv_store(to_flat(v[:, 0]), vc.dtype))
        n = kc.shape[1] if self.kv_len is None else min(self.kv_len, kc.shape[1])
        need = positions + 1
        if lengths is not None:
            need = lengths if jnp.ndim(lengths) else jnp.minimum(need, lengths)
        need = jnp.minimum(need, n)
        qg = q[:, 0].reshape(s, 1, kvh, g, d).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
        out = read_dense_rows(
            qg, kc, vc, positions[:, None], need, window=self.window, chunk=read_chunk(self.chunk), size=n
        )
        return out.reshape(s, 1, h, d).astype(q.dtype), as_given(kc, vc, shape4)


@dataclasses.dataclass(frozen=True)
class DenseMixedAttention:
    """A decode step's rows and prompts' chunks in one forward, against the dense cache K, V [S, M, KVH * D]
    (vEngine's mixed step, engines/dense/mixed_step.py).

    q [1, R + K*C, H, D]: first the next token of each of the first R slots (as `DenseDecodeAttention`),
    then K chunks of C tokens, chunk k for slot ``slots[k]`` at positions ``starts[k]`` onwards, of which
    the first ``counts[k]`` are real (0: an unused chunk). meta: (positions [R], lengths [R], slots [K],
    starts [K], counts [K]); lengths[r] is how much of row r the step reads (0: an idle row, whose K/V is
    not written either: its stale position may lie inside a prompt being prefilled). A chunk's K/V goes to
    its slot's row, then its queries read that row up to their own positions (earlier chunks and this one).
    """

    rows: int
    window: int | None = None
    chunk: int | None = None

    def __call__(self, q, k, v, cache, meta):
        positions, lengths, slots, starts, counts = meta
        kc, vc, shape4 = flat_cache(cache)
        chunk = read_chunk(self.chunk)
        r = self.rows
        _, t, h, d = q.shape
        kvh = k.shape[2]
        g = h // kvh
        m = kc.shape[1]
        seqs = starts.shape[0]
        c = (t - r) // seqs
        at = jnp.where(lengths > 0, positions, m)  # m: dropped
        kc = kc.at[jnp.arange(r), at].set(kv_store(to_flat(k[0, :r]), kc.dtype), mode="drop")
        vc = vc.at[jnp.arange(r), at].set(kv_store(to_flat(v[0, :r]), vc.dtype), mode="drop")
        i = jnp.arange(c)
        c_pos = starts[:, None] + i[None, :]  # [K, C]
        c_at = jnp.where(i[None, :] < counts[:, None], c_pos, m)
        ck = kv_store(k[0, r:].reshape(seqs, c, kvh * d), kc.dtype)
        cv = kv_store(v[0, r:].reshape(seqs, c, kvh * d), vc.dtype)
        kc = kc.at[slots[:, None], c_at].set(ck, mode="drop")
        vc = vc.at[slots[:, None], c_at].set(cv, mode="drop")
        scale = jnp.sqrt(jnp.float32(d))
        qd = q[0, :r].reshape(r, 1, kvh, g, d).astype(jnp.float32) / scale
        out_d = read_dense_rows(
            qd, kc, vc, positions[:, None], jnp.minimum(lengths, m), window=self.window, chunk=chunk
        )
        qc = q[0, r:].reshape(seqs, c, kvh, g, d).astype(jnp.float32) / scale
        need = jnp.where(counts > 0, jnp.minimum(starts + counts, m), 0)
        out_c = read_rows(qc, c_pos, slots, need, kc, vc, window=self.window, chunk=chunk)
        out = jnp.concatenate([out_d.reshape(r, h, d), out_c.reshape(seqs * c, h, d)])
        return out[None].astype(q.dtype), as_given(kc, vc, shape4)
