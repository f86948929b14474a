"""Chunked prefill (engines/chunked_prefill.py): prompts longer than every prefill bucket, and prompt
logprobs, checked against the reference greedy loop and against transformers' own logits."""

import numpy as np
import pytest
import torch

import vsurge
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.engines.sampling import sample_jit
from vsurge.models import greedy_generate
from vsurge.seed_api.engines import vEngine

MAX_LEN = 160
BUCKETS = [16, 32]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, torch_model = tiny_checkpoint("llama", heads=8, kv_heads=4)
    model, tok = vsurge.load_model(path)
    return model, tok, torch_model


@pytest.fixture(scope="module")
def engine(tiny):
    model, tok, _ = tiny
    return vEngine(model, tok, max_concurrent_decodes=2, prefill_lengths=BUCKETS, max_length=MAX_LEN)


def _greedy_from(engine, prefix, steps):
    state = engine.init_decode_state()
    state, first = engine.insert(prefix, state, 0)
    out = [int(np.asarray(first.tokens)[0])]
    for _ in range(steps - 1):
        state, res = engine.decode(state)
        out.append(int(np.asarray(res.tokens)[0]))
    engine.free_resource(0)
    return out


@pytest.mark.parametrize("length", [33, 64, 100, MAX_LEN - 12])
def test_prompt_longer_than_every_bucket_decodes_like_the_reference(tiny, engine, length):
    model, _, _ = tiny
    rng = np.random.RandomState(length)
    prompt = [int(t) for t in rng.randint(3, 300, size=length)]
    greedy = SamplingParams(temperature=0.0)
    assert engine.needs_chunks(prompt, greedy)
    prefix, lps = engine.prefill_chunked(prompt, greedy)
    assert lps is None
    assert _greedy_from(engine, prefix, 10) == greedy_generate(model, [prompt], 10)[0]


def test_whole_context_is_accepted_and_only_the_context(engine):
    assert engine.max_prompt_length == MAX_LEN - 1
    assert engine.check_prompt([5] * (MAX_LEN - 1)) == MAX_LEN - 1
    with pytest.raises(ValueError, match="no room"):
        engine.check_prompt([5] * MAX_LEN)


@pytest.mark.parametrize("length", [9, 32, 75])
def test_prompt_logprobs_equal_transformers(tiny, engine, length):
    _, _, torch_model = tiny
    rng = np.random.RandomState(100 + length)
    prompt = [int(t) for t in rng.randint(3, 300, size=length)]
    k = 5
    _, lps = engine.prefill_chunked(prompt, SamplingParams(temperature=0.0, prompt_logprobs=k))
    with torch.no_grad():
        logits = torch_model(torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1).numpy()
    assert len(lps) == length and lps[0] is None
    for p in range(1, length):
        e = lps[p]
        assert e.token_id == prompt[p]
        assert e.rank == 1 + int(np.sum(want[p - 1] > want[p - 1, prompt[p]]))
        np.testing.assert_allclose(e.logprob, want[p - 1, prompt[p]], atol=2e-4)
        top_ids = [t for t, _ in e.top]
        assert len(top_ids) == k
        np.testing.assert_allclose([v for _, v in e.top], np.sort(want[p - 1])[::-1][:k], atol=2e-4)
        assert set(top_ids) == set(np.argsort(-want[p - 1], kind="stable")[:k].tolist())


def test_logit_bias_and_allowed_ids_on_device():
    # One sparse row per slot; slots without either keep their exact tokens.
    import jax.numpy as jnp

    from vsurge.engines.sampling import make_slot_sampling

    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.randn(4, 50).astype(np.float32))
    plain = SamplingParams(temperature=0.0)
    banned_top = int(np.argmax(np.asarray(logits[1])))
    params = [
        plain,
        SamplingParams(temperature=0.0, logit_bias={banned_top: -100}),
        SamplingParams(temperature=0.0, logit_bias={7: 100}, logprobs=True),
        SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[3, 11, 42]),
    ]
    rows = make_slot_sampling(params)
    out = sample_jit(logits, rows, None, None, jnp.zeros(4, jnp.int32))
    toks = np.asarray(out.tokens)
    assert toks[0] == int(np.argmax(np.asarray(logits[0])))
    assert toks[1] != banned_top
    assert toks[1] == int(np.argsort(-np.asarray(logits[1]))[1])
    assert toks[2] == 7
    assert toks[3] in (3, 11, 42)
    # logprobs stay those of the raw model
    np.testing.assert_allclose(
        np.asarray(out.logprob)[2], np.asarray(logits[2] - jnp.log(jnp.sum(jnp.exp(logits[2]))))[7], atol=1e-5
    )
    # many draws: allowed ids only, and all of them reachable
    seen = set()
    for step in range(60):
        o = sample_jit(logits, rows, None, None, jnp.full(4, step, jnp.int32))
        seen.add(int(np.asarray(o.tokens)[3]))
    assert seen <= {3, 11, 42} and len(seen) >= 2
