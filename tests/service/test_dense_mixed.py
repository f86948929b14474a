"""vDriver's mixed step (``max_num_batched_tokens`` set): prompts prefilled in place, chunk by chunk, inside the
decode steps of the dense engine (engines/dense/mixed_step.py, drivers/dense/inplace_prefill.py).

* the planner: shapes within the budget, the shape that carries the most, oldest prompts first;
* the engine: prompts written chunk by chunk beside a decoding row, then seated, decode exactly as
  transformers-free greedy reference generation, and the decoding row is not disturbed;
* the driver: staggered requests of mixed lengths are exact, a running stream keeps decoding while a long
  prompt is spread over several steps, requests the steps cannot prefill (n > 1, prompt logprobs) still
  go through the prefill thread, a cancelled prompt gives its slot back, nothing compiles on a live request,
  and n-gram speculation with the bfloat16 knobs stays exact for greedy.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from vsurge import vSurge
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.engines.dense.mixed_step import Chunk, plan_chunks, step_shapes
from vsurge.models import greedy_generate
from vsurge.seed_api.request import vSurgeRequest

MAX_LEN = 128
BUCKETS = [16, 64]
BUDGET = 40  # small, so prompts of the tests span several steps


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def surge(tiny):
    """One compiled mixed-step vSurge for the driver tests that need no knob of their own."""
    s = mixed_surge(tiny)
    s.compile()
    s.start()
    yield s
    s.stop()


@pytest.fixture
def step_calls(surge):
    """The chunk lengths of each mixed step the shared engine runs during the test (an instance wrapper
    around the real step)."""
    engine = surge.driver.engines[0]
    calls: list[list[int]] = []
    real_step = engine.mixed.step

    def recorded(state, chunks, shape):
        calls.append([len(c.tokens) for c in chunks])
        return real_step(state, chunks, shape)

    engine.mixed.step = recorded
    yield calls
    engine.mixed.step = real_step
    # the slot is freed by the step thread, the request counted out by the pipeline a moment later
    deadline = time.time() + 5
    while (surge.driver.num_used_slots or surge.metrics().requests_running) and time.time() < deadline:
        time.sleep(0.01)
    assert surge.driver.num_used_slots == 0, "a test left slots in use"
    assert surge.metrics().requests_running == 0


def mixed_surge(tiny, **kw):
    model, tok = tiny
    kw = {"max_concurrent_decodes": 4, "prefill_lengths": BUCKETS, "max_length": MAX_LEN, **kw}
    kw.setdefault("max_num_batched_tokens", BUDGET)
    return vSurge.create_vdriver(model, tok, **kw)


def greedy_req(ids, max_tokens, **kw):
    kw = {"temperature": 0.0, "ignore_eos": True, **kw}
    return vSurgeRequest(prompt=list(ids), max_tokens=max_tokens, is_client_side_tokenization=True, **kw)


def tokens_of(active) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for items in active.channel:
        for x in items:
            out.setdefault(x.index, []).extend(x.token_ids)
    return out


# ------------------------------------------------------------------------------------------ planner
def test_step_shapes_stay_within_the_budget():
    for budget in (40, 256, 512, 1000):
        for rows in (1, 2, 8, 32):
            shapes = step_shapes(budget, rows)
            assert shapes[0][0] == 1 and all(rows + k * c <= budget for k, c in shapes), (budget, rows)
            assert all(c % 8 == 0 and c >= 8 for _, c in shapes)
    with pytest.raises(ValueError, match="leaves no prefill tokens"):
        step_shapes(36, 32)


def test_plan_chunks_takes_the_shape_that_carries_most_oldest_first():
    shapes = [(1, 32), (4, 8)]
    assert plan_chunks([100, 5], shapes) == ((1, 32), [32])  # one long chunk beats 8 + 5
    assert plan_chunks([3, 5, 8, 2, 9], shapes) == ((4, 8), [3, 5, 8, 2])  # 18 beats 3
    assert plan_chunks([20], shapes) == ((1, 32), [20])
    rng = np.random.default_rng(0)
    for _ in range(300):
        remaining = [int(n) for n in rng.integers(1, 90, size=rng.integers(1, 7))]
        (k, c), takes = plan_chunks(remaining, shapes)
        assert 1 <= len(takes) <= k and all(1 <= t <= c for t in takes)
        assert takes == [min(c, n) for n in remaining[: len(takes)]]
        assert sum(takes) == max(sum(min(cc, n) for n in remaining[:kk]) for kk, cc in shapes)


# ------------------------------------------------------------------------------------------ engine
def test_prompts_written_in_place_decode_like_the_reference(tiny):
    # Slot 1 decodes (inserted the usual way) while a 50-token prompt goes into slot 0 over several steps
    # and a 3-token prompt into slot 3; all three continue exactly as greedy generation alone.
    from vsurge.seed_api.engines import vEngine

    model, tok = tiny
    engine = vEngine(
        model,
        tok,
        max_concurrent_decodes=4,
        prefill_lengths=BUCKETS,
        max_length=MAX_LEN,
        max_num_batched_tokens=BUDGET,
    )
    greedy = SamplingParams(temperature=0.0)
    row = engine.make_sampling_row(greedy, ())
    state = engine.init_decode_state()
    pa, pb, pc = list(range(20, 45)), list(range(50, 100)), [7, 8, 9]
    state, first = engine.insert(engine.prefill(pa, greedy), state, 1)
    out = {1: [int(np.asarray(first.tokens)[0])], 0: [], 3: []}
    todo = {0: [pb, 0], 3: [pc, 0]}
    mixed_steps = 0
    for _ in range(14):
        chunks: list[Chunk] = []
        if todo:
            shape, takes = engine.mixed.step_plan([len(p) - at for p, at in todo.values()])
            chunks = [
                Chunk(slot, at, np.asarray(p[at : at + n], np.int32))
                for (slot, (p, at)), n in zip(todo.items(), takes, strict=False)
            ]
            state, res, hidden = engine.mixed.step(state, chunks, shape)
            mixed_steps += 1
        else:
            state, res = engine.decode(state)
        toks = np.asarray(res.tokens)
        for slot in out:
            if slot not in todo:
                out[slot].append(int(toks[slot]))
        for i, c in enumerate(chunks):
            todo[c.slot][1] += len(c.tokens)
            prompt, at = todo[c.slot]
            if at == len(prompt):
                state, first = engine.mixed.seat(state, hidden, i, c.slot, len(prompt), row, row.key[0])
                out[c.slot].append(int(np.asarray(first.tokens)[0]))
                del todo[c.slot]
    assert mixed_steps >= 2  # the 50-token prompt took more than one step
    # the repetition penalty's view of the prompt was gathered over all of its chunks
    for slot, prompt in ((0, pb), (3, pc)):
        assert np.flatnonzero(np.asarray(state.prompt_mask[slot])).tolist() == sorted(set(prompt))
    for slot, prompt in ((1, pa), (0, pb), (3, pc)):
        assert out[slot] == greedy_generate(model, [prompt], len(out[slot]))[0], slot


# ------------------------------------------------------------------------------------------ driver
def test_staggered_requests_prefilled_in_the_steps_match_reference(tiny, surge, step_calls):
    model, _ = tiny
    s = surge
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(5, 300, size=int(n))) for n in rng.randint(1, 110, size=12)]
    lengths = [int(n) for n in rng.randint(1, 16, size=12)]

    async def run():
        async def one(i):
            await asyncio.sleep(0.03 * i)
            ids = []
            async for items in s.complete(greedy_req(prompts[i], lengths[i])):
                for x in items:
                    ids.extend(x.token_ids)
            return ids

        return await asyncio.gather(*(one(i) for i in range(12)))

    got = asyncio.run(run())
    for i, p in enumerate(prompts):
        assert got[i] == greedy_generate(model, [p], lengths[i])[0], f"prompt {i} ({len(p)} tokens)"
    # every prompt token went through a mixed step, and none through the prefill thread's programs
    assert sum(map(sum, step_calls)) == sum(map(len, prompts))


def test_stream_decodes_while_a_long_prompt_is_chunked(tiny):
    # a 120-token prompt at a budget of 40 takes at least four steps; the running stream gets a token in
    # each of them (it never waits for the whole prompt)
    s = mixed_surge(tiny)
    engine = s.driver.engines[0]
    s.compile()
    log: list[tuple[int, bool]] = []
    real_step = engine.mixed.step

    def logged(state, chunks, shape):
        log.append((sum(len(c.tokens) for c in chunks), bool(engine._active.any())))
        return real_step(state, chunks, shape)

    engine.mixed.step = logged
    s.start()
    try:
        running = s.submit(greedy_req([3, 4, 5], 60))
        next(iter(running.channel))  # decoding
        long = s.submit(greedy_req(list(range(5, 125)), 3))
        got_long = tokens_of(long)[0]
        got_running = tokens_of(running)[0]
    finally:
        s.stop()
    chunked = [(n, live) for n, live in log if n]
    assert sum(n for n, _ in chunked) == 120 + 3 and len(chunked) >= 4, log
    assert all(live for n, live in chunked if n != 3), log  # every step of the long prompt also decoded
    model, _ = tiny
    assert got_long == greedy_generate(model, [list(range(5, 125))], 3)[0]
    assert len(got_running) == 59  # the first token came before


def test_requests_the_steps_cannot_prefill_take_the_prefill_thread(tiny, surge, step_calls):
    # n > 1 and prompt logprobs need a prefix of their own: they are prefilled on the prefill thread
    # beside requests prefilled in the steps, and all are served
    model, _ = tiny
    s = surge
    plain = s.submit(greedy_req([7, 8, 9, 10], 6))
    pair = s.submit(greedy_req([11, 12, 13], 5, n=2))
    scored = s.submit(greedy_req([14, 15, 16, 17, 18], 4, prompt_logprobs=1))
    out_plain, out_pair, out_scored = tokens_of(plain), tokens_of(pair), tokens_of(scored)
    assert sum(map(sum, step_calls)) == 4  # only the plain request's prompt went through the steps
    assert out_plain[0] == greedy_generate(model, [[7, 8, 9, 10]], 6)[0]
    want = greedy_generate(model, [[11, 12, 13]], 5)[0]
    assert out_pair == {0: want, 1: want}
    assert out_scored[0] == greedy_generate(model, [[14, 15, 16, 17, 18]], 4)[0]
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == 5


def test_cancel_while_prefilling_in_the_steps_frees_the_slot(tiny):
    s = mixed_surge(tiny, max_concurrent_decodes=2)
    engine = s.driver.engines[0]
    s.compile()
    gate, entered = threading.Event(), threading.Event()
    real_step = engine.mixed.step

    def held(state, chunks, shape):
        entered.set()
        gate.wait(10)
        return real_step(state, chunks, shape)

    engine.mixed.step = held
    s.start()
    try:
        long = s.submit(greedy_req(list(range(5, 125)), 5))
        assert entered.wait(10)
        assert s.driver.num_used_slots == 1  # its slot is held from the first chunk
        long.cancel()
        engine.mixed.step = real_step
        gate.set()
        deadline = time.time() + 5
        while s.driver.num_used_slots and time.time() < deadline:
            time.sleep(0.01)
        assert s.driver.num_used_slots == 0
        after = tokens_of(s.submit(greedy_req([1, 2, 3], 4)))  # the slot serves the next request
        assert len(after[0]) == 4
    finally:
        gate.set()
        s.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [{}, {"prefill_dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "decode_dtype": "bfloat16"}],
    ids=["model", "bfloat16"],
)
def test_no_compilation_on_live_requests_with_mixed_steps(tiny, kw):
    from jit_watch import compiled_while_serving

    s = mixed_surge(tiny, max_concurrent_decodes=8 if kw else 4, **kw)
    s.compile()
    compiled = compiled_while_serving(s)
    assert not compiled, compiled


@pytest.mark.slow
def test_speculation_with_mixed_steps_stays_exact_for_greedy(tiny):
    # repeated text, so drafts are proposed and verified between the mixed steps
    model, _ = tiny
    s = mixed_surge(tiny, speculative="ngram", num_speculative_tokens=3)
    s.compile()
    s.start()
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 20, [12, 13] * 3]
    try:
        actives = [s.submit(greedy_req(p, 20)) for p in prompts]
        got = [tokens_of(a)[0] for a in actives]
        drafted = s.driver.metrics().spec_decode_draft_tokens_total
    finally:
        s.stop()
    for p, g in zip(prompts, got, strict=True):
        assert g == greedy_generate(model, [p], 20)[0]
    assert drafted > 0


def test_repetition_penalty_sees_every_chunk_of_the_prompt(tiny, surge, step_calls):
    # the prompt's tokens are gathered chunk by chunk for the repetition penalty: a 60-token prompt over
    # two steps decodes as the prefill thread's path (the whole prompt in one call) decodes it
    prompt = [int(x) for x in np.random.RandomState(3).randint(5, 60, size=60)]
    req = dict(max_tokens=12, repetition_penalty=3.0)
    got = tokens_of(surge.submit(greedy_req(prompt, **req)))[0]
    assert len(step_calls) >= 2 and step_calls[0] == [32]
    plain = mixed_surge(tiny, max_num_batched_tokens=None)
    plain.compile()
    plain.start()
    try:
        want = tokens_of(plain.submit(greedy_req(prompt, **req)))[0]
    finally:
        plain.stop()
    assert got == want
    assert got != greedy_generate(tiny[0], [prompt], 12)[0]  # the penalty changed the output
