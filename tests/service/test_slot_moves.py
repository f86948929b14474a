"""Live slots moved down so that decode covers fewer rows (engines/dense/slot_moves.py, vDriver's `_compact`).

* the planner: the smallest bucket that holds every slot in use, pinned slots stay, no move that would not
  shrink the bucket;
* the engine: a slot moved mid-generation decodes on exactly as greedy generation alone, and the decode
  step covers fewer rows;
* the driver: a request left alone in a high slot after a burst is moved down and stays exact (with and
  without n-gram speculation), and a moved request that ends on a stop token frees its slot at once.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from vsurge import vSurge
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.engines.dense.slot_moves import plan_moves
from vsurge.models import greedy_generate
from vsurge.seed_api.request import vSurgeRequest

MAX_LEN = 160
BUCKETS = [16, 64]


def greedy_req(ids, max_tokens, **kw):
    kw = {"temperature": 0.0, "ignore_eos": True, **kw}
    return vSurgeRequest(prompt=list(ids), max_tokens=max_tokens, is_client_side_tokenization=True, **kw)


# ------------------------------------------------------------------------------------------ planner
def test_plan_moves_brings_the_live_slots_under_the_smallest_bucket():
    buckets = [1, 2, 4, 8]
    assert plan_moves([0, 5, 7], [], [1, 2, 3, 4, 6], buckets) == [(5, 1), (7, 2)]
    assert plan_moves([7], [], range(7), buckets) == [(7, 0)]
    assert plan_moves([0, 1, 2, 5], [], [3, 4, 6, 7], buckets) == [(5, 3)]
    assert plan_moves([0, 1, 2, 3, 5], [], [4, 6, 7], buckets) == []  # 5 live need 8 rows: no shrink
    assert plan_moves([0, 1, 6], [], [2, 3, 4, 5, 7], buckets) == [(6, 2)]
    assert plan_moves([3], [], [0, 1, 2, 4, 5, 6, 7], buckets) == [(3, 0)]
    assert plan_moves([], [5], [0, 1], buckets) == []
    # a pinned slot (a prompt written in place, a grammar) stays and the bucket must cover it
    assert plan_moves([7], [5], [0, 1, 2, 3, 4, 6], buckets) == []
    assert plan_moves([7], [1], [0, 2, 3, 4, 5, 6], buckets) == [(7, 0)]
    rng = np.random.default_rng(0)
    for _ in range(500):
        used = rng.permutation(32)[: rng.integers(1, 32)]
        pinned = [int(s) for s in used if rng.random() < 0.2]
        live = [int(s) for s in used if s not in pinned]
        free = sorted(set(range(32)) - set(map(int, used)))
        moves = plan_moves(live, pinned, free, [1, 2, 4, 8, 16, 32])
        after = (set(live) - {a for a, _ in moves}) | {b for _, b in moves} | set(pinned)
        assert len(after) == len(used) and {b for _, b in moves} <= set(free)
        need = max(len(used), max(pinned, default=-1) + 1)
        target = next(b for b in (1, 2, 4, 8, 16, 32) if b >= need)
        if max(used) >= target:
            assert max(after) < target
        else:
            assert moves == []


# ------------------------------------------------------------------------------------------ engine
def test_a_moved_slot_decodes_on_like_the_reference(tiny_llama):
    from vsurge.seed_api.engines import vEngine

    model, tok = tiny_llama
    engine = vEngine(model, tok, max_concurrent_decodes=8, prefill_lengths=BUCKETS, max_length=MAX_LEN)
    greedy = SamplingParams(temperature=0.0)
    state = engine.init_decode_state()
    pa, pb = list(range(20, 45)), [7, 8, 9, 10]
    state, first_a = engine.insert(engine.prefill(pa, greedy), state, 6)
    state, first_b = engine.insert(engine.prefill(pb, greedy), state, 2)
    out = {"a": [int(np.asarray(first_a.tokens)[0])], "b": [int(np.asarray(first_b.tokens)[0])]}
    where = {"a": 6, "b": 2}
    for i in range(12):
        if i == 5:
            assert engine.decode_bucket() == 8
            state = engine.move_slots(state, [(6, 0), (2, 1)])
            where = {"a": 0, "b": 1}
            assert engine.decode_bucket() == 2 and not engine._active[[2, 6]].any()
        state, res = engine.decode(state)
        toks = np.asarray(res.tokens)
        for k, slot in where.items():
            out[k].append(int(toks[slot]))
    assert out["a"] == greedy_generate(model, [pa], 13)[0]
    assert out["b"] == greedy_generate(model, [pb], 13)[0]


# ------------------------------------------------------------------------------------------ driver
def _surge(tiny, **kw):
    model, tok = tiny
    kw = {"max_concurrent_decodes": 8, "prefill_lengths": BUCKETS, "max_length": MAX_LEN, **kw}
    return vSurge.create_vdriver(model, tok, **kw)


def _record(engine):
    """The row bucket of every decode / verify step, the live rows of each, and every move (instance
    wrappers around the real methods)."""
    buckets, live, moves = [], [], []
    decode, verify, move = engine.decode, engine.verify, engine.move_slots

    def recorded_decode(state):
        buckets.append(engine.decode_bucket())
        live.append(int(engine._active.sum()))
        return decode(state)

    def recorded_verify(state, draft, num):
        buckets.append(engine.decode_bucket())
        live.append(int(engine._active.sum()))
        return verify(state, draft, num)

    def recorded_move(state, pairs):
        moves.append(list(pairs))
        return move(state, pairs)

    engine.decode, engine.verify, engine.move_slots = recorded_decode, recorded_verify, recorded_move
    return buckets, live, moves


async def _burst_then_a_long_one(s, shorts, long_prompt, long_req):
    """Seven requests decode; then one more takes the highest slot and outlives them."""
    first = asyncio.Event()
    seen = set()

    async def one(i, req):
        ids = []
        async for items in s.complete(req):
            for x in items:
                ids.extend(x.token_ids)
            seen.add(i)
            if len(seen) == len(shorts):
                first.set()
        return ids

    tasks = [asyncio.create_task(one(i, greedy_req(p, 40))) for i, p in enumerate(shorts)]
    await asyncio.wait_for(first.wait(), 60)
    long = await one(-1, long_req)
    return await asyncio.gather(*tasks), long


@pytest.mark.parametrize(
    "kw",
    [{}, pytest.param({"speculative": "ngram", "num_speculative_tokens": 3}, marks=pytest.mark.slow)],
    ids=["plain", "ngram"],
)
def test_a_request_left_in_a_high_slot_is_moved_down_and_stays_exact(tiny_llama, kw):
    model, _ = tiny_llama
    # The long request must outlive the shorts' last 39 tokens even when every draft is accepted
    # (4 tokens a step with K = 3): 200 tokens take at least 50 steps.
    s = _surge(tiny_llama, max_length=2 * MAX_LEN, **kw)
    s.compile()
    engine = s.driver.engines[0]
    buckets, _, moves = _record(engine)
    rng = np.random.RandomState(1)
    shorts = [list(rng.randint(5, 300, size=int(n))) for n in rng.randint(3, 40, size=7)]
    long_prompt = [9, 10, 11, 12] * 5  # repeats: with ngram, drafts are verified before and after the move
    s.start()
    try:
        got_shorts, got_long = asyncio.run(
            _burst_then_a_long_one(s, shorts, long_prompt, greedy_req(long_prompt, 200))
        )
    finally:
        s.stop()
    for p, g in zip(shorts, got_shorts, strict=True):
        assert g == greedy_generate(model, [p], 40)[0]
    assert got_long == greedy_generate(model, [long_prompt], 200)[0]
    assert s.driver._slots[0].moved >= 1 and moves, moves
    assert moves[-1][-1][1] == 0  # alone at the end: slot 0
    assert buckets[-1] == 1 and 8 in buckets  # the burst ran 8 rows, the lone request one
    if kw:
        assert s.driver.metrics().spec_decode_accepted_tokens_total > 0


def test_a_moved_request_that_stops_frees_its_slot_at_once(tiny_llama):
    model, _ = tiny_llama
    s = _surge(tiny_llama)
    s.compile()
    engine = s.driver.engines[0]
    _, live, moves = _record(engine)
    long_prompt = [40, 41, 42, 43, 44, 45]
    want = greedy_generate(model, [long_prompt], 140)[0]
    at = next(i for i in range(60, 120) if want[i] not in want[:i])  # its first time: the stop
    shorts = [[5 + i, 6 + i, 7 + i] for i in range(7)]
    s.start()
    try:
        # only the stop token (seen by the detokenizer, not counted on the step thread) ends it early
        req = greedy_req(long_prompt, 150, stop_token_ids=[want[at]])
        _, got = asyncio.run(_burst_then_a_long_one(s, shorts, long_prompt, req))
        deadline = time.time() + 5
        while s.driver.num_used_slots and time.time() < deadline:
            time.sleep(0.01)
        used = s.driver.num_used_slots
    finally:
        s.stop()
    assert moves and got == want[: at + 1]
    assert used == 0
    # the stop freed the moved slot: the steps ended within the detokenizer's lead of the stop token, not
    # at max_tokens (its first step is the first with all 8 rows live)
    steps_with_long = len(live) - live.index(8)
    assert steps_with_long <= at + s.driver.detokenizing_blocks + 2, (steps_with_long, at)
