"""Vocabulary-wide primitives of the sampler, in two implementations chosen by backend at trace time.

* ``"cpu"`` (XLA:CPU): ``lax.top_k`` lowers to a partial sort there, so the exact top-k is two-stage (block
  maxima, then inside the best blocks) with optimization barriers keeping the sort pattern intact, and the
  greedy argmax is a top-1 of that kind (``jnp.argmax`` is a slow variadic reduce there).
* ``"tpu"`` (every other backend): ``jnp.argmax`` is native and ~1 pass over the logits; ``lax.top_k``
  costs about k passes over its input, so the exact top-k narrows the vocabulary twice (blocks of 128,
  then sub-blocks of 8) before a ``lax.top_k`` over at most 16 k values; no barriers.

Both give bit-identical results (values, and the lower id first on ties); `sampler_impl` resolves which one
a trace uses: the explicit argument, else ``VSURGE_SAMPLER_IMPL``, else the default backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax
import jax.numpy as jnp
from jax import lax

from ...models.target import target_backend
from .state import _KEY_IMPL

IMPLS = ("cpu", "tpu")
SAMPLER_IMPL_ENV = "VSURGE_SAMPLER_IMPL"
# Block width of the CPU two-stage top-k: measured fastest among 32..128 at V=49152 on XLA:CPU.
_TOPK_BLOCK = 64
# TPU top-k: blocks of one lane row (128), then sub-blocks of 8 inside the k best blocks.
_TPU_BLOCK = 128
_TPU_SUB = 8
# Target block width of the two-level inverse CDF: ~sqrt(V) keeps both cumsums short.
_SAMPLER_BLOCK = 256


def sampler_impl(impl: str | None = None) -> str:
    """The implementation a trace uses: ``impl`` if given, else $VSURGE_SAMPLER_IMPL, else by the backend
    the program is for (models/target.py: a TPU being lowered for counts as one)."""
    impl = impl or os.environ.get(SAMPLER_IMPL_ENV) or ("cpu" if target_backend() == "cpu" else "tpu")
    if impl not in IMPLS:
        raise ValueError(f"sampler implementation must be one of {IMPLS}, got {impl!r}")
    return impl


# ----------------------------------------------------------------------------------------- vocab helpers


def _pick_block(v: int, target: int) -> int:
    """Largest power of two <= target dividing v (no padding copy), else target (pad)."""
    b = target
    while b >= 16:
        if v % b == 0:
            return b
        b //= 2
    return target


def _pad_last(x: jax.Array, multiple: int, value: float) -> jax.Array:
    pad = (-x.shape[-1]) % multiple
    if pad == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=value)


_TOPK_BARRIER: contextvars.ContextVar[bool] = contextvars.ContextVar("vsurge_topk_barrier", default=True)


@contextlib.contextmanager
def sharded_sampling():
    """Trace `sample` for a program partitioned over a mesh (see `_lax_top_k`)."""
    token = _TOPK_BARRIER.set(False)
    try:
        yield
    finally:
        _TOPK_BARRIER.reset(token)


def _lax_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    # XLA:CPU lowers top_k to sort + slice and pattern-matches that back to a partial-sort TopK call.
    # Slicing the result again (e.g. vals[:, :1]) breaks the match and leaves a full sort of the
    # vocabulary (~30 ms at 64 x 4096); the barrier keeps later slices out of the pattern.
    vals, ids = lax.top_k(x, k)
    if _TOPK_BARRIER.get():
        # under SPMD partitioning (engines on a mesh) the barrier crashes XLA's TopkDecomposer
        vals, ids = lax.optimization_barrier((vals, ids))
    return vals, ids


# ------------------------------------------------------------------------------------------------ top-k


def _top_k_cpu(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact ``lax.top_k`` (descending, lower index first on ties) over the last axis of f32[S, V].

    Two stages: the k best blocks by block max contain the k best elements (each block ahead of an
    element's block holds a distinct element ahead of it), so top_k runs on k*B values instead of V.
    Block ids are sorted before the gather so ties still resolve to the lower global index.
    """
    s, v = x.shape
    block = _pick_block(v, _TOPK_BLOCK)
    if -(-v // block) < 4 * k:
        return _lax_top_k(x, k)
    xp = _pad_last(x, block, -jnp.inf)
    nb = xp.shape[-1] // block
    xb = xp.reshape(s, nb, block)
    _, bidx = _lax_top_k(xb.max(-1), k)
    bidx = jnp.sort(bidx, axis=-1)
    gathered = jnp.take_along_axis(xb, bidx[:, :, None], axis=1).reshape(s, k * block)
    vals, pos = _lax_top_k(gathered, k)
    ids = jnp.take_along_axis(bidx, pos // block, axis=1) * block + pos % block
    return vals, jnp.minimum(ids, v - 1)


def _best_blocks(x: jax.Array, k: int, block: int) -> tuple[jax.Array, jax.Array]:
    """The k blocks (contiguous, of ``block`` values) holding the k best values of f32[S, N], in index
    order: (their values f32[S, k * block], their block ids i32[S, k]). Padding is -inf."""
    s = x.shape[0]
    xb = _pad_last(x, block, -jnp.inf).reshape(s, -1, block)
    _, bidx = lax.top_k(xb.max(-1), k)
    bidx = jnp.sort(bidx, axis=-1)  # index order, so ties keep resolving to the lower global index
    return jnp.take_along_axis(xb, bidx[:, :, None], axis=1).reshape(s, k * block), bidx


def _top_k_tpu(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`_top_k_cpu`'s result for backends where ``lax.top_k`` costs ~k passes over its input.

    Narrowed twice by the same argument as `_top_k_cpu` (each block ahead of an element's block holds a
    distinct element ahead of it): the k best 128-blocks, then the k best 8-blocks among them, then a
    ``lax.top_k`` over 8 k values. Measured on a v5e at [64, 128256], k = 64: ~0.1 ms where ``lax.top_k``
    takes 1.6 ms.
    """
    s, v = x.shape
    if -(-v // _TPU_BLOCK) < max(k, 16):
        vals, ids = lax.top_k(x, k)
        return vals, ids
    g1, b1 = _best_blocks(x, k, _TPU_BLOCK)  # [S, 128 k]
    g2, b2 = _best_blocks(g1, k, _TPU_SUB)  # [S, 8 k]
    vals, pos = lax.top_k(g2, k)
    q = jnp.take_along_axis(b2, pos // _TPU_SUB, axis=1) * _TPU_SUB + pos % _TPU_SUB  # index into g1
    ids = jnp.take_along_axis(b1, q // _TPU_BLOCK, axis=1) * _TPU_BLOCK + q % _TPU_BLOCK
    return vals, jnp.minimum(ids, v - 1).astype(jnp.int32)


def top_k_exact(x: jax.Array, k: int, impl: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Exactly ``lax.top_k(x, k)`` over the last axis of f32[S, V], in the implementation of `sampler_impl`."""
    vals, ids = (_top_k_tpu if sampler_impl(impl) == "tpu" else _top_k_cpu)(x, k)
    return vals, ids


def argmax_exact(x: jax.Array, impl: str | None = None) -> jax.Array:
    """i32[S]: argmax over the last axis of f32[S, V], lowest id on ties."""
    if sampler_impl(impl) == "tpu":
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    # jnp.argmax lowers to a variadic reduce that costs ~4 ms at 32 x 49152 on XLA:CPU; this is ~0.1 ms.
    return _top_k_cpu(x, 1)[1][:, 0].astype(jnp.int32)


# Historical names (other engine modules import them): backend-chosen like the rest.
_top_k = top_k_exact
_argmax = argmax_exact


# --------------------------------------------------------------------------------- thresholds, by bisection


def _ordered_keys(x: jax.Array) -> jax.Array:
    """Map f32 to u32 so that unsigned order equals float order (for bisection on exact values)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    neg = (bits >> 31) == 1
    return jnp.where(neg, ~bits, bits | jnp.uint32(0x80000000))


def _bisect_max(ok, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Largest u32 t in [lo, hi) with ok(t), given ok(lo) true, ok(hi) false, ok monotone decreasing.

    Elementwise over lo / hi, so one call serves one row (scalars) or every row at once (arrays)."""

    def body(_, c):
        lo, hi = c
        mid = lo + (hi - lo) // 2
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

    # 32 halvings cover the whole u32 range; converged iterations are no-ops (mid == lo).
    return lax.fori_loop(0, 32, body, (lo, hi))[0]


def _first_ties(eq: jax.Array, j: jax.Array) -> jax.Array:
    """Keep the first ``j`` True entries of bool[V] ``eq`` (by index); others False."""
    # The cumsum costs ~0.2 ms per 49152-row on XLA:CPU, so only pay it when some tie must be dropped.
    return lax.cond(
        jnp.sum(eq) > j,
        lambda: eq & (jnp.cumsum(eq.astype(jnp.int32)) <= j),
        lambda: eq,
    )


def _first_ties_rows(eq: jax.Array, j: jax.Array) -> jax.Array:
    """`_first_ties` for every row of bool[S, V] at once (j i32[S]), without a cumsum over the vocabulary
    (~1 ms at [64, 128256] on a TPU): a bisection on the cut index, ~18 compare + count passes."""
    v = eq.shape[-1]

    def cut():
        idx = lax.broadcasted_iota(jnp.int32, eq.shape, 1)

        # the smallest c in [0, V] with count(eq[:c]) >= j keeps exactly the first j (all when fewer)
        def body(_, c):
            lo, hi = c  # count(eq[:lo]) < j (lo = -1: none), count(eq[:hi]) >= j or hi = V
            mid = (lo + hi) // 2
            live = hi - lo > 1  # converged rows stay put
            good = jnp.sum(eq & (idx < mid[:, None]), axis=-1) >= j
            return jnp.where(live & ~good, mid, lo), jnp.where(live & good, mid, hi)

        s = eq.shape[0]
        init = (jnp.full((s,), -1, jnp.int32), jnp.full((s,), v, jnp.int32))
        hi = lax.fori_loop(0, (v + 1).bit_length(), body, init)[1]
        return eq & (idx < hi[:, None])

    return lax.cond(jnp.any(jnp.sum(eq, axis=-1) > j), cut, lambda: eq)


# ------------------------------------------------------------------------------------------ the draws


def _uniforms(key_data: jax.Array, step: jax.Array) -> jax.Array:
    """f32[S, 2] uniforms in [0, 1), a function of (key[s], step[s]) only."""

    def one(kd, st):
        key = jax.random.fold_in(jax.random.wrap_key_data(kd, impl=_KEY_IMPL), st)
        return jax.random.uniform(key, (2,), jnp.float32)

    return jax.vmap(one)(key_data, step)


def _pick_in_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw over the last axis of nonnegative weights f32[S, N] with u f32[S] in [0, 1).

    The first index whose running sum exceeds u * total has positive weight; the clamp to the last positive
    index only guards the rounding case u * total == total.
    """
    cs = jnp.cumsum(weights, axis=-1)
    target = u * cs[:, -1]
    idx = jnp.sum(cs <= target[:, None], axis=-1)
    n = weights.shape[-1]
    last_pos = jnp.max(jnp.where(weights > 0, jnp.arange(n), 0), axis=-1)
    return jnp.minimum(idx, last_pos).astype(jnp.int32)


def _sample_full_vocab(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Draw from unnormalized weights f32[S, V] with a two-level inverse CDF (block, then token)."""
    s, v = weights.shape
    block = _pick_block(v, _SAMPLER_BLOCK)
    wb = _pad_last(weights, block, 0.0).reshape(s, -1, block)
    b = _pick_in_cdf(wb.sum(-1), u[:, 0])
    row = jnp.take_along_axis(wb, b[:, None, None], axis=1)[:, 0, :]
    j = _pick_in_cdf(row, u[:, 1])
    return jnp.minimum(b * block + j, v - 1)
