"""What the sampler does to the logits before choosing: the structured-output token mask, logit_bias /
allowed_token_ids, repetition / frequency / presence penalties and min_tokens' stop-id suppression.

Each is a pure function of the logits f32[S, V] and the per-slot `SlotSampling`; `sample` calls them behind
``lax.cond`` on whether any slot needs them, so a step without them pays a comparison over [S] (or [S, B])
and nothing over the vocabulary."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from .state import SlotSampling

# Widths the sparse bias row is cut to before its scatter: a scatter's cost is one update per element
# (~0.9 ms for 64 x 1024 on a v5e, ~7 us for 64 x 8), and most requests name a handful of ids.
_BIAS_WIDTHS = (8, 64)


def _apply_penalties(logits, params, counts, prompt_mask):
    rp = params.repetition_penalty[:, None]
    seen = counts > 0 if counts is not None else None
    rep_mask = seen
    if prompt_mask is not None:
        rep_mask = prompt_mask if rep_mask is None else (rep_mask | prompt_mask)
    out = logits
    if rep_mask is not None:
        out = jnp.where(rep_mask, jnp.where(out > 0, out / rp, out * rp), out)
    if counts is not None:
        # A neutral slot (penalties 0 / 1) gets back its logits bit for bit, so the branch taken for the
        # other slots never changes its samples.
        out = out - params.frequency_penalty[:, None] * counts.astype(out.dtype)
        out = out - params.presence_penalty[:, None] * seen.astype(out.dtype)
    return out


def _apply_bias_cols(logits, ids, vals, restrict):
    s, v = logits.shape
    rows = jnp.arange(s)[:, None]
    idx = jnp.where((ids >= 0) & (ids < v), ids, v)  # padding scatters to V, which mode="drop" discards
    biased = logits.at[rows, idx].add(vals, mode="drop")
    listed = jnp.zeros((s, v), bool).at[rows, idx].set(True, mode="drop")
    return jnp.where(restrict[:, None] & ~listed, -jnp.inf, biased)


def _apply_bias(logits: jax.Array, params: SlotSampling) -> jax.Array:
    """logit_bias added to the listed ids; with allowed_token_ids (``restrict``) every other id -> -inf.

    The row is scattered only as wide as its last used column (rounded up to one of `_BIAS_WIDTHS`):
    columns past it are padding, which the scatter would drop anyway, so the result is the same."""
    ids, vals = params.bias_ids, params.bias_vals
    b = ids.shape[1]
    widths = [w for w in _BIAS_WIDTHS if w < b] + [b]
    used = jnp.max(jnp.where(ids >= 0, jnp.arange(1, b + 1, dtype=jnp.int32), 0))
    branch = sum((used > w).astype(jnp.int32) for w in widths[:-1]) if len(widths) > 1 else 0

    def cut(w, x):
        return _apply_bias_cols(x, ids[:, :w], vals[:, :w], params.restrict)

    return lax.switch(branch, [partial(cut, w) for w in widths], logits)


def _suppress_stop_ids(logits, params, step):
    s, v = logits.shape
    ids = params.stop_ids
    active = (step < params.min_tokens)[:, None] & (ids >= 0) & (ids < v)
    return logits.at[jnp.arange(s)[:, None], jnp.where(active, ids, v)].set(-jnp.inf, mode="drop")


def unpack_token_mask(token_mask: jax.Array, vocab_size: int) -> jax.Array:
    """bool[S, V] from the packed i32[S, ceil(V/32)] mask (bit t % 32 of word t // 32)."""
    bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(token_mask.shape[0], -1)[:, :vocab_size].astype(bool)


def apply_token_mask(logits: jax.Array, token_mask: jax.Array) -> jax.Array:
    """Disallowed tokens -> -inf. Behind a cond: a batch whose rows are all ones pays one compare of the
    packed words (S x V/32), not the unpack over the vocabulary."""
    return lax.cond(
        jnp.any(token_mask != -1),
        lambda x: jnp.where(unpack_token_mask(token_mask, x.shape[-1]), x, -jnp.inf),
        lambda x: x,
        logits,
    )


def penalized_logits(
    logits: jax.Array,
    params: SlotSampling,
    generated_counts: jax.Array | None,
    prompt_mask: jax.Array | None,
    step: jax.Array,
) -> jax.Array:
    """Steps 0-3 of the module docstring of `vsurge.engines.sampling`: bias / allowed ids, the penalties and
    min_tokens' stop-id suppression, each behind a cond on whether any slot needs it."""
    pen = lax.cond(jnp.any(params.bias_ids >= 0), lambda x: _apply_bias(x, params), lambda x: x, logits)
    if generated_counts is not None or prompt_mask is not None:
        active = (params.repetition_penalty != 1.0) | (params.presence_penalty != 0.0)
        active = active | (params.frequency_penalty != 0.0)
        pen = lax.cond(
            jnp.any(active),
            lambda x: _apply_penalties(x, params, generated_counts, prompt_mask),
            lambda x: x,
            pen,
        )
    suppress = (step < params.min_tokens) & jnp.any(params.stop_ids >= 0, axis=-1)
    return lax.cond(jnp.any(suppress), lambda x: _suppress_stop_ids(x, params, step), lambda x: x, pen)
