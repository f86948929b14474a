"""Attention backends. The model hands each layer's q, k, v and cache to a backend, so engines can swap
the cache layout (dense per-slot rows here, pages in the paged engine) without touching the model.

A backend is called as ``backend(q, k, v, cache, meta) -> (out, new_cache)`` with
q [B, T, H, D], k and v [B, T, KVH, D]; ``cache`` and ``meta`` are the backend's own.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG = -1e30


def _group(q: jnp.ndarray, num_kv_heads: int) -> jnp.ndarray:
    b, t, h, d = q.shape
    return q.reshape(b, t, num_kv_heads, h // num_kv_heads, d)


def _allowed(q_pos: jnp.ndarray, k_pos: jnp.ndarray, window: int | None) -> jnp.ndarray:
    ok = k_pos <= q_pos
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


@dataclasses.dataclass(frozen=True)
class PrefillAttention:
    """Causal attention within right-padded rows; returns the rows' K and V as the new cache.

    meta: (positions [B, T], lengths [B]). Keys at or beyond a row's length are masked, so padding never
    changes a valid position's result.
    """

    window: int | None = None

    def __call__(self, q, k, v, cache, meta):
        positions, lengths = meta
        b, t, h, d = q.shape
        kvh = k.shape[2]
        qg = _group(q, kvh).astype(jnp.float32)  # [B, T, KVH, G, D]
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) / jnp.sqrt(jnp.float32(d))
        k_idx = jnp.arange(t)
        ok = _allowed(positions[:, :, None], positions[:, None, :], self.window)
        ok &= k_idx[None, None, :] < lengths[:, None, None]
        scores = jnp.where(ok[:, None, None, :, :], scores, _NEG)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
        return out.reshape(b, t, h, d).astype(q.dtype), (k, v)


@dataclasses.dataclass(frozen=True)
class DenseDecodeAttention:
    """One new token per slot against a dense cache K, V [S, M, KVH, D].

    meta: positions [S] — where each slot's new token goes (its current length). The new K/V are written
    in place (the caller donates the cache), then the slot attends to positions <= its own. ``kv_len``
    (static) limits the read to the first kv_len positions so short batches do not scan the whole row.
    Attention is written as broadcast multiply + reduce: on XLA:CPU that beats batched einsum for decode.
    """

    window: int | None = None
    kv_len: int | None = None

    def __call__(self, q, k, v, cache, meta):
        positions = meta
        kc, vc = cache
        s, _, h, d = q.shape  # s may be fewer than the cache's slots: the engine decodes the first s only
        kvh = k.shape[2]
        rows = jnp.arange(s)
        kc = kc.at[rows, positions].set(k[:, 0].astype(kc.dtype))
        vc = vc.at[rows, positions].set(v[:, 0].astype(vc.dtype))
        n = kc.shape[1] if self.kv_len is None else self.kv_len
        ks, vs = kc[:s, :n].astype(jnp.float32), vc[:s, :n].astype(jnp.float32)
        qg = q[:, 0].reshape(s, kvh, h // kvh, d).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
        scores = jnp.sum(qg[:, None] * ks[:, :, :, None, :], axis=-1)  # [S, N, KVH, G]
        ok = _allowed(positions[:, None], jnp.arange(n)[None, :], self.window)  # [S, N]
        scores = jnp.where(ok[:, :, None, None], scores, _NEG)
        probs = jax.nn.softmax(scores, axis=1)
        out = jnp.sum(probs[..., None] * vs[:, :, :, None, :], axis=1)  # [S, KVH, G, D]
        return out.reshape(s, 1, h, d).astype(q.dtype), (kc, vc)
