"""The sampler's two implementations (``impl="cpu"``, XLA:CPU-tuned; ``impl="tpu"``, vectorized for
accelerators) agree token for token on CPU, for every path; its pieces agree with their references; logprobs
cost nothing when no slot asks for them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vsurge.contracts.sampling_params import SamplingParams as SP
from vsurge.engines import sampling as smp
from vsurge.engines.sampling import (
    SampleResult,
    make_slot_sampling,
    ops,
    prompt_mask_from_tokens,
    sample,
    sample_jit,
    seed_key_data,
    update_counts,
)
from vsurge.engines.sampling import filters as filt
from vsurge.engines.sampling import penalties as pens

S = 16
V = 4096
K_TOP = 4


def tied_logits(rng: np.random.Generator, s: int, v: int) -> np.ndarray:
    """Logits with many exact ties (values on a 0.25 grid), and a few rows of one repeated value."""
    x = (rng.integers(-24, 8, size=(s, v)) * 0.25).astype(np.float32)
    x[0] = 1.0
    x[1, [5, 700, 3001]] = 9.0
    return x


def smooth_logits(rng: np.random.Generator, s: int, v: int, scale: float) -> np.ndarray:
    return (rng.normal(size=(s, v)) * scale).astype(np.float32)


# ------------------------------------------------------------------------------------------------ pieces


@pytest.mark.parametrize(("v", "k"), [(4096, 3), (4096, 20), (16384, 64), (16387, 8), (1000, 5), (128, 4)])
def test_tpu_top_k_is_lax_top_k_with_ties(v, k):
    rng = np.random.default_rng(v + k)
    x = rng.integers(-30, 30, size=(3, v)).astype(np.float32)  # many ties
    x[1, -3:] = 100.0  # the best values in the last (padded) block
    x[2, :] = -np.inf
    x[2, [0, v - 1]] = 1.0
    vals, ids = jax.jit(ops._top_k_tpu, static_argnums=1)(jnp.asarray(x), k)
    rv, ri = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(rv))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ri))
    got = np.asarray(jax.jit(ops.argmax_exact, static_argnums=1)(jnp.asarray(x), "tpu"))
    np.testing.assert_array_equal(got, np.argmax(x, -1))


def test_first_ties_rows_matches_the_cumsum_cut():
    rng = np.random.default_rng(0)
    eq = rng.random((6, 1000)) < 0.2
    eq[5] = False
    j = np.array([0, 1, 7, int(eq[3].sum()), int(eq[4].sum()) + 5, 3], np.int32)
    got = np.asarray(jax.jit(ops._first_ties_rows)(jnp.asarray(eq), jnp.asarray(j)))
    want = eq & (np.cumsum(eq, -1) <= j[:, None])
    np.testing.assert_array_equal(got, want)


def test_vectorized_exact_masks_equal_the_per_row_ones():
    rng = np.random.default_rng(1)
    pen = np.concatenate([tied_logits(rng, 4, V), smooth_logits(rng, 4, V, 1.5)])
    s = pen.shape[0]
    inv_t = (1.0 / rng.uniform(0.5, 1.5, size=s)).astype(np.float32)[:, None]
    k_eff = np.array([V, 100, 1000, 7, V, 300, V, 2], np.int32)
    top_p = np.array([0.9, 1.0, 0.95, 0.5, 0.999, 0.8, 1.0, 0.7], np.float32)
    min_p = np.array([0.0, 0.0, 0.01, 0.0, 0.001, 0.0, 0.2, 0.0], np.float32)
    use = np.array([True, True, True, True, True, False, True, True])
    lmax = pen.max(-1, keepdims=True)
    base = np.zeros((s, V), bool)
    args = [jnp.asarray(a) for a in (pen, lmax, inv_t, k_eff, top_p, min_p, use, base)]
    cpu = np.asarray(jax.jit(filt.exact_rows_cpu)(*args))
    vec = np.asarray(jax.jit(filt.exact_rows_vectorized)(*args))
    np.testing.assert_array_equal(vec, cpu)
    assert not vec[5].any() and vec[1].sum() == 100 and 1 <= vec[3].sum() <= 7  # untouched row, top_k


def test_bias_row_cut_to_its_used_width_changes_nothing():
    rng = np.random.default_rng(2)
    v = 2048
    logits = jnp.asarray(smooth_logits(rng, 4, v, 1.0))
    restrict = jnp.asarray([False, True, False, False])
    for used in (3, 8, 9, 60, 200, 1024):
        ids = np.full((4, 1024), -1, np.int32)
        vals = np.zeros((4, 1024), np.float32)
        ids[1, :used] = rng.choice(v, size=used, replace=False)
        vals[1, :used] = rng.normal(size=used)
        ids[2, used - 1] = 17  # a gap before the last used column
        vals[2, used - 1] = 50.0
        params = make_slot_sampling([None] * 4)._replace(
            bias_ids=jnp.asarray(ids), bias_vals=jnp.asarray(vals), restrict=restrict
        )
        got = jax.jit(pens._apply_bias)(logits, params)
        want = pens._apply_bias_cols(logits, jnp.asarray(ids), jnp.asarray(vals), restrict)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.isneginf(np.asarray(got)[1]).sum() == v - used


# ------------------------------------------------------------------------------------- the whole step

CASES = [
    SP(temperature=0.0),
    SP(temperature=0.8),
    SP(temperature=1.0, top_k=5),
    SP(temperature=1.0, top_k=50),
    SP(temperature=1.2, top_k=700),  # beyond the cap: exact top_k
    SP(temperature=0.8, top_p=0.9),
    SP(temperature=1.0, top_p=0.999),  # nucleus beyond the cap: exact top_p
    SP(temperature=1.0, top_k=300, top_p=0.95),
    SP(temperature=0.9, min_p=0.05),
    SP(temperature=1.0, top_p=0.97, min_p=0.01),
    SP(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5),
    SP(temperature=0.0, frequency_penalty=1.0),
    SP(temperature=1.0, logit_bias={3: 5.0, 9: -100.0}),
    SP(temperature=1.0, allowed_token_ids=[4, 8, 15, 16, 23, 42]),
    SP(temperature=1.0, min_tokens=3, top_p=0.8),
    SP(temperature=1e-6, top_k=3),  # greedy despite the filters
]


def run_both(logits, sps, steps, cap=smp.DEFAULT_CANDIDATE_CAP, mask=None):
    """Decode ``steps`` steps of the same requests with both implementations; returns their results."""
    s, v = logits.shape[-2:]
    params = make_slot_sampling(sps, keys=[seed_key_data(100 + i) for i in range(s)], stop_ids=[[0, 1]] * s)
    prompt = prompt_mask_from_tokens(jnp.asarray(np.arange(s * 5).reshape(s, 5) % v), jnp.full((s,), 5), v)
    out: dict[str, list[SampleResult]] = {"cpu": [], "tpu": []}
    for impl in out:
        counts = jnp.zeros((s, v), jnp.int32)
        for t in range(steps):
            res = sample_jit(
                jnp.asarray(logits[t % len(logits)]) if logits.ndim == 3 else jnp.asarray(logits),
                params,
                counts,
                prompt,
                jnp.full((s,), t, jnp.int32),
                K_TOP,
                candidate_cap=cap,
                token_mask=mask,
                impl=impl,
            )
            counts = update_counts(counts, res.tokens)
            out[impl].append(res)
    return out


def assert_same(out):
    for a, b in zip(out["cpu"], out["tpu"], strict=True):
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        for x, y in zip(a[1:], b[1:], strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["smooth", "flat", "tied"])
def test_both_implementations_sample_the_same_tokens(kind):
    rng = np.random.default_rng({"smooth": 3, "flat": 4, "tied": 5}[kind])
    steps = 4
    if kind == "tied":
        logits = np.stack([tied_logits(rng, S, V) for _ in range(steps)])
    else:
        logits = np.stack([smooth_logits(rng, S, V, 3.0 if kind == "smooth" else 0.7) for _ in range(steps)])
    sps = [
        dataclasses.replace(sp, logprobs=i % 3 == 0, top_logprobs=K_TOP if i % 6 == 0 else 0)
        for i, sp in enumerate(CASES)
    ]
    out = run_both(logits, sps, steps)
    assert_same(out)
    toks = np.stack([np.asarray(r.tokens) for r in out["cpu"]])
    assert len(np.unique(toks[:, 1])) > 1 or kind == "tied"  # sampling slots do sample


def test_both_implementations_agree_on_the_exact_path_and_under_a_token_mask():
    rng = np.random.default_rng(6)
    logits = smooth_logits(rng, S, V, 2.0)
    # cap 2: nearly every filtered slot takes the exact (bisection) path
    assert_same(run_both(logits, CASES, 3, cap=2))
    allowed = rng.random((S, V)) < 0.3
    allowed[::2] = True
    words = (allowed.reshape(S, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    mask = jnp.asarray(words.astype(np.uint32).view(np.int32))
    np.testing.assert_array_equal(np.asarray(smp.unpack_token_mask(mask, V)), allowed)
    out = run_both(logits, CASES, 2, mask=mask)
    assert_same(out)
    toks = np.asarray(out["tpu"][-1].tokens)
    assert all(allowed[i, t] for i, t in enumerate(toks))


# ------------------------------------------------------------------------------------------- logprobs


def _eqns(jaxpr, inside=False):
    """(primitive name, params, inside a cond branch) of every equation, recursively."""
    for e in jaxpr.eqns:
        yield e.primitive.name, e.params, inside
        for p in e.params.values():
            subs = p if isinstance(p, tuple | list) else [p]
            for sub in subs:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    yield from _eqns(inner, inside or e.primitive.name == "cond")
                elif hasattr(sub, "eqns"):
                    yield from _eqns(sub, inside or e.primitive.name == "cond")


@pytest.mark.parametrize("impl", ["cpu", "tpu"])
def test_top_logprobs_work_sits_only_behind_a_cond(impl):
    params = make_slot_sampling([SP(temperature=0.0)] * 4)
    logits = jnp.zeros((4, V))
    step = jnp.zeros((4,), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda x, p: sample(x, p, None, None, step, 20, impl=impl))(logits, params)
    topk = [(p["k"], inside) for name, p, inside in _eqns(jaxpr.jaxpr) if name == "top_k"]
    # the top 20 (and, on the TPU path, every top-k) exists only inside a branch
    assert any(k == 20 and inside for k, inside in topk)
    assert all(inside for k, inside in topk if k == 20 or impl == "tpu"), topk
    exps = [inside for name, _, inside in _eqns(jaxpr.jaxpr) if name in ("exp", "log")]
    assert exps and all(exps)  # logsumexp too (and the sampling path's exp)


def test_logprobs_only_when_asked_and_then_for_every_row():
    rng = np.random.default_rng(7)
    logits = jnp.asarray(smooth_logits(rng, S, V, 2.0))
    # the call signature of run_both, so the programs compiled there are reused
    hist = (jnp.zeros((S, V), jnp.int32), jnp.zeros((S, V), bool), jnp.zeros((S,), jnp.int32), K_TOP)
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    order = np.argsort(-np.asarray(logits), -1, kind="stable")[:, :K_TOP]
    plain = [SP(temperature=0.0), SP(temperature=1.0, seed=1), None, SP(top_k=5, seed=2)] * (S // 4)
    for impl in ("cpu", "tpu"):
        none = sample_jit(logits, make_slot_sampling(plain), *hist, impl=impl)
        assert not np.asarray(none.logprob).any() and not np.asarray(none.top_logprobs).any()
        assert none.top_ids.shape == (S, K_TOP)
        chosen = list(plain)
        chosen[1] = SP(temperature=1.0, seed=1, logprobs=True)  # its own logprob, no top
        res = sample_jit(logits, make_slot_sampling(chosen), *hist, impl=impl)
        np.testing.assert_array_equal(np.asarray(res.tokens), np.asarray(none.tokens))
        toks = np.asarray(res.tokens)
        np.testing.assert_allclose(np.asarray(res.logprob), ref[np.arange(S), toks], rtol=1e-5, atol=1e-5)
        assert not np.asarray(res.top_logprobs).any()
        top = list(plain)
        top[3] = SP(top_k=5, seed=2, logprobs=True, top_logprobs=2)
        res = sample_jit(logits, make_slot_sampling(top), *hist, impl=impl)
        np.testing.assert_array_equal(np.asarray(res.top_ids), order)
        np.testing.assert_allclose(
            np.asarray(res.top_logprobs), np.take_along_axis(ref, order, 1), rtol=1e-5, atol=1e-5
        )
    # a SlotSampling without the field (built by hand) computes them, as before the field existed
    legacy = make_slot_sampling(plain)._replace(num_logprobs=None)
    res = sample_jit(logits, legacy, *hist, impl="tpu")
    np.testing.assert_array_equal(np.asarray(res.top_ids), order)


def test_slot_num_logprobs_and_impl_choice(monkeypatch):
    assert smp.slot_num_logprobs(None) == smp.NO_LOGPROBS
    assert smp.slot_num_logprobs(SP()) == -1
    assert smp.slot_num_logprobs(SP(logprobs=True)) == 0
    assert smp.slot_num_logprobs(SP(logprobs=True, top_logprobs=5)) == 5
    rows = make_slot_sampling([None, SP(logprobs=True, top_logprobs=3)])
    assert np.asarray(rows.num_logprobs).tolist() == [-1, 3]
    assert smp.sampler_impl() == "cpu"  # the tests run on XLA:CPU
    assert smp.sampler_impl("tpu") == "tpu"
    monkeypatch.setenv(smp.SAMPLER_IMPL_ENV, "tpu")
    assert smp.sampler_impl() == "tpu"
    monkeypatch.setenv(smp.SAMPLER_IMPL_ENV, "gpu")
    with pytest.raises(ValueError, match="sampler implementation"):
        smp.sampler_impl()
