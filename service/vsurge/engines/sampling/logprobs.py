"""The logprobs a step reports: the chosen token's and the top K, of the model's raw distribution
(``log_softmax(logits)``, before penalties or temperature; under a token mask, of the masked one).

Only when asked: with `SlotSampling.num_logprobs` given, the chosen token's logprob (a logsumexp over
[S, V]) is computed only when some slot asked for logprobs, and the top K (an exact top-k over the
vocabulary) only when some slot asked for top logprobs. The output shapes never change; values nobody
asked for are 0."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def logprob_outputs(
    logits: jax.Array,
    tokens: jax.Array,
    num_logprobs: jax.Array | None,
    k: int,
    top_k: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logprob f32[S], top_ids i32[S, k], top_logprobs f32[S, k]) of ``tokens`` under ``logits``.

    ``num_logprobs`` (i32[S], -1 none / 0 chosen only / > 0 top too) gates the work; None computes all.
    """
    s = logits.shape[0]

    def chosen():
        lse = jax.nn.logsumexp(logits, axis=-1)
        return jnp.take_along_axis(logits, tokens[:, None], axis=1)[:, 0] - lse, lse

    def top(lse):
        vals, ids = top_k(logits, k)
        return ids.astype(jnp.int32), vals - lse[:, None]

    def no_top(lse):
        return jnp.zeros((s, k), jnp.int32), jnp.zeros((s, k), jnp.float32)

    if num_logprobs is None:
        logprob, lse = chosen()
        top_ids, top_lp = top(lse) if k else no_top(lse)
        return logprob, top_ids, top_lp
    zeros = jnp.zeros((s,), jnp.float32)
    logprob, lse = lax.cond(jnp.any(num_logprobs >= 0), chosen, lambda: (zeros, zeros))
    if not k:
        return (logprob, *no_top(lse))
    top_ids, top_lp = lax.cond(jnp.any(num_logprobs > 0), top, no_top, lse)
    return logprob, top_ids, top_lp
