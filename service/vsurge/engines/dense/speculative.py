"""n-gram speculative decoding (prompt lookup): the host-side proposer and the on-device verification.

Proposer (host, numpy). `propose_ngram` looks for the last ``n`` tokens of a sequence (prompt + output)
earlier in the same sequence, longest ``n`` first (``max_ngram`` down to ``min_ngram``), and proposes the up
to ``k`` tokens that followed its most recent earlier occurrence. No draft model: it pays off where the
output repeats its context (summaries, quotes, code edits, extraction) and proposes nothing elsewhere.

Verification (device, jitted). The target model scores K+1 positions per row in one batched call: the
last accepted token followed by the K draft tokens; ``logits[:, t]`` is the distribution of the token after
draft position t-1. `verify` then returns, per row, the tokens to emit: the accepted draft prefix followed
by one more token from the target (the correction at the first rejection, or a bonus token when every
draft token was accepted), so each verify step emits between 1 and K+1 tokens.

* temperature 0 (greedy): a draft token is accepted iff it is the argmax of the target at its position
  (same tie rule as the sampler: the lowest id). The emitted tokens are exactly the argmax chain, so the
  output is identical to non-speculative greedy decoding of the same logits.
* temperature > 0: rejection sampling (Leviathan et al. 2023; Chen et al. 2023). The n-gram draft is
  deterministic, so its proposal q is a point mass on the draft token d: accept with probability
  min(1, p(d) / q(d)) = p(d); on rejection draw from the residual max(0, p - q) renormalised, i.e. p with
  d removed. Each emitted token is then distributed exactly as p, whatever the draft, where p is
  softmax(logits / T) of the target at that position.

Randomness: each row's position t uses ``fold_in(key, step + t)`` (three uniforms: one for the
acceptance test, two for the two-level inverse-CDF draw), so a row's tokens depend only on its key, its
step counter and its own logits, never on the other rows.

Shapes: B rows, K draft positions (static), V vocabulary. Rows with ``num_draft = 0`` reduce to ordinary
decoding (one token from position 0).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The sampler's own helpers, so greedy ties, key handling and the inverse-CDF draw are the same code as
# in ordinary decoding (private there: this module is their only other user).
from ..sampling import _KEY_IMPL, GREEDY_EPS, _argmax, _sample_full_vocab

__all__ = [
    "DEFAULT_MAX_NGRAM",
    "DEFAULT_MIN_NGRAM",
    "VerifyResult",
    "expected_accepted",
    "propose_ngram",
    "propose_ngram_batch",
    "verify",
    "verify_jit",
    "worth_verifying",
]

DEFAULT_MAX_NGRAM = 3
# One-token matches are everywhere in unrelated text: their drafts are mostly rejected, and a verify
# step costs more than a decode step, so a match must be at least two tokens long by default.
DEFAULT_MIN_NGRAM = 2


# ------------------------------------------------------------------------------------------- proposer


def propose_ngram(
    tokens: np.ndarray | list[int],
    k: int,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int = DEFAULT_MIN_NGRAM,
) -> np.ndarray:
    """Up to k draft tokens for the sequence ``tokens`` (prompt + generated so far); int32[<= k].

    The longest suffix n-gram (``max_ngram`` down to ``min_ngram`` tokens) that also occurs earlier wins;
    among its earlier occurrences the most recent one (the nearest context). Empty when nothing matches.
    """
    seq = np.asarray(tokens, dtype=np.int32)
    n_tok = seq.shape[0]
    if k <= 0 or n_tok < 2:
        return np.zeros(0, np.int32)
    for n in range(min(max_ngram, n_tok - 1), max(min_ngram, 1) - 1, -1):
        pattern = seq[n_tok - n :]
        # windows starting at 0 .. n_tok-n-1: each is an earlier occurrence with at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + k].copy()
    return np.zeros(0, np.int32)


def propose_ngram_batch(
    sequences: list[np.ndarray | list[int] | None],
    k: int,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int = DEFAULT_MIN_NGRAM,
) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for B rows: (int32[B, k] zero padded, int32[B] how many are real). None: an idle row."""
    drafts = np.zeros((len(sequences), k), np.int32)
    counts = np.zeros(len(sequences), np.int32)
    for row, seq in enumerate(sequences):
        if seq is None:
            continue
        d = propose_ngram(seq, k, max_ngram, min_ngram)
        drafts[row, : d.shape[0]] = d
        counts[row] = d.shape[0]
    return drafts, counts


# ------------------------------------------------------------------------------------------- the gate


def expected_accepted(num_draft: np.ndarray, p: float) -> float:
    """Draft tokens a verify step is expected to accept: sum over rows of p + p^2 + ... + p^d.

    ``p`` is the chance that a draft token is right (what the step thread measures: how often the
    token the target chose equals the first draft token); each later one needs every earlier one right.
    """
    d = np.asarray(num_draft, np.float64)
    d = d[d > 0]
    if not d.size or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return float(d.sum())
    return float(np.sum(p * (1.0 - p**d) / (1.0 - p)))


def worth_verifying(live_rows: int, num_draft: np.ndarray, p: float, cost_ratio: float) -> bool:
    """True when a verify step should emit more tokens per unit of time than a decode step.

    A decode step emits ``live_rows`` tokens; a verify step, costing ``cost_ratio`` decode steps (K+1
    positions per row instead of one, measured at start-up), emits those plus the accepted drafts. Where
    the drafts are mostly wrong (text that does not repeat itself) the step stays a decode step, so
    speculation costs little there.
    """
    if live_rows <= 0 or not np.any(np.asarray(num_draft) > 0):
        return False
    return live_rows + expected_accepted(num_draft, p) > cost_ratio * live_rows


# --------------------------------------------------------------------------------------- verification


class VerifyResult(NamedTuple):
    tokens: jax.Array  # i32[B, K+1]; the first num_accepted + 1 are emitted, the rest are -1
    num_accepted: jax.Array  # i32[B]; draft tokens accepted (0 .. num_draft)
    logprob: jax.Array  # f32[B, K+1]; raw-model logprob of each emitted token (0 past the emitted ones)


def _position_uniforms(key_data: jax.Array, step: jax.Array, positions: int) -> jax.Array:
    """f32[B, P, 3] uniforms in [0, 1): row b, position t from fold_in(key[b], step[b] + t)."""

    def one(kd, st):
        key = jax.random.wrap_key_data(kd, impl=_KEY_IMPL)
        keys = jax.vmap(lambda t: jax.random.fold_in(key, st + t))(jnp.arange(positions, dtype=jnp.int32))
        return jax.vmap(lambda k: jax.random.uniform(k, (3,), jnp.float32))(keys)

    return jax.vmap(one)(key_data, step)


def _leading_true(x: jax.Array) -> jax.Array:
    """i32[B]: how many leading entries of each row of bool[B, K] are True."""
    return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify(
    logits: jax.Array,
    draft: jax.Array,
    num_draft: jax.Array,
    temperature: jax.Array,
    key_data: jax.Array,
    step: jax.Array,
) -> VerifyResult:
    """Accept a prefix of each row's draft and add one target token; see the module docstring.

    logits f32[B, K+1, V] (target at the K+1 scored positions), draft i32[B, K], num_draft i32[B] (real
    draft tokens per row, the rest of ``draft`` is ignored), temperature f32[B] (< GREEDY_EPS: greedy),
    key_data u32[B, 2], step i32[B] (index of the first token this verify emits within the request).
    """
    logits = logits.astype(jnp.float32)
    b, p, v = logits.shape
    k = p - 1
    draft = draft.astype(jnp.int32)
    num_draft = jnp.minimum(num_draft.astype(jnp.int32), k)
    live = jnp.arange(k)[None, :] < num_draft[:, None]  # bool[B, K]: real draft positions
    rows = jnp.arange(b)

    # greedy: the argmax chain; the draft is accepted as long as it follows that chain
    greedy_chain = _argmax(logits.reshape(b * p, v)).reshape(b, p)
    greedy_acc = _leading_true(live & (draft == greedy_chain[:, :k]))

    greedy = temperature < GREEDY_EPS

    def sampled() -> tuple[jax.Array, jax.Array]:
        inv_t = 1.0 / jnp.where(greedy, 1.0, temperature)
        scaled = logits * inv_t[:, None, None]
        lse_t = jax.nn.logsumexp(scaled, axis=-1)  # f32[B, P]
        p_draft = jnp.exp(
            jnp.take_along_axis(scaled[:, :k], draft[:, :, None], axis=-1)[..., 0] - lse_t[:, :k]
        )
        u = _position_uniforms(key_data, step.astype(jnp.int32), p)  # f32[B, P, 3]
        accepted = _leading_true(live & (u[:, :k, 0] < p_draft))
        # the one extra token comes from position `accepted`: the residual (draft token removed) after a
        # rejection, the full target distribution after a fully accepted draft (or no draft)
        at = scaled[rows, accepted]  # f32[B, V]
        weights = jnp.exp(at - jnp.max(at, axis=-1, keepdims=True))
        rejected = accepted < num_draft
        d_at = draft[rows, jnp.minimum(accepted, k - 1)] if k else jnp.zeros(b, jnp.int32)
        residual = jnp.where(rejected[:, None] & (jnp.arange(v)[None, :] == d_at[:, None]), 0.0, weights)
        # a residual of (numerically) zero mass means p(d) was ~1 and is never rejected; guard anyway
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, weights)
        extra = _sample_full_vocab(residual, u[rows, accepted, 1:])
        chain = jnp.concatenate([draft, jnp.zeros((b, 1), jnp.int32)], axis=1)
        chain = chain.at[rows, accepted].set(extra)
        return chain, accepted

    chain_s, acc_s = jax.lax.cond(jnp.all(greedy), lambda: (greedy_chain, greedy_acc), sampled)
    chain = jnp.where(greedy[:, None], greedy_chain, chain_s)
    accepted = jnp.where(greedy, greedy_acc, acc_s)

    emitted = jnp.arange(p)[None, :] <= accepted[:, None]
    tokens = jnp.where(emitted, chain, -1)
    lse = jax.nn.logsumexp(logits, axis=-1)
    lp = jnp.take_along_axis(logits, jnp.maximum(tokens, 0)[:, :, None], axis=-1)[..., 0] - lse
    return VerifyResult(tokens.astype(jnp.int32), accepted, jnp.where(emitted, lp, 0.0))


verify_jit = jax.jit(verify)
