"""Attention backends over a paged KV cache (used by oEngine), beside the dense ones in attention.py.

A sequence's pages are listed in a page table row; token position ``p`` lives in page ``row[p // page_size]``
at offset ``p % page_size``, so the first ``n`` pages of a row, in order, hold positions [0, n * page_size)
and the dense masks apply unchanged. Page 0 is scratch: padding, idle slots and positions past a row write
there, and nothing reads it unmasked.

Two layouts of one layer's cache:

* ``split`` (every backend): ``(K, V)``, each ``[num_pages, page_size, kv_heads, head_dim]``;
* ``combined`` (TPU): one ``[num_pages, page_size, 2 * kv_heads, head_dim]`` with K at the even and V at
  the odd heads, the layout JAX's Pallas ragged paged attention kernel reads, so decode needs no copy.

Either may store kv heads replicated for tp, and the combined one head_dim padded to 128 lanes for the
kernel (kv_layout.py): K/V are fitted to the pages when written, queries padded at the kernel's call.

New K/V are written into the pages first and read back after (read after write inside one program: the
caller donates the cache, and nothing is copied). Decode on XLA:CPU/GPU walks the table in blocks of
about 128 positions with an online softmax: each block's gather stays in cache, where gathering all
pages at once costs a round trip through memory (measured: ~2% slower than dense decode against ~6%, and
~45% for the combined layout, whose K/V de-interleave is two more copies).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .kv_layout import fit_kv

_NEG = -1e30
SCRATCH_PAGE = 0
_BLOCK_TOKENS = 128  # positions per step of the decode page walk (measured best of 64..256 on XLA:CPU)


def use_pallas() -> bool:
    """Whether paged attention takes the ragged Pallas kernel path (in shard_map; models/pallas_sharded.py):
    what the engine's ``attention`` setting resolved to (unconfigured: on TPU only, if this jax ships it)."""
    from .pallas_sharded import current

    return current().pallas


def combine_kv(k: jnp.ndarray, v: jnp.ndarray) -> jnp.ndarray:
    """[..., KVH, D] K and V -> [..., 2*KVH, D] interleaved (K even, V odd): the combined layout."""
    *lead, kvh, d = k.shape
    return jnp.stack([k, v], axis=-2).reshape(*lead, 2 * kvh, d)


def write_kv(cache, k: jnp.ndarray, v: jnp.ndarray, page_ids: jnp.ndarray, offsets: jnp.ndarray):
    """Scatter k, v [N, KVH, D] to (page_ids[N], offsets[N]); in place when the caller donates ``cache``.

    The pages may store more heads (kv heads replicated for tp) or wider ones (head_dim padded for the
    TPU kernel) than the model computes: k and v are fitted to them (kv_layout.py)."""
    if isinstance(cache, tuple):
        kc, vc = cache
        k, v = (fit_kv(x, kc.shape[-2], kc.shape[-1]) for x in (k, v))
        return kc.at[page_ids, offsets].set(k.astype(kc.dtype)), vc.at[page_ids, offsets].set(
            v.astype(vc.dtype)
        )
    heads, width = cache.shape[-2] // 2, cache.shape[-1]
    k, v = (fit_kv(x, heads, width) for x in (k, v))
    return cache.at[page_ids, offsets].set(combine_kv(k, v).astype(cache.dtype))


def gather_kv(cache, table: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """table [..., NB] page ids -> K, V [..., NB * page_size, KVH, D] (gathered index = position)."""

    def flat(g):
        *lead, nb, ps, h, d = g.shape
        return g.reshape(*lead, nb * ps, h, d)

    if isinstance(cache, tuple):
        return flat(cache[0][table]), flat(cache[1][table])
    g = flat(cache[table])
    return g[..., 0::2, :], g[..., 1::2, :]


def page_slots(row: jnp.ndarray, positions: jnp.ndarray, page_size: int, valid: jnp.ndarray) -> tuple:
    """(page id, offset) of positions [N] in page-table rows [N, W] (or one shared row [W]).

    Invalid positions, and positions past the row, go to the scratch page.
    """
    idx = positions // page_size
    valid = valid & (idx < row.shape[-1])
    idx = jnp.minimum(idx, row.shape[-1] - 1)
    page = jnp.take_along_axis(row, idx[:, None], axis=1)[:, 0] if row.ndim == 2 else row[idx]
    return jnp.where(valid, page, SCRATCH_PAGE), positions % page_size


def _mask(q_pos: jnp.ndarray, k_pos: jnp.ndarray, window: int | None) -> jnp.ndarray:
    ok = k_pos <= q_pos
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


def decode_attend(q, ks, vs, positions, window: int | None) -> jnp.ndarray:
    """q [S, 1, H, D] over dense K, V [S, N, KVH, D] at positions <= positions[S] (broadcast multiply +
    reduce, the faster form for decode on XLA:CPU; DESIGN.md)."""
    s, _, h, d = q.shape
    n, kvh = ks.shape[1], ks.shape[2]
    qg = q[:, 0].reshape(s, kvh, h // kvh, d).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
    scores = jnp.sum(qg[:, None] * ks.astype(jnp.float32)[:, :, :, None, :], axis=-1)  # [S, N, KVH, G]
    ok = _mask(positions[:, None], jnp.arange(n)[None, :], window)
    scores = jnp.where(ok[:, :, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=1)
    out = jnp.sum(probs[..., None] * vs.astype(jnp.float32)[:, :, :, None, :], axis=1)  # [S, KVH, G, D]
    return out.reshape(s, 1, h, d).astype(q.dtype)


def _block_pages(num_pages: int, page_size: int) -> int:
    """Pages per step of the page walk: the largest divisor of num_pages within _BLOCK_TOKENS positions."""
    most = max(1, _BLOCK_TOKENS // page_size)
    return max(b for b in range(1, min(most, num_pages) + 1) if num_pages % b == 0)


def _online_softmax_block(carry, qg, ks, vs, ok):
    """One block of a page walk: fold keys/values ks, vs [S, n, KVH, D] (mask ok [S, n, 1, 1]) into the
    running (max, denominator, weighted sum) of queries qg [S, KVH, G, D]."""
    m, denom, acc = carry
    scores = jnp.sum(qg[:, None] * ks[:, :, :, None, :], axis=-1)  # [S, n, KVH, G]
    m_new = jnp.maximum(m, jnp.max(jnp.where(ok, scores, _NEG), axis=1))
    p = jnp.where(ok, jnp.exp(scores - m_new[:, None]), 0.0)
    corr = jnp.exp(m - m_new)
    denom = denom * corr + jnp.sum(p, axis=1)
    acc = acc * corr[..., None] + jnp.sum(p[..., None] * vs[:, :, :, None, :], axis=1)
    return m_new, denom, acc


def decode_over_pages(q, cache, view, positions, page_size: int, window: int | None) -> jnp.ndarray:
    """q [S, 1, H, D] over the pages in view [S, NB] of a split cache: a walk over blocks of pages with an
    online softmax, so no gathered copy of the whole context is ever made."""
    kc, vc = cache
    s, _, h, d = q.shape
    kvh = kc.shape[2]
    g = h // kvh
    blk = _block_pages(view.shape[1], page_size)
    n = blk * page_size
    qg = q[:, 0].reshape(s, kvh, g, d).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))

    def body(j, carry):
        ids = jax.lax.dynamic_slice_in_dim(view, j * blk, blk, axis=1)
        ks = kc[ids].reshape(s, n, kvh, d).astype(jnp.float32)
        vs = vc[ids].reshape(s, n, kvh, d).astype(jnp.float32)
        ok = _mask(positions[:, None], j * n + jnp.arange(n)[None, :], window)[:, :, None, None]
        return _online_softmax_block(carry, qg, ks, vs, ok)

    init = (
        jnp.full((s, kvh, g), _NEG, jnp.float32),
        jnp.zeros((s, kvh, g), jnp.float32),
        jnp.zeros((s, kvh, g, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, view.shape[1] // blk, body, init)
    # every row sees position 0 (or its window), so denom > 0; idle rows read scratch and are never used
    out = acc / jnp.maximum(denom, 1e-30)[..., None]
    return out.reshape(s, 1, h, d).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class PagedDecodeAttention:
    """One new token per slot; the cache is one layer's pages.

    meta: (positions i32[S] — where each slot's token goes, page_table i32[S, W]). ``num_pages`` (static)
    is how many table columns are read: the decode bucket, picked by the longest live sequence. Rows of
    idle slots are all scratch.
    """

    page_size: int
    num_pages: int
    window: int | None = None

    def __call__(self, q, k, v, cache, meta):
        positions, table = meta
        page, off = page_slots(table, positions, self.page_size, positions >= 0)
        cache = write_kv(cache, k[:, 0], v[:, 0], page, off)
        view = table[:, : self.num_pages]
        if not isinstance(cache, tuple):
            if use_pallas():
                return _pallas(q, cache, positions + 1, view, self.window), cache
            ks, vs = gather_kv(cache, view)
            return decode_attend(q, ks, vs, positions, self.window), cache
        return decode_over_pages(q, cache, view, positions, self.page_size, self.window), cache


@dataclasses.dataclass(frozen=True)
class PagedPrefillAttention:
    """One sequence's chunk of T tokens at absolute positions, attending to every page written before it.

    meta: (positions i32[1, T], length i32[] — tokens valid after this chunk, page_row i32[W]). The chunk's
    K/V go into the row's pages (padding past ``length`` to scratch); the queries then attend to the first
    ``num_pages`` pages of the row: a cached prefix, earlier chunks and this chunk alike. Off the kernel
    path one gather of the context is cheap (prefill is compute-bound); on it, the ragged kernel takes
    the chunk as one sequence of ``length - start`` queries over ``length`` keys (see `_pallas`).
    """

    page_size: int
    num_pages: int
    window: int | None = None

    def __call__(self, q, k, v, cache, meta):
        positions, length, row = meta
        pos = positions[0]
        page, off = page_slots(row, pos, self.page_size, pos < length)
        cache = write_kv(cache, k[0], v[0], page, off)
        if not isinstance(cache, tuple) and use_pallas():
            view = row[None, : self.num_pages]
            return _pallas(q, cache, length[None], view, self.window, q_lens=(length - pos[0])[None]), cache
        ks, vs = gather_kv(cache, row[: self.num_pages])  # [N, KVH, D]
        _, t, h, d = q.shape
        kvh = ks.shape[1]
        qg = q[0].reshape(t, kvh, h // kvh, d).astype(jnp.float32)
        scores = jnp.einsum("tkgd,nkd->kgtn", qg, ks.astype(jnp.float32)) / jnp.sqrt(jnp.float32(d))
        k_pos = jnp.arange(ks.shape[0])
        ok = _mask(pos[:, None], k_pos[None, :], self.window) & (k_pos[None, :] < length)
        scores = jnp.where(ok[None, None], scores, _NEG)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("kgtn,nkd->tkgd", probs, vs.astype(jnp.float32))
        return out.reshape(1, t, h, d).astype(q.dtype), cache


def _pallas(q, pages, kv_lens, table, window, q_lens=None):
    """JAX's ragged paged attention kernel, in shard_map on the engine's mesh (models/pallas_sharded.py).

    Decode: q [S, 1, H, D], one query per row, the last of its kv_len keys (idle slots' kv_lens are
    clamped into the table; their output is never read). Prefill: q [1, T, H, D], a right-padded chunk,
    ``q_lens`` [1] its valid tokens: the kernel's rule (a sequence's queries are its last q_len keys)
    holds for q_len = the valid tokens and kv_len = the length after the chunk; the padding comes out 0.
    """
    from .pallas_sharded import paged_attention

    return paged_attention(q, pages, kv_lens, table, window=window, q_lens=q_lens)


# ---------------------------------------------------------------------------------------------- ragged
# One flat batch of query tokens from several sequences (oEngine's mixed step): decode rows and prefill
# chunks together, described as JAX's Pallas ragged paged attention kernel takes them, so on TPU the kernel
# can run at the same call site:
#   q [T, H, D]; kv_lens i32[S] (keys of each sequence after this step); page_indices i32[S, W];
#   cu_q_lens i32[S + 1] (sequence s owns query tokens cu_q_lens[s]:cu_q_lens[s + 1]); num_seqs i32[1].
# Sequence s's queries are its last q_len keys: query i of s sits at position kv_lens[s] - q_len + i.
# Tokens past cu_q_lens[num_seqs] are padding (their K/V go to scratch, their output is never read).


def ragged_token_layout(kv_lens, cu_q_lens, num_seqs, num_tokens: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(sequence, position) of each of ``num_tokens`` query tokens; padding gets sequence S, position -1."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    n = cu_q_lens.shape[0] - 1
    live = jnp.arange(n) < num_seqs[0]
    ends = jnp.where(live, cu_q_lens[1:], cu_q_lens[num_seqs[0]])
    seg = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    s = jnp.minimum(seg, n - 1)
    pos = kv_lens[s] - (cu_q_lens[s + 1] - t)
    valid = seg < n
    return jnp.where(valid, seg, n), jnp.where(valid, pos, -1)


def ragged_kv_slots(page_indices, seg, pos, page_size: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(page id, offset) where each token's K/V goes; padding and negative positions go to scratch."""
    s = jnp.minimum(seg, page_indices.shape[0] - 1)
    return page_slots(page_indices[s], pos, page_size, (seg < page_indices.shape[0]) & (pos >= 0))


def _walk_blocks(width: int, page_size: int) -> tuple[int, int]:
    blk = _block_pages(width, page_size)
    return blk, blk * page_size


def decode_rows_over_pages(q, cache, view, kv_lens, page_size: int, window: int | None) -> jnp.ndarray:
    """q [S, H, D], one query per row at position kv_lens - 1, over the pages in view [S, W].

    The page walk of `decode_over_pages`, with the number of blocks read at run time (the longest row's),
    so one program serves every context length. Rows with kv_len 0 are idle: their output is zeros.
    """
    s, h, d = q.shape
    kvh = cache[0].shape[2] if isinstance(cache, tuple) else cache.shape[2] // 2
    g = h // kvh
    blk, n = _walk_blocks(view.shape[1], page_size)
    qg = q.reshape(s, kvh, g, d).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
    positions = kv_lens - 1

    def body(j, carry):
        ks, vs = gather_kv(cache, jax.lax.dynamic_slice_in_dim(view, j * blk, blk, axis=1))
        ks, vs = ks.astype(jnp.float32), vs.astype(jnp.float32)  # [S, n, KVH, D]
        ok = _mask(positions[:, None], j * n + jnp.arange(n)[None, :], window)[:, :, None, None]
        return _online_softmax_block(carry, qg, ks, vs, ok)

    init = (
        jnp.full((s, kvh, g), _NEG, jnp.float32),
        jnp.zeros((s, kvh, g), jnp.float32),
        jnp.zeros((s, kvh, g, d), jnp.float32),
    )
    blocks = jnp.minimum(-(-jnp.max(kv_lens, initial=0) // n), view.shape[1] // blk)
    _, denom, acc = jax.lax.fori_loop(0, blocks, body, init)
    return (acc / jnp.maximum(denom, 1e-30)[..., None]).reshape(s, h, d).astype(q.dtype)


def chunks_over_pages(q, cache, rows, kv_lens, seg, pos, num_seqs, page_size: int, window: int | None):
    """q [P, H, D]: the tokens of up to K prefill chunks (token i belongs to chunk seg[i], at pos[i]) over
    their sequences' pages rows [K, W] (a cached prefix, earlier chunks and the chunk itself).

    A walk, chunk by chunk and block by block (both counts read at run time), with an online softmax:
    each block is one sequence's keys against all P queries, masked to that sequence's tokens, so no
    per-token copy of a context is made and the work is P x (keys of the chunks' sequences).
    """
    p_, h, d = q.shape
    kvh = cache[0].shape[2] if isinstance(cache, tuple) else cache.shape[2] // 2
    g = h // kvh
    blk, n = _walk_blocks(rows.shape[1], page_size)
    qg = q.reshape(p_, kvh, g, d).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))

    def seq_body(s, carry):
        row, kv_len = rows[s], kv_lens[s]
        mine = seg == s

        def body(j, carry):
            m, denom, acc = carry
            ks, vs = gather_kv(cache, jax.lax.dynamic_slice_in_dim(row, j * blk, blk))
            scores = jnp.einsum("pkgd,nkd->pkgn", qg, ks.astype(jnp.float32))
            k_pos = j * n + jnp.arange(n)
            ok = mine[:, None] & _mask(pos[:, None], k_pos[None, :], window) & (k_pos < kv_len)[None, :]
            ok = ok[:, None, None, :]
            m_new = jnp.maximum(m, jnp.max(jnp.where(ok, scores, _NEG), axis=-1))
            pr = jnp.where(ok, jnp.exp(scores - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            denom = denom * corr + jnp.sum(pr, axis=-1)
            acc = acc * corr[..., None] + jnp.einsum("pkgn,nkd->pkgd", pr, vs.astype(jnp.float32))
            return m_new, denom, acc

        blocks = jnp.minimum(-(-kv_len // n), rows.shape[1] // blk)
        return jax.lax.fori_loop(0, blocks, body, carry)

    init = (
        jnp.full((p_, kvh, g), _NEG, jnp.float32),
        jnp.zeros((p_, kvh, g), jnp.float32),
        jnp.zeros((p_, kvh, g, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, jnp.minimum(num_seqs, rows.shape[0]), seq_body, init)
    return (acc / jnp.maximum(denom, 1e-30)[..., None]).reshape(p_, h, d).astype(q.dtype)


def ragged_paged_attention_xla(
    q,
    cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    page_size: int,
    num_decode: int = 0,
    window: int | None = None,
) -> jnp.ndarray:
    """Ragged paged attention in plain JAX (XLA:CPU/GPU), the kernel's inputs (see above), pages written.

    ``num_decode`` (static) says the first num_decode sequences are decode rows, one query each in tokens
    [0, num_decode): they go through the batched page walk; every other sequence through the chunk walk.
    With num_decode=0 everything takes the chunk walk (same result, slower for decode rows).
    """
    t = q.shape[0]
    r = num_decode
    seg, pos = ragged_token_layout(kv_lens, cu_q_lens, num_seqs, t)
    parts = []
    if r:
        parts.append(decode_rows_over_pages(q[:r], cache, page_indices[:r], kv_lens[:r], page_size, window))
    if t > r:
        parts.append(
            chunks_over_pages(
                q[r:],
                cache,
                page_indices[r:],
                kv_lens[r:],
                seg[r:] - r,
                pos[r:],
                num_seqs[0] - r,
                page_size,
                window,
            )
        )
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


@dataclasses.dataclass(frozen=True)
class PagedRaggedAttention:
    """Decode rows and prefill chunks of several sequences in one flat batch (oEngine's mixed step).

    meta: (kv_lens i32[S], page_indices i32[S, W], cu_q_lens i32[S + 1], num_seqs i32[1]) as the ragged
    kernel takes them; q arrives as [1, T, H, D]. The tokens' K/V are written into their pages first, then
    read back with everything before them. ``num_decode``: see `ragged_paged_attention_xla`.
    """

    page_size: int
    num_decode: int = 0
    window: int | None = None

    def __call__(self, q, k, v, cache, meta):
        kv_lens, page_indices, cu_q_lens, num_seqs = meta
        t = q.shape[1]
        seg, pos = ragged_token_layout(kv_lens, cu_q_lens, num_seqs, t)
        page, off = ragged_kv_slots(page_indices, seg, pos, self.page_size)
        cache = write_kv(cache, k[0], v[0], page, off)
        if not isinstance(cache, tuple) and use_pallas():  # the Pallas kernel, in shard_map
            from .pallas_sharded import ragged_attention

            out = ragged_attention(
                q[0],
                cache,
                kv_lens,
                page_indices,
                cu_q_lens,
                num_seqs,
                window=self.window,
                num_decode=self.num_decode,
            )
            return out[None], cache
        out = ragged_paged_attention_xla(
            q[0],
            cache,
            kv_lens,
            page_indices,
            cu_q_lens,
            num_seqs,
            page_size=self.page_size,
            num_decode=self.num_decode,
            window=self.window,
        )
        return out[None], cache
