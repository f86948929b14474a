"""Structured output, engine side: the packed token mask in the on-device sampler (honoured under temperature,
top-k and penalties; all-ones rows change nothing; logprobs of the masked distribution), and the grammar
compiler / matcher on a tiny trained tokenizer (cache, errors naming the field, EOS only when accepting)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import tiny_tokenizer

from vsurge.contracts.sampling_params import SamplingParams as SP
from vsurge.engines.sampling import make_slot_sampling, sample_jit, unpack_token_mask
from vsurge.structured import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    allocate_bitmask,
    bitmask_words,
    is_allowed,
)

V = 1000


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool[S, V] -> packed int32[S, ceil(V/32)] (numpy reference of the layout)."""
    s, v = allowed.shape
    padded = np.zeros((s, bitmask_words(v) * 32), bool)
    padded[:, :v] = allowed
    bits = padded.reshape(s, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return bits.sum(-1).astype(np.uint32).view(np.int32)


def test_unpack_matches_layout():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, V)) < 0.3
    np.testing.assert_array_equal(np.asarray(unpack_token_mask(jnp.asarray(pack(allowed)), V)), allowed)
    row = pack(allowed)[1]
    assert all(is_allowed(row, t) == allowed[1, t] for t in range(V))


def test_mask_is_honoured_under_sampling_and_ones_rows_change_nothing():
    rng = np.random.default_rng(1)
    s = 8
    logits = jnp.asarray(rng.normal(size=(s, V)).astype(np.float32) * 3)
    params = [
        SP(temperature=1.0, seed=i, top_k=(0, 5, 0, 50)[i % 4], top_p=(1.0, 1.0, 0.9, 1.0)[i % 4])
        for i in range(s)
    ]
    params[3] = SP(temperature=0.0)
    params[5] = SP(temperature=1.3, seed=5, repetition_penalty=1.5, frequency_penalty=0.5)
    # logprobs are computed only when asked for: ask, to check them below
    params = [dataclasses.replace(p, logprobs=True, top_logprobs=3) for p in params]
    sampling = make_slot_sampling(params)
    counts = jnp.asarray(rng.integers(0, 3, size=(s, V)).astype(np.int32))
    prompt = jnp.zeros((s, V), bool)
    constrained = np.arange(s) % 2 == 1
    allowed = np.ones((s, V), bool)
    allowed[constrained] = rng.random((int(constrained.sum()), V)) < 0.05
    mask = jnp.asarray(pack(allowed))
    base = None
    for step in range(20):
        st = jnp.full((s,), step, jnp.int32)
        out = sample_jit(logits, sampling, counts, prompt, st, 3, token_mask=mask)
        ref = sample_jit(logits, sampling, counts, prompt, st, 3)
        toks = np.asarray(out.tokens)
        assert all(allowed[i, toks[i]] for i in range(s)), "a masked-out token was sampled"
        # unconstrained rows: the same tokens and logprobs, bit for bit, as a call without a mask
        free = ~constrained
        np.testing.assert_array_equal(toks[free], np.asarray(ref.tokens)[free])
        np.testing.assert_array_equal(np.asarray(out.logprob)[free], np.asarray(ref.logprob)[free])
        base = out
    # logprobs of the masked distribution: softmax over the allowed tokens only
    i = 1
    lg = np.asarray(logits[i], np.float64)
    masked = np.where(allowed[i], lg, -np.inf)
    lse = np.log(np.exp(masked - masked.max()).sum()) + masked.max()
    assert np.isclose(float(base.logprob[i]), masked[int(base.tokens[i])] - lse, atol=1e-4)
    assert all(allowed[i, t] for t in np.asarray(base.top_ids[i]))


@pytest.fixture(scope="module")
def compiler():
    tok = tiny_tokenizer()
    c = GrammarCompiler(tok, len(tok) + 6, [tok.eos_token_id], timeout_s=20)
    yield tok, c
    c.close()


def run(tok, compiled, text: str, eos: int) -> tuple[list[bool], bool]:
    """Walk the tokens of ``text``: per step whether the mask allowed it; then whether EOS was allowed."""
    m = compiled.matcher()
    row = allocate_bitmask(1, tok.vocab_size + 6)[0]
    ok = []
    for t in tok.encode(text, add_special_tokens=False):
        m.fill(row)
        ok.append(is_allowed(row, t))
        if not m.accept(t):
            break
    m.fill(row)
    return ok, is_allowed(row, eos)


def test_json_schema_mask_allows_valid_and_blocks_invalid(compiler):
    tok, c = compiler
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = c.compile(GrammarSpec.json_schema(schema))
    eos = tok.eos_token_id
    ok, eos_ok = run(tok, g, json.dumps({"a": 12}), eos)
    assert all(ok) and eos_ok
    ok, eos_ok = run(tok, g, '{"a": 1', eos)  # incomplete: EOS not allowed yet
    assert all(ok) and not eos_ok
    ok, _ = run(tok, g, '{"a": "x"}', eos)
    assert not all(ok)
    # the same schema (as written) is one cache entry
    assert c.compile(GrammarSpec.json_schema(json.loads(json.dumps(schema)))) is g
    # padded ids past the tokenizer are never allowed
    row = allocate_bitmask(1, len(tok) + 6)[0]
    g.matcher().fill(row)
    assert not any(is_allowed(row, t) for t in range(len(tok), len(tok) + 6))


def test_regex_choice_and_grammar(compiler):
    tok, c = compiler
    eos = tok.eos_token_id
    g = c.compile(GrammarSpec.regex(r"[0-9]{3}-[a-z]+"))
    assert all(run(tok, g, "123-abc", eos)[0]) and run(tok, g, "123-abc", eos)[1]
    assert not all(run(tok, g, "12a", eos)[0])
    g = c.compile(GrammarSpec.choice(["yes", "no", 'say "hi"']))
    for text in ("yes", "no", 'say "hi"'):
        ok, eos_ok = run(tok, g, text, eos)
        assert all(ok) and eos_ok, text
    assert not all(run(tok, g, "maybe", eos)[0])
    gbnf = c.compile(GrammarSpec.grammar('root ::= "ab" [0-9]+'))
    assert all(run(tok, gbnf, "ab42", eos)[0])
    lark = c.compile(GrammarSpec.grammar('start: "x" NUM\nNUM: /[0-9]+/'))
    assert all(run(tok, lark, "x7", eos)[0])


def test_json_schema_keeps_the_property_order(compiler):
    """Properties come out in the schema's order, never sorted: required scalars listed before an unbounded
    array are written before it (sorted, "landmarks" < "name" < "population_millions" would put the array
    first and a length cut would leave the scalars out)."""
    tok, c = compiler
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "population_millions": {"type": "integer"},
            "landmarks": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "population_millions", "landmarks"],
    }
    spec = GrammarSpec.json_schema(schema)
    assert list(json.loads(spec.source)["properties"]) == ["name", "population_millions", "landmarks"]
    g = c.compile(spec)
    eos = tok.eos_token_id
    ok, eos_ok = run(tok, g, '{"name": "Rome", "population_millions": 3, "landmarks": ["Colosseum"]}', eos)
    assert all(ok) and eos_ok
    # the sorted order is not a valid output of this schema
    ok, _ = run(tok, g, '{"landmarks": [], "name": "Rome", "population_millions": 3}', eos)
    assert not all(ok)
    # another property order is another grammar (and cache entry), which accepts that order
    reordered = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
    g2 = c.compile(GrammarSpec.json_schema(reordered))
    assert g2 is not g
    assert all(run(tok, g2, '{"landmarks": [], "population_millions": 3, "name": "Rome"}', eos)[0])


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (lambda: GrammarSpec.json_schema({"type": "foo"}, "response_format"), "foo"),
        (lambda: GrammarSpec.json_schema({"not": {"type": "string"}}, "response_format"), "not"),
        (lambda: GrammarSpec.json_schema({"type": "string", "pattern": "(("}, "response_format"), "regex"),
        (lambda: GrammarSpec.regex("a{3,2}"), "repetition"),
        (lambda: GrammarSpec.grammar("start: missing_rule"), "missing_rule"),
    ],
)
def test_bad_grammars_name_the_field(compiler, spec, needle):
    _, c = compiler
    sp = spec()
    with pytest.raises(GrammarError) as e:
        asyncio.run(c.compile_async(sp))
    assert e.value.param == sp.param
    assert re.search(needle, str(e.value)), str(e.value)


def test_compile_timeout_is_a_grammar_error(compiler):
    tok, _ = compiler
    slow = GrammarCompiler(tok, len(tok), [tok.eos_token_id], timeout_s=0.0)
    try:
        with pytest.raises(GrammarError, match="longer than"):
            asyncio.run(slow.compile_async(GrammarSpec.json_object()))
    finally:
        slow.close()
