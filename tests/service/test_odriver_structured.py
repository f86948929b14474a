"""Structured output on oDriver (paged KV, mixed steps), on the tiny random model and its tiny tokenizer.

A constrained request waits for the masked programs while a free one goes on; constrained and free rows
share steps (the free rows' greedy tokens are the reference's, the constrained outputs match their
grammars); a grammar that completes early ends the request with "stop"; constrained sequences preempted
mid-answer are recomputed and continue where they were (a matcher replays what its sequence produced);
nothing compiles on a live request once the structured programs are warm. The server tests
(tests/server/test_server_structured.py) run the API forms on both drivers.
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
from test_odriver import SMALL, ids_request, reference, tokens_of

import vsurge
from vsurge import vSurge
from vsurge.engines.paged.paging import bytes_per_page
from vsurge.structured import GrammarCompiler, GrammarSpec

REGEX = r"[0-9]{3}-[a-z]{2,5}( ok)?"


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return vsurge.load_model(path)


@pytest.fixture(scope="module")
def surge(tiny):
    """4 slots over 20 pages of 8 tokens: three sequences of ~100 tokens do not fit (preemption)."""
    model, tok = tiny
    per_page = bytes_per_page(model.config, 8, model.dtype)
    s = vSurge.create_odriver(
        model, tok, page_size=8, kv_cache_bytes=21 * per_page, max_concurrent_decodes=4, **SMALL
    )
    s.compile()
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def grammars(tiny, surge):
    _, tok = tiny
    compiler = GrammarCompiler(
        tok, surge.driver.engine.model_config.vocab_size, surge.driver.engine.eos_token_ids
    )
    yield compiler.compile
    compiler.close()


@pytest.fixture(autouse=True)
def nothing_left(surge):
    """After every test: no slot, page or matcher in use."""
    yield
    deadline = time.time() + 5
    while surge.driver.num_used_slots and time.time() < deadline:
        time.sleep(0.01)
    m = surge.driver.engine.manager
    assert surge.driver.num_used_slots == 0 and m.num_free == m.num_pages
    m.check()


def constrained(prompt, max_tokens, grammar, **kw):
    """A request under a compiled grammar (SamplingParams.grammar, as the server attaches it)."""
    kw.setdefault("temperature", 1.0)
    return ids_request(prompt, max_tokens, ignore_eos=False, grammar=grammar, **kw)


def text_of(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def test_constrained_requests_wait_for_the_masked_programs_and_free_ones_go_on(surge, tiny, grammars):
    model, tok = tiny
    engine = surge.driver.engine
    assert surge.supports_structured_output and not engine.structured_ready.is_set()
    free_prompt = [5, 17, 42, 99, 7]
    mine = surge.submit(constrained([9, 8, 7], 30, grammars(GrammarSpec.regex(REGEX)), seed=1))
    free = surge.submit(ids_request(free_prompt, 12))
    assert tokens_of(free) == reference(model, [free_prompt], [12])[0]
    text = text_of(tok, tokens_of(mine))
    assert re.fullmatch(REGEX, text), text
    assert mine.samples[0].finish_reason == "stop" and engine.structured_ready.is_set()


def test_constrained_and_free_rows_share_steps(surge, tiny, grammars):
    """Two seeded constrained samples (n=2), a JSON answer and free greedy requests, one of them a
    prompt longer than a prefill bucket (its final chunk and the constrained rows in one step)."""
    model, tok = tiny
    surge.warm_structured()
    rng = np.random.RandomState(4)
    free_prompts = [list(rng.randint(3, 300, size=n)) for n in (6, 45)]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
        "required": ["ok", "kind"],
        "additionalProperties": False,
    }
    regex = surge.submit(constrained([3, 4, 5], 40, grammars(GrammarSpec.regex(REGEX)), seed=3, n=2))
    obj = surge.submit(constrained([6, 7], 40, grammars(GrammarSpec.json_schema(schema)), seed=4))
    free = [surge.submit(ids_request(p, 20)) for p in free_prompts]
    assert [tokens_of(r) for r in free] == reference(model, free_prompts, [20, 20])
    by_index: dict[int, list[int]] = {}
    for items in regex.channel:
        for s in items:
            by_index.setdefault(s.index, []).extend(s.token_ids)
    for ids in by_index.values():
        assert re.fullmatch(REGEX, text_of(tok, ids))
    assert all(s.finish_reason == "stop" for s in regex.samples)
    answer = json.loads(text_of(tok, tokens_of(obj)))
    assert isinstance(answer["ok"], bool) and answer["kind"] in ("a", "b") and len(answer) == 2
    assert obj.samples[0].finish_reason == "stop"


def test_a_grammar_that_completes_early_ends_with_stop(surge, tiny, grammars):
    _, tok = tiny
    surge.warm_structured()
    options = ["yes", "no", "maybe later"]
    for seed in range(3):
        r = surge.submit(constrained([11, 12], 100, grammars(GrammarSpec.choice(options)), seed=seed))
        ids = tokens_of(r)
        assert text_of(tok, ids) in options
        assert r.samples[0].finish_reason == "stop" and len(ids) < 100


def test_preempted_constrained_sequences_continue_their_answers(surge, tiny, grammars, monkeypatch):
    """Four seeded constrained answers of 60-90 tokens in 20 pages: the youngest decoding ones are
    preempted and recomputed; each answer is the one it gives alone."""
    _, tok = tiny
    surge.warm_structured()
    slots = surge.driver._steps.grammars.slots
    replayed, start = [], slots.start

    def recording_start(slot, grammar, accepted=()):
        replayed.append(len(accepted))
        return start(slot, grammar, accepted)

    monkeypatch.setattr(slots, "start", recording_start)
    # longer than 90 tokens can spell: EOS is never allowed, every answer runs to max_tokens
    words = grammars(GrammarSpec.regex(r"[a-z ]{700,800}"))
    asks = [
        (list(range(40, 40 + n)), m, seed)
        for n, m, seed in ((8, 90, 1), (10, 80, 2), (12, 90, 3), (9, 60, 7))
    ]
    alone = [tokens_of(surge.submit(constrained(p, m, words, seed=seed))) for p, m, seed in asks]
    assert [len(a) for a in alone] == [m for _, m, _ in asks]
    assert all(re.fullmatch(r"[a-z ]+", text_of(tok, a)) for a in alone)
    before, replayed[:] = surge.metrics().preemptions_total, []
    together = [surge.submit(constrained(p, m, words, seed=seed)) for p, m, seed in asks]
    assert [tokens_of(r) for r in together] == alone
    assert surge.metrics().preemptions_total > before
    assert max(replayed) > 0  # a recompute's matcher took the tokens produced before the preemption


def test_no_compilation_on_live_structured_requests(surge, grammars):
    from jit_watch import compilations

    surge.warm_structured()
    rng = np.random.RandomState(6)
    regex = grammars(GrammarSpec.regex(REGEX))
    with compilations() as compiled:
        # alone (a prefill-only step seats it under its mask), then beside free rows and chunked prompts
        tokens_of(surge.submit(constrained([1, 2, 3], 20, regex, seed=1)))
        reqs = [
            surge.submit(constrained(list(rng.randint(3, 300, size=40)), 20, regex, seed=2, n=2)),
            surge.submit(ids_request(list(rng.randint(3, 300, size=9)), 20, temperature=0.7, seed=5)),
            surge.submit(constrained([4, 5], 20, regex, seed=3, logprobs=True, top_logprobs=2)),
            surge.submit(ids_request(list(rng.randint(3, 300, size=70)), 8)),
        ]
        for r in reqs:
            assert tokens_of(r)
    assert not compiled, compiled
