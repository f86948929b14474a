"""On-device sampling: one vectorized, jit-friendly step over all decode slots.

Interface
---------
``sample(logits, params, generated_counts, prompt_mask, step, num_top_logprobs=0, *, candidate_cap=64,
token_mask=None, impl=None)``

* ``logits``            f32[S, V]  raw model logits of the S slots.
* ``params``            `SlotSampling`, per-slot arrays (leading dim S), see below.
* ``generated_counts``  i32[S, V]  how often each token was generated so far by the request in the slot
                        (``None``: nothing generated yet). Keep it on device with `update_counts`.
* ``prompt_mask``       bool[S, V] which tokens occur in the slot's prompt (``None``: none); build rows with
                        `prompt_mask_from_tokens`.
* ``step``              i32[S]     index of the token being sampled within the request's output (0 for the
                        first token, sampled right after prefill). Randomness is ``fold_in(key[s], step[s])``.
* ``num_top_logprobs``  static int K (0..20): the width of ``top_ids`` / ``top_logprobs``.
* ``candidate_cap``     static int; how many top candidates the cheap top-k/top-p path looks at.
* ``impl``              static ``"cpu"`` / ``"tpu"`` / None (by backend), see below.

* ``token_mask``        optional i32[S, ceil(V/32)], packed: bit ``t % 32`` of word ``t // 32`` set <=> token t
                        may be sampled (structured output; unconstrained rows are all ones, -1 words).
                        ``None`` traces the program without it, exactly as before.

Returns `SampleResult(tokens i32[S], logprob f32[S], top_ids i32[S, K], top_logprobs f32[S, K])`; the
logprobs are of the model's raw distribution (``log_softmax(logits)``, before penalties or temperature) — under
a token mask, of the masked one (disallowed tokens -inf, the rest renormalized), as vLLM reports them: the
reported top candidates are then tokens the request could actually have produced.

Semantics, per slot, in this order (vLLM / Hugging Face conventions):

m. with a token mask, every token whose bit is clear gets ``-inf`` before anything else (a row of all ones
   leaves the logits bit for bit unchanged, so unconstrained slots sample exactly what they would without);
0. logit_bias is added to the listed ids; with allowed_token_ids every id not listed gets ``-inf``
   (both live in one sparse row per slot, ``bias_ids`` / ``bias_vals``, so a step without them pays one
   comparison over that row and nothing over the vocabulary);
1. repetition penalty (HF/CTRL) on tokens seen in the prompt or the output: positive logits are divided
   by it, negative ones multiplied;
2. frequency / presence penalties (OpenAI) over the generated tokens:
   ``l -= frequency * count + presence * (count > 0)``;
3. while ``step < min_tokens`` the slot's ``stop_ids`` (EOS, stop_token_ids) get ``-inf``;
4. ``temperature < GREEDY_EPS`` (so 0) -> exact greedy: argmax of the penalized logits, lowest id on ties,
   no randomness, no division;
5. otherwise tokens are ordered by penalized logit (descending, lower id first on ties) and filtered on the
   distribution ``softmax(l / T)``: top_k keeps the first k (0 = off), top_p keeps the shortest prefix
   whose probability reaches top_p (so the top token always stays), min_p keeps tokens with
   ``p >= min_p * p_max``; the token is drawn from the renormalized remaining mass.

Host / device helpers: `make_slot_sampling` (host values -> `SlotSampling`, ``None`` = idle greedy slot),
`set_slot` (write one row, jit-friendly), `seed_key_data` (seed, sample index -> u32[2] key material),
`update_counts` (scatter-add of the sampled tokens; the token sampled at prefill must be counted too) and
`prompt_mask_from_tokens`.

Logprobs only when asked: ``SlotSampling.num_logprobs`` (from SamplingParams.logprobs / top_logprobs) gates
them; a step where no slot asks computes neither the logsumexp nor the top K (``logprob`` / ``top_*`` are
then 0; their shapes never change). See `vsurge.engines.sampling.logprobs`.

Two implementations, chosen at trace time by `sampler_impl` (``impl=``, else $VSURGE_SAMPLER_IMPL, else
``"cpu"`` on XLA:CPU and ``"tpu"`` on every other backend), with the same semantics and the same tokens for
the same seed and logits: they differ only in how the argmax, the exact top-k and the exact thresholds are
computed (`vsurge.engines.sampling.ops`, `vsurge.engines.sampling.filters`).

Cost. The step never sorts the vocabulary (a [32, 49152] sort takes ~270 ms on XLA:CPU, ~9 ms at
[64, 128256] on a v5e). ``benchmarks/sampling_bench.py`` times it; see README "Sampling".

* every expensive part sits behind ``lax.cond`` on whether any slot needs it: penalties, EOS suppression,
  the sampling path at all (all-greedy batches skip it), the candidates, the full-vocabulary normalizer,
  the full-vocabulary sampler, the exact fallback and the logprobs;
* greedy: the exact argmax (CPU: a two-stage top-1, ~0.1 ms at 32 x 49152 where ``jnp.argmax`` takes
  ~4 ms; TPU: ``jnp.argmax``, one pass);
* untruncated slots (top_k off, top_p 1, min_p 0) draw over the whole vocabulary with a two-level
  (block, then token) inverse CDF: one exp pass, no sort, no per-token random numbers;
* top_k / top_p / min_p first look at the ``candidate_cap`` best tokens (an exact top-k narrowed by block
  maxima). When the kept set provably lies inside them, the draw is an inverse CDF over those candidates;
  min_p alone is a plain mask, so it falls back to the full-vocabulary sampler;
* otherwise (top_p's nucleus wider than the cap, or cap < top_k < V) the slot takes the exact path: a
  32-step bisection on the float bits of the penalized logits finds the exact top_k / top_p thresholds
  (ties resolved by id), then the same full-vocabulary sampler. CPU: row by row for those slots only
  (~0.5 ms per slot at V=49152); TPU: every row at once.

Each slot consumes exactly two uniforms per step, from ``fold_in(key[s], step[s])``; which path a slot
takes depends only on its own logits and parameters, so a request's tokens depend only on its seed and its
history, never on the other slots or on which slot it landed in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from vsurge.contracts.sampling_params import MAX_TOP_LOGPROBS

from .filters import _exact_row_mask, exact_rows_cpu, exact_rows_vectorized
from .logprobs import logprob_outputs
from .ops import (
    _KEY_IMPL,
    IMPLS,
    SAMPLER_IMPL_ENV,
    _argmax,
    _pick_in_cdf,
    _sample_full_vocab,
    _top_k,
    _top_k_cpu,
    _top_k_tpu,
    _uniforms,
    argmax_exact,
    sampler_impl,
    sharded_sampling,
    top_k_exact,
)
from .penalties import (
    _apply_bias,
    _apply_penalties,
    _suppress_stop_ids,
    apply_token_mask,
    penalized_logits,
    unpack_token_mask,
)
from .state import (
    DEFAULT_CANDIDATE_CAP,
    DEFAULT_MAX_BIAS_IDS,
    DEFAULT_MAX_STOP_IDS,
    GREEDY_EPS,
    NO_LOGPROBS,
    SampleResult,
    SlotSampling,
    make_slot_sampling,
    prompt_mask_from_tokens,
    seed_key_data,
    set_slot,
    slot_num_logprobs,
    update_counts,
)

__all__ = [
    "DEFAULT_CANDIDATE_CAP",
    "DEFAULT_MAX_BIAS_IDS",
    "DEFAULT_MAX_STOP_IDS",
    "GREEDY_EPS",
    "IMPLS",
    "NO_LOGPROBS",
    "SAMPLER_IMPL_ENV",
    "SampleResult",
    "SlotSampling",
    "apply_token_mask",
    "argmax_exact",
    "make_slot_sampling",
    "prompt_mask_from_tokens",
    "sample",
    "sample_jit",
    "sampler_impl",
    "seed_key_data",
    "set_slot",
    "sharded_sampling",
    "slot_num_logprobs",
    "top_k_exact",
    "unpack_token_mask",
    "update_counts",
]

# Private names other engine modules and the tests import from here.
_REEXPORTED = (
    _KEY_IMPL,
    _apply_bias,
    _apply_penalties,
    _argmax,
    _exact_row_mask,
    _suppress_stop_ids,
    _top_k,
    _top_k_cpu,
    _top_k_tpu,
)


# ---------------------------------------------------------------------------------------------- the step


def _sampling_tokens(pen, params, greedy, u, cap, impl):
    """Tokens for the non-greedy slots (greedy slots get an unused value)."""
    s, v = pen.shape
    t = jnp.where(greedy, 1.0, params.temperature)
    inv_t = (1.0 / t)[:, None]
    k_eff = jnp.where((params.top_k <= 0) | (params.top_k >= v), v, params.top_k)
    top_p = params.top_p
    min_p = params.min_p

    # Untruncated slots (no top_k / top_p / min_p) never need candidates: they always take the
    # full-vocabulary sampler, so a batch of them skips the top-k entirely.
    untruncated = (k_eff == v) & (top_p >= 1.0) & (min_p <= 0.0)
    filtered = ~greedy & ~untruncated
    lmax = jnp.max(pen, axis=-1, keepdims=True)  # bit-equal to the top candidate's logit
    vals, ids = lax.cond(
        jnp.any(filtered),
        lambda: top_k_exact(pen, cap, impl),
        lambda: (jnp.broadcast_to(lmax, (s, cap)), jnp.zeros((s, cap), jnp.int32)),
    )
    p_c = jnp.exp((vals - lmax) * inv_t)  # candidate probs relative to the top token (p_c[:, 0] == 1)
    pos = jnp.arange(cap)[None, :]
    in_k = pos < k_eff[:, None]
    csum = jnp.cumsum(jnp.where(in_k, p_c, 0.0), axis=-1)

    k_le_cap = k_eff <= cap
    untruncated_k = k_eff == v
    # top_p over an untruncated distribution needs its full normalizer: one exp pass, only when used.
    need_z = filtered & untruncated_k & (top_p < 1.0) & ~k_le_cap
    z_full = lax.cond(
        jnp.any(need_z),
        lambda: jnp.sum(jnp.exp((pen - lmax) * inv_t), axis=-1),
        lambda: jnp.ones((s,), pen.dtype),
    )
    zk = jnp.where(k_le_cap, csum[:, -1], z_full)
    target = top_p * zk
    n_short = jnp.sum((csum < target[:, None]) & in_k, axis=-1)
    reached = n_short < jnp.minimum(k_eff, cap)
    over = cap + 1  # "more than cap", exact value unknown
    n_p = jnp.where(top_p >= 1.0, v, jnp.where(reached, n_short + 1, jnp.where(k_le_cap, k_eff, over)))
    n_p_known = (top_p >= 1.0) | k_le_cap | untruncated_k
    # min_p: p >= min_p * p_max, and p_max == 1 here. Exact count when the cap's last candidate fails it.
    n_m = jnp.where(
        min_p <= 0.0,
        v,
        jnp.where(p_c[:, -1] < min_p, jnp.sum(p_c >= min_p[:, None], axis=-1), over),
    )
    m = jnp.minimum(jnp.minimum(k_eff, n_p), n_m)

    use_cap = filtered & n_p_known & (m <= cap)
    use_full = ~greedy & ~use_cap & untruncated_k & (top_p >= 1.0)
    use_exact = ~greedy & ~use_cap & ~use_full

    # Cheap path: inverse CDF over the first m candidates.
    cap_j = _pick_in_cdf(jnp.where(pos < m[:, None], p_c, 0.0), u[:, 0])
    cap_tok = jnp.take_along_axis(ids, cap_j[:, None], axis=1)[:, 0]
    exact_rows = exact_rows_vectorized if impl == "tpu" else exact_rows_cpu

    def full_vocab():
        p = jnp.exp((pen - lmax) * inv_t)
        mask = p >= min_p[:, None]
        mask = lax.cond(
            jnp.any(use_exact),
            lambda m: exact_rows(pen, lmax, inv_t, k_eff, top_p, min_p, use_exact, m),
            lambda m: m,
            mask,
        )
        return _sample_full_vocab(jnp.where(mask, p, 0.0), u)

    full_tok = lax.cond(jnp.any(use_full | use_exact), full_vocab, lambda: jnp.zeros((s,), jnp.int32))
    return jnp.where(use_cap, cap_tok, full_tok).astype(jnp.int32)


def sample(
    logits: jax.Array,
    params: SlotSampling,
    generated_counts: jax.Array | None,
    prompt_mask: jax.Array | None,
    step: jax.Array,
    num_top_logprobs: int = 0,
    *,
    candidate_cap: int = DEFAULT_CANDIDATE_CAP,
    token_mask: jax.Array | None = None,
    impl: str | None = None,
) -> SampleResult:
    """Sample one token per slot; see the module docstring for shapes and semantics."""
    if not 0 <= num_top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"num_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {num_top_logprobs}")
    impl = sampler_impl(impl)
    logits = logits.astype(jnp.float32)
    s, v = logits.shape
    cap = max(1, min(candidate_cap, v))
    step = jnp.asarray(step, jnp.int32)
    if token_mask is not None:
        logits = apply_token_mask(logits, token_mask)

    pen = penalized_logits(logits, params, generated_counts, prompt_mask, step)
    greedy = params.temperature < GREEDY_EPS
    greedy_tok = argmax_exact(pen, impl)
    u = _uniforms(params.key, step)
    sampled = lax.cond(
        jnp.all(greedy),
        lambda: greedy_tok,
        lambda: _sampling_tokens(pen, params, greedy, u, cap, impl),
    )
    tokens = jnp.where(greedy, greedy_tok, sampled)
    logprob, top_ids, top_lp = logprob_outputs(
        logits, tokens, params.num_logprobs, num_top_logprobs, lambda x, k: top_k_exact(x, k, impl)
    )
    return SampleResult(tokens, logprob, top_ids, top_lp)


sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs", "candidate_cap", "impl"))
