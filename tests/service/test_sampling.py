"""On-device sampling: exactness of greedy and of the top_k / top_p / min_p sets, reproducibility per seed,
slot independence, penalties against a numpy reference, and the distribution of plain sampling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vsurge.contracts.sampling_params import SamplingParams as SP
from vsurge.engines import sampling as smp
from vsurge.engines.sampling import (
    GREEDY_EPS,
    SlotSampling,
    make_slot_sampling,
    prompt_mask_from_tokens,
    sample_jit,
    seed_key_data,
    set_slot,
    update_counts,
)

# ------------------------------------------------------------------------------------------- references


def np_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_order(logits: np.ndarray) -> np.ndarray:
    """Descending by logit, lower id first on ties."""
    return np.lexsort((np.arange(logits.shape[-1]), -np.asarray(logits, np.float64)))


def np_allowed(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Independent float64 reference of the kept set: top_k, then top_p (shortest prefix), then min_p."""
    v = logits.shape[-1]
    order = np_order(logits)
    p = np_softmax(np.asarray(logits, np.float64) / temperature)
    n = top_k if 0 < top_k < v else v
    if top_p < 1.0:
        ps = p[order[:n]]
        c = np.cumsum(ps) / ps.sum()
        n = min(n, int(np.searchsorted(c, top_p, side="left")) + 1)
    keep = np.zeros(v, bool)
    keep[order[:n]] = True
    return keep & (p >= min_p * p.max())


def np_penalize(logits, counts, prompt_mask, presence, frequency, repetition):
    out = np.array(logits, np.float64)
    seen = counts > 0
    rep = seen | prompt_mask
    out = np.where(rep, np.where(out > 0, out / repetition, out * repetition), out)
    return out - frequency * counts - presence * seen


def chi2_critical(df: int, z: float = 4.5) -> float:
    """Wilson-Hilferty approximation of the chi-square upper quantile at a z-score (p ~ 3e-6 for 4.5)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    assert counts[probs == 0].sum() == 0, "sampled a zero-probability token"
    counts, probs = counts[probs > 0], probs[probs > 0]
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big).any():  # pool the rare bins so the statistic stays valid
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    obs_b, exp_b = np.array(obs_b, np.float64), np.array(exp_b)
    return float(((obs_b - exp_b) ** 2 / exp_b).sum()), len(obs_b) - 1


# Every test uses a few shared shapes so the whole file compiles `sample` only a handful of times (each
# compile costs seconds on XLA:CPU): S slots x V (4096, a multiple of 64), V_ODD (padding paths), V_TINY
# (vocab smaller than the candidate cap), with candidate caps 64 (cheap path) and 2 (exact path).
S = 64
V = 4096
V_ODD = 4099
V_TINY = 24
CAP = smp.DEFAULT_CANDIDATE_CAP
CAP_EXACT = 2
S_HIST = 8  # slots for the tests that carry counts / prompt mask and top logprobs
K_TOP = 3


def draw(row: np.ndarray, sp: SP, steps: int, cap: int = CAP, seed0: int = 1000) -> np.ndarray:
    """Sample ``steps`` times from the same logits in S slots with seeds seed0..seed0+S-1."""
    params = make_slot_sampling([sp] * S, keys=[seed_key_data(seed0 + i) for i in range(S)])
    logits = jnp.broadcast_to(jnp.asarray(row, jnp.float32), (S, row.shape[-1]))
    out = []
    for t in range(steps):
        res = sample_jit(logits, params, None, None, jnp.full((S,), t, jnp.int32), candidate_cap=cap)
        out.append(np.asarray(res.tokens))
    return np.concatenate(out)


def sample_hist(logits, params, counts, pmask, step):
    """The history-carrying variant (counts + prompt mask + top logprobs), shape [S_HIST, V]."""
    return sample_jit(
        jnp.asarray(logits), params, jnp.asarray(counts, jnp.int32), jnp.asarray(pmask), step, K_TOP
    )


def spaced_logits(v: int, seed: int, scale: float = 2.0) -> np.ndarray:
    """Random logits whose pairwise gaps are not tiny, so set boundaries have a margin over f32 rounding."""
    rng = np.random.default_rng(seed)
    base = np.sort(rng.normal(size=v))[::-1] * scale
    base = base + np.linspace(0.0, -1e-3 * v, v)  # strictly decreasing before shuffling
    return rng.permutation(base).astype(np.float32)


def mid_top_p(row: np.ndarray, temperature: float, n: int, top_k: int = 0) -> float:
    """A top_p whose nucleus has exactly n tokens, halfway between two cumulative masses."""
    v = row.shape[-1]
    order = np_order(row)
    kk = top_k if 0 < top_k < v else v
    ps = np_softmax(row.astype(np.float64) / temperature)[order[:kk]]
    c = np.cumsum(ps) / ps.sum()
    return float((c[n - 2] + c[n - 1]) / 2) if n >= 2 else float(c[0] / 2)


# ------------------------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("v", [V, V_ODD])
def test_greedy_is_exact_argmax(v):
    rng = np.random.default_rng(v)
    logits = rng.normal(size=(S, v)).astype(np.float32) * 5
    # Ties: the lowest id must win, like np.argmax.
    logits[0, :] = 1.0
    logits[1, [3, v - 1]] = 100.0
    logits[2, :] = -np.inf
    logits[2, v // 2] = 0.0
    logits[3, v - 1] = 50.0  # the last id, inside the padded block when v % 64 != 0
    # Greedy ignores seeds, steps and every filter.
    sps = [SP(temperature=0.0 if i % 2 else 1e-6, seed=i, top_p=0.3, top_k=3, min_p=0.5) for i in range(S)]
    params = make_slot_sampling(sps)
    for t in (0, 7):
        res = sample_jit(jnp.asarray(logits), params, None, None, jnp.full((S,), t, jnp.int32))
        np.testing.assert_array_equal(np.asarray(res.tokens), np.argmax(logits, -1))
    assert np.isfinite(np.asarray(res.logprob)[[0, 1, 3]]).all()


def test_two_stage_top_k_matches_lax_top_k_with_ties():
    rng = np.random.default_rng(0)
    top_k = jax.jit(smp._top_k, static_argnums=1)
    for v, k in ((V, 1), (V, 16), (16384, 64), (16387, 8)):
        x = jnp.asarray(rng.integers(-20, 20, size=(4, v)).astype(np.float32))  # many ties
        vals, ids = top_k(x, k)
        rv, ri = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(rv))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ri))


# ----------------------------------------------------------------------------------- seeds, independence


def test_same_seed_same_samples_different_seed_differs():
    row = spaced_logits(V, 3, scale=0.5)  # flat-ish: many plausible tokens
    sp = SP(temperature=1.0)
    a = draw(row, sp, 6, seed0=42).reshape(6, S)
    b = draw(row, sp, 6, seed0=42).reshape(6, S)
    np.testing.assert_array_equal(a, b)
    # Different seeds give different streams (S distinct 6-token sequences).
    assert len({tuple(a[:, i]) for i in range(S)}) == S
    # The same seed in every slot gives the same tokens in every slot.
    params = make_slot_sampling([sp] * S, keys=[seed_key_data(7)] * S)
    logits = jnp.broadcast_to(jnp.asarray(row), (S, V))
    toks = np.asarray(sample_jit(logits, params, None, None, jnp.full((S,), 3, jnp.int32)).tokens)
    assert (toks == toks[0]).all()
    # The n samples of one request share a seed but not a stream.
    assert not np.array_equal(seed_key_data(42, 0), seed_key_data(42, 1))
    np.testing.assert_array_equal(seed_key_data(42, 3), seed_key_data(42, 3))
    assert seed_key_data(None).dtype == np.uint32 and seed_key_data(None).shape == (2,)
    assert not np.array_equal(seed_key_data(2**64 - 1), seed_key_data(-1 + 2**63))


MIXED = [
    SP(temperature=0.0),
    SP(temperature=0.7, top_p=0.9, presence_penalty=1.0),
    SP(temperature=1.3, top_k=500),  # top_k > cap: exact path
    SP(temperature=1.0, top_p=0.999),  # nucleus beyond the cap: exact path
    SP(temperature=0.8, min_p=0.05, repetition_penalty=1.3),
    SP(temperature=1.0, frequency_penalty=-1.5, min_tokens=4),
    SP(temperature=1.2),  # untruncated: full-vocabulary sampler
]


def run_steps(base, sps, keys, slot_of, steps, prompt):
    """Decode ``steps`` tokens for requests placed at ``slot_of[i]`` in a batch of S_HIST slots."""
    full: list[SP | None] = [None] * S_HIST
    full_keys = [seed_key_data(10_000 + j) for j in range(S_HIST)]
    for i, sp in enumerate(sps):
        full[slot_of[i]] = sp
        full_keys[slot_of[i]] = keys[i]
    params = make_slot_sampling(full, keys=full_keys, stop_ids=[[0, 1]] * S_HIST)
    counts = jnp.zeros((S_HIST, V), jnp.int32)
    pmask = prompt_mask_from_tokens(jnp.asarray(prompt), jnp.full((S_HIST,), prompt.shape[1]), V)
    toks = []
    for t in range(steps):
        logits = jnp.broadcast_to(jnp.asarray(base[t]), (S_HIST, V))
        res = sample_hist(logits, params, counts, pmask, jnp.full((S_HIST,), t, jnp.int32))
        counts = update_counts(counts, res.tokens)
        toks.append(np.asarray(res.tokens))
    return np.stack(toks, 1)  # [S_HIST, steps]


def test_slots_are_independent_of_placement_and_neighbours():
    steps = 6
    rng = np.random.default_rng(7)
    base = rng.normal(size=(steps, V)).astype(np.float32) * 2
    prompt = np.tile(rng.integers(0, V, size=(1, 20)), (S_HIST, 1))
    target = SP(temperature=0.9, top_p=0.95, top_k=300, presence_penalty=0.5, repetition_penalty=1.2)
    key = seed_key_data(1234)
    # Alone in slot 0 (others idle) vs in slot 5 among requests taking every other path.
    alone = run_steps(base, [target], [key], [0], steps, prompt)[0]
    crowd_keys = [key] + [seed_key_data(77 + i) for i in range(len(MIXED))]
    crowd = run_steps(base, [target, *MIXED], crowd_keys, [5, 0, 1, 2, 3, 4, 6, 7], steps, prompt)
    np.testing.assert_array_equal(alone, crowd[5])
    # And a neighbour's own stream does not care either: swap two neighbours' slots.
    swapped = run_steps(base, [target, *MIXED], crowd_keys, [5, 0, 1, 2, 3, 4, 7, 6], steps, prompt)
    np.testing.assert_array_equal(crowd[6], swapped[7])
    np.testing.assert_array_equal(crowd[7], swapped[6])


def test_one_slot_params_do_not_change_another_slot():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(S_HIST, V)).astype(np.float32)
    keys = [seed_key_data(i) for i in range(S_HIST)]
    a = make_slot_sampling([SP(temperature=1.0, top_p=0.9)] * S_HIST, keys=keys)
    other = make_slot_sampling([SP(temperature=0.3, top_k=2000, frequency_penalty=2.0)], keys=[keys[2]])
    b = set_slot(a, 2, other)
    counts = rng.integers(0, 3, size=(S_HIST, V))
    pmask = rng.random((S_HIST, V)) < 0.1
    step = jnp.zeros((S_HIST,), jnp.int32)
    ra = np.asarray(sample_hist(logits, a, counts, pmask, step).tokens)
    rb = np.asarray(sample_hist(logits, b, counts, pmask, step).tokens)
    np.testing.assert_array_equal(np.delete(ra, 2), np.delete(rb, 2))


# ---------------------------------------------------------------------------- top_k / top_p / min_p sets

STEPS = 16  # S * STEPS = 1024 draws per case and cap


def _check_support(row, sp, caps=(CAP, CAP_EXACT)):
    allowed = np_allowed(row, sp.temperature, sp.top_k, sp.top_p, sp.min_p)
    toks = None
    for cap in caps:
        toks = draw(row, sp, STEPS, cap=cap)
        bad = toks[~allowed[toks]]
        assert bad.size == 0, f"cap={cap} sampled outside the allowed set: {np.unique(bad)[:10]}"
    return allowed, toks


def test_top_k_never_outside():
    row = spaced_logits(V, 11, scale=0.5)
    for k in (1, 2, 10, 100, 1000):
        allowed, toks = _check_support(row, SP(temperature=1.5, top_k=k))
        assert allowed.sum() == k
        if k <= 10:  # all kept tokens are reachable
            assert set(np.unique(toks)) == set(np.flatnonzero(allowed))


def test_top_p_never_outside():
    row = spaced_logits(V, 12, scale=1.0)
    for n, t in ((1, 1.0), (5, 1.0), (40, 1.2), (150, 2.0)):
        sp = SP(temperature=t, top_p=mid_top_p(row, t, n))
        allowed, _ = _check_support(row, sp)
        assert allowed.sum() == n


def test_min_p_never_outside():
    row = spaced_logits(V, 13, scale=1.0)
    p = np.sort(np_softmax(row / 0.8))[::-1]
    for n in (1, 3, 30, 120):
        sp = SP(temperature=0.8, min_p=float((p[n - 1] + p[n]) / 2 / p[0]))
        allowed, _ = _check_support(row, sp)
        assert allowed.sum() == n


def test_combined_filters_never_outside():
    row = spaced_logits(V, 14, scale=1.0)
    cases = [
        SP(temperature=1.0, top_k=20, top_p=mid_top_p(row, 1.0, 12, top_k=20)),
        SP(temperature=1.0, top_k=200, top_p=mid_top_p(row, 1.0, 90, top_k=200)),  # top_k > cap
        SP(temperature=1.1, top_p=mid_top_p(row, 1.1, 500), min_p=0.02),
        SP(temperature=0.7, top_k=150, min_p=0.3),
    ]
    for sp in cases:
        _check_support(row, sp)
    # The filters on a vocabulary that is not a multiple of the block width.
    odd = spaced_logits(V_ODD, 16, scale=1.0)
    for sp in (SP(top_k=70), SP(top_p=mid_top_p(odd, 1.0, 80)), SP(min_p=0.2)):
        _check_support(odd, sp, caps=(CAP,))


def test_ties_at_the_top_k_boundary_resolve_by_id():
    row = np.full(V, -5.0, np.float32)
    row[[7, 30, 31, 150]] = [4.0, 2.0, 2.0, 2.0]
    for cap in (CAP, CAP_EXACT):
        assert set(np.unique(draw(row, SP(temperature=1.0, top_k=2), 2, cap=cap))) == {7, 30}
        assert set(np.unique(draw(row, SP(temperature=1.0, top_k=3), 2, cap=cap))) == {7, 30, 31}


# ------------------------------------------------------------------------------------------ distributions


def _assert_matches(toks, probs):
    counts = np.bincount(toks, minlength=probs.shape[0])
    stat, df = chi2_stat(counts, probs)
    assert stat < chi2_critical(df), (stat, df)


def test_plain_temperature_matches_softmax():
    row = np.random.default_rng(5).normal(size=V_TINY).astype(np.float32)  # V < cap: candidate path
    for t in (0.6, 1.0, 1.7):
        toks = draw(row, SP(temperature=t), 100)
        _assert_matches(toks, np_softmax(row / t))


def test_full_vocab_sampler_matches_softmax():
    # 48 live tokens spread over the vocab: the two-level (block, token) sampler is what draws.
    rng = np.random.default_rng(6)
    row = np.full(V, -np.inf, np.float32)
    live = rng.choice(V, 48, replace=False)
    row[live] = rng.normal(size=48)
    t = 0.9
    probs = np_softmax(np.where(np.isfinite(row), row / t, -1e30))
    toks = draw(row, SP(temperature=t), 100)
    assert np.isin(toks, live).all()
    _assert_matches(toks, probs)


def test_filtered_distribution_is_renormalized():
    row = spaced_logits(V, 15, scale=0.3)
    sp_k = SP(temperature=1.0, top_k=16)
    sp_p = SP(temperature=1.0, top_p=mid_top_p(row, 1.0, 20))
    for sp, cap in ((sp_k, CAP), (sp_k, CAP_EXACT), (sp_p, CAP), (sp_p, CAP_EXACT)):
        allowed = np_allowed(row, sp.temperature, sp.top_k, sp.top_p, sp.min_p)
        p = np.where(allowed, np_softmax(row / sp.temperature), 0.0)
        toks = draw(row, sp, 60, cap=cap)
        _assert_matches(toks, p / p.sum())


# --------------------------------------------------------------------------------------------- penalties


def test_penalties_match_numpy_reference():
    v, s = 64, 6
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(s, v)).astype(np.float32) * 3
    counts = rng.integers(0, 4, size=(s, v)) * (rng.random((s, v)) < 0.3)
    pmask = rng.random((s, v)) < 0.2
    sps = [
        SP(presence_penalty=1.5),
        SP(frequency_penalty=0.7),
        SP(repetition_penalty=1.8),
        SP(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=0.6),
        SP(),  # neutral: untouched, bit for bit
        SP(repetition_penalty=1.2, frequency_penalty=-2.0),
    ]
    params = make_slot_sampling(sps)
    got = np.asarray(
        smp._apply_penalties(jnp.asarray(logits), params, jnp.asarray(counts, jnp.int32), jnp.asarray(pmask))
    )
    for i, sp in enumerate(sps):
        want = np_penalize(
            logits[i], counts[i], pmask[i], sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
        )
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
        untouched = ~((counts[i] > 0) | pmask[i])
        np.testing.assert_array_equal(got[i][untouched], logits[i][untouched])
    np.testing.assert_array_equal(got[4], logits[4])


def test_penalties_steer_greedy_like_the_reference():
    rng = np.random.default_rng(9)
    for _ in range(3):
        logits = rng.normal(size=(S_HIST, V)).astype(np.float32) * 2
        counts = rng.integers(0, 3, size=(S_HIST, V)) * (rng.random((S_HIST, V)) < 0.2)
        pmask = rng.random((S_HIST, V)) < 0.1
        sps = [
            SP(
                temperature=0.0,
                logprobs=True,
                presence_penalty=float(rng.uniform(-2, 2)),
                frequency_penalty=float(rng.uniform(-2, 2)),
                repetition_penalty=float(rng.uniform(0.5, 2.0)),
            )
            for _ in range(S_HIST)
        ]
        res = sample_hist(logits, make_slot_sampling(sps), counts, pmask, jnp.zeros((S_HIST,), jnp.int32))
        want = [
            np.argmax(
                np_penalize(
                    logits[i],
                    counts[i],
                    pmask[i],
                    sp.presence_penalty,
                    sp.frequency_penalty,
                    sp.repetition_penalty,
                )
            )
            for i, sp in enumerate(sps)
        ]
        np.testing.assert_array_equal(np.asarray(res.tokens), want)
        # Penalties never touch the reported logprobs: those are of the raw model distribution.
        raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
        toks = np.asarray(res.tokens)
        np.testing.assert_allclose(
            np.asarray(res.logprob), raw[np.arange(S_HIST), toks], rtol=1e-5, atol=1e-5
        )


def test_repeated_token_is_avoided_with_strong_penalty():
    logits = np.zeros((S_HIST, V), np.float32)
    logits[:, 3] = 3.0
    logits[:, 4] = 2.5
    counts = np.zeros((S_HIST, V), np.int32)
    counts[:, 3] = 1
    no_prompt = np.zeros((S_HIST, V), bool)
    sps = [
        SP(temperature=0.0, presence_penalty=1.0),
        SP(temperature=0.0, repetition_penalty=1.5),
        SP(temperature=0.0),
    ]
    sps += [SP(temperature=0.0, frequency_penalty=0.6)] * (S_HIST - 3)
    toks = np.asarray(
        sample_hist(logits, make_slot_sampling(sps), counts, no_prompt, jnp.zeros(S_HIST, jnp.int32)).tokens
    )
    assert list(toks[:3]) == [4, 4, 3]
    assert (toks[3:] == 4).all()
    # Repetition penalty also covers prompt tokens that were never generated.
    prompt = no_prompt.copy()
    prompt[:, 3] = True
    sps = [SP(temperature=0.0, repetition_penalty=1.5)] * S_HIST
    toks = np.asarray(
        sample_hist(
            logits, make_slot_sampling(sps), np.zeros_like(counts), prompt, jnp.zeros(S_HIST, jnp.int32)
        ).tokens
    )
    assert (toks == 4).all()
    # The prefill call: a prompt mask and no generated counts yet.
    res = sample_jit(
        jnp.asarray(logits), make_slot_sampling(sps), None, jnp.asarray(prompt), jnp.zeros(S_HIST, jnp.int32)
    )
    assert (np.asarray(res.tokens) == 4).all()


# ----------------------------------------------------------------------------- min_tokens, logprobs, state


def test_min_tokens_suppresses_stop_ids_until_reached():
    row = np.zeros(V, np.float32)
    row[[2, 5]] = [8.0, 7.0]  # EOS (2) and a stop id (5) dominate
    logits = jnp.broadcast_to(jnp.asarray(row), (S, V))
    sps = [SP(temperature=1.0, min_tokens=3)] * (S // 2) + [SP(temperature=0.0, min_tokens=3)] * (S // 2)
    params = make_slot_sampling(sps, keys=[seed_key_data(i) for i in range(S)], stop_ids=[[2, 5]] * S)
    for t in range(5):
        toks = np.asarray(sample_jit(logits, params, None, None, jnp.full((S,), t, jnp.int32)).tokens)
        if t < 3:
            assert not np.isin(toks, [2, 5]).any()
        else:
            assert (toks[S // 2 :] == 2).all()


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(10)
    logits = rng.normal(size=(S_HIST, V)).astype(np.float32) * 3
    lp = dict(logprobs=True, top_logprobs=K_TOP)
    sps = [
        SP(temperature=0.0, **lp),
        SP(temperature=0.5, top_k=3, **lp),
        SP(temperature=1.9, presence_penalty=2.0, **lp),
        SP(top_p=0.5, **lp),
    ]
    sps = sps * (S_HIST // len(sps))
    counts = rng.integers(0, 2, size=(S_HIST, V))
    pmask = np.zeros((S_HIST, V), bool)
    res = sample_hist(logits, make_slot_sampling(sps), counts, pmask, jnp.zeros(S_HIST, jnp.int32))
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    order = np.argsort(-logits, -1, kind="stable")[:, :K_TOP]
    np.testing.assert_array_equal(np.asarray(res.top_ids), order)
    np.testing.assert_allclose(
        np.asarray(res.top_logprobs), np.take_along_axis(ref, order, 1), rtol=1e-5, atol=1e-5
    )
    toks = np.asarray(res.tokens)
    np.testing.assert_allclose(np.asarray(res.logprob), ref[np.arange(S_HIST), toks], rtol=1e-5, atol=1e-5)
    assert res.top_ids.shape == (S_HIST, K_TOP) and res.top_logprobs.shape == (S_HIST, K_TOP)
    res0 = sample_jit(jnp.zeros((S, V)), make_slot_sampling([None] * S), None, None, jnp.zeros(S, jnp.int32))
    assert res0.top_ids.shape == (S, 0) and res0.top_logprobs.shape == (S, 0)
    with pytest.raises(ValueError, match="num_top_logprobs"):
        smp.sample(jnp.asarray(logits), make_slot_sampling(sps), None, None, jnp.zeros(S_HIST, jnp.int32), 21)


def test_update_counts_and_prompt_mask():
    v, s = 10, 3
    counts = jnp.zeros((s, v), jnp.int32)
    counts = update_counts(counts, jnp.array([1, 1, 9]))
    counts = update_counts(counts, jnp.array([1, 2, 9]), valid=jnp.array([True, True, False]))
    want = np.zeros((s, v), np.int32)
    want[0, 1] = 2
    want[1, 1] = want[1, 2] = 1
    want[2, 9] = 1
    np.testing.assert_array_equal(np.asarray(counts), want)

    toks = jnp.array([[3, 3, 7, 0, 0], [9, 1, 2, 5, 5]])
    m = np.asarray(prompt_mask_from_tokens(toks, jnp.array([3, 5]), v))
    assert set(np.flatnonzero(m[0])) == {3, 7}  # padding (id 0) beyond length ignored
    assert set(np.flatnonzero(m[1])) == {1, 2, 5, 9}
    m1 = np.asarray(prompt_mask_from_tokens(jnp.array([4, 4, 6, 0]), 3, v))
    assert m1.shape == (v,) and set(np.flatnonzero(m1)) == {4, 6}


def test_update_counts_in_place_when_donated():
    step = jax.jit(update_counts, donate_argnums=0)
    counts = jnp.zeros((4, 64), jnp.int32)
    new = step(counts, jnp.array([0, 1, 2, 3]))
    assert counts.is_deleted()  # the buffer was donated, not copied
    assert int(new.sum()) == 4


def test_make_and_set_slot():
    sp = SP(
        temperature=0.5,
        top_p=0.8,
        top_k=7,
        min_p=0.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        min_tokens=2,
        seed=5,
    )
    ss = make_slot_sampling([None, sp], stop_ids=[[], [2, 3]], max_stop_ids=4)
    assert isinstance(ss, SlotSampling) and ss.stop_ids.shape == (2, 4)
    assert float(ss.temperature[0]) == 0.0 < GREEDY_EPS  # idle slots take the greedy path
    assert float(ss.top_p[1]) == pytest.approx(0.8) and int(ss.top_k[1]) == 7
    assert float(ss.repetition_penalty[1]) == pytest.approx(1.1) and int(ss.min_tokens[1]) == 2
    assert list(np.asarray(ss.stop_ids[1])) == [2, 3, -1, -1]
    np.testing.assert_array_equal(np.asarray(ss.key[1]), seed_key_data(5))
    moved = jax.jit(set_slot)(ss, 0, make_slot_sampling([sp], stop_ids=[[2, 3]], max_stop_ids=4))
    for a in moved:
        np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(a[1]))
    with pytest.raises(ValueError, match="stop_ids"):
        make_slot_sampling([sp], stop_ids=[list(range(9))])
