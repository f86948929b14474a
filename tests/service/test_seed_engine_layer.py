"""The seed's engine-level API as a layer over the real steps (issue 36, item 6): vEngine's seed `prefill`
returns a prefix that `insert` places and `decode` advances every active slot one token, returning
ResultTokens; oEngine's `prefill` writes prompts into pages that `insert` / `bulk_insert` hand to slots,
and its `forward` runs one mixed step of an ActiveSequenceBatch; both give the tokens the drivers give.
The engines' own call forms (what the drivers call) are unchanged beside them."""

from __future__ import annotations

import asyncio
import gc

import jax
import numpy as np
import pytest

import vsurge
from vsurge import (
    AbstractDriver,
    AbstractInferenceEngine,
    ActiveSequenceBatch,
    NextIterationPlan,
    ResultTokens,
    SamplingParams,
    vSurge,
)
from vsurge.seed_api.paged_prefix import PagedPrefix
from vsurge.seed_api.types import SeedPrefix

MAX_LEN = 64
STEPS = 5


@pytest.fixture(scope="module")
def dense(tiny_llama):
    model, tok = tiny_llama
    return vsurge.vEngine(model, tok, 4, None, [16], None, MAX_LEN)


@pytest.fixture(scope="module")
def paged(tiny_llama):
    model, tok = tiny_llama
    return vsurge.oEngine(
        model, tok, None, None, 4, None, [16], None, MAX_LEN, page_size=8, kv_cache_bytes=1 << 20
    )


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    _, tok = tiny_llama
    return [tok.encode("Hello world"), tok.encode("Paris is the capital of")]


@pytest.fixture(scope="module")
def driver_tokens(tiny_llama, prompts):
    """What vSurge (vDriver, greedy) generates for each prompt: the reference."""
    model, tok = tiny_llama
    s = vSurge.create_vdriver(model, tok, 4, [16], None, MAX_LEN)
    s.start()
    try:
        out = asyncio.run(
            s.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS + 1, ignore_eos=True))
        )
    finally:
        s.stop()
    return [r.token_ids for r in out]


@pytest.fixture(scope="module")
def odriver_tokens(tiny_llama, prompts):
    """What vSurge over oDriver (greedy, the paged engine's settings) generates: the paged reference."""
    model, tok = tiny_llama
    s = vSurge.create_odriver(
        model, tok, None, None, 8, 0.6, None, 4, [16], None, MAX_LEN, kv_cache_bytes=1 << 20
    )
    s.start()
    try:
        out = asyncio.run(
            s.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS + 3, ignore_eos=True))
        )
    finally:
        s.stop()
    return [r.token_ids for r in out]


def padded(ids, width=16):
    tokens = np.zeros(width, np.int32)
    tokens[: len(ids)] = ids
    return tokens, np.arange(width) < len(ids)


def test_dense_prefill_insert_decode_give_the_drivers_tokens(dense, prompts, driver_tokens):
    state = dense.init_decode_state()
    slots, firsts = [3, 0], []
    for ids, slot in zip(prompts, slots, strict=True):
        tokens, valids = padded(ids)
        prefix, result = dense.prefill(
            dense.graphstate, dense.graphothers, tokens, valids, len(ids), 0.0, 1.0, dense.prng_key
        )
        assert isinstance(prefix, SeedPrefix) and isinstance(result, ResultTokens)
        one = result.convert_to_numpy().get_result_at_slot(0)
        assert one.valid.tolist() == [[1]] and one.lengths.tolist() == [1]
        firsts.append(int(one.tokens[0, 0]))
        state = dense.insert(prefix, state, slot)  # the state alone, as the seed's
        assert hasattr(state, "caches")
    got = {slot: [first] for slot, first in zip(slots, firsts, strict=True)}
    for step in range(STEPS):
        state, result = dense.decode(dense.graphstate, dense.graphothers, state, dense.prng_key)
        host = result.convert_to_numpy()
        assert host.data.shape == (4, 3)  # every slot
        for slot in range(4):
            d = host.get_result_at_slot(slot)
            assert bool(d.valid[0, 0]) == (slot in slots)
            if slot in got:
                got[slot].append(int(d.tokens[0, 0]))
                assert int(d.lengths[0]) == step + 2
    assert [got[s] for s in slots] == driver_tokens
    assert dense.free_resource(3) and not dense.free_resource(3) and not dense.free_resource(1)


def test_dense_bulk_insert_puts_one_prefix_in_several_slots(dense, prompts, driver_tokens):
    state = dense.init_decode_state()
    tokens, valids = padded(prompts[0])
    prefix, _ = dense.prefill(
        dense.graphstate, dense.graphothers, tokens, valids, len(prompts[0]), 0.0, 1.0, dense.prng_key
    )
    state = dense.bulk_insert(prefix, state, [1, 2])
    state, result = dense.decode(dense.graphstate, dense.graphothers, state, dense.prng_key)
    host = result.convert_to_numpy()
    assert [int(host.get_result_at_slot(s).tokens[0, 0]) for s in (1, 2)] == [driver_tokens[0][1]] * 2
    for s in (1, 2):
        dense.free_resource(s)


def test_paged_forward_and_decode_give_the_drivers_tokens(paged, prompts, driver_tokens):
    batch = paged.init_sequence_batch()
    assert isinstance(batch, ActiveSequenceBatch)
    for slot, ids in zip([2, 0], prompts, strict=True):
        batch.admit(slot, ids)
    got: dict[int, list[int]] = {2: [], 0: []}
    while not all(got.values()):  # prompt chunks (and the first tokens) within the step's budget
        plan = batch.plan()
        assert isinstance(plan, NextIterationPlan) and plan.chunks
        out = paged.forward(paged.graphstate, paged.graphothers, batch, plan)
        for slot in np.flatnonzero(out.valid):
            got[int(slot)].append(int(out.tokens[slot]))
    for _ in range(STEPS):
        batch, result = paged.decode(paged.graphstate, paged.graphothers, batch, paged.prng_key)
        host = result.convert_to_numpy()
        for slot in got:
            got[slot].append(int(host.get_result_at_slot(slot).tokens[0, 0]))
        assert not host.get_result_at_slot(1).valid[0, 0]
    assert [got[2], got[0]] == driver_tokens
    used = paged.manager.num_used
    assert paged.free_resource(2) and not paged.free_resource(2)
    assert paged.manager.num_used < used
    assert batch.free(0) and paged.manager.num_used == 0
    paged.manager.check()


def seed_prefill(engine, rows, key=None):
    """oEngine's seed prefill, greedy, of one prompt (``rows`` a list of ids: tokens [16]) or several
    (a list of lists: tokens [B, 16], a true_length per row)."""
    if isinstance(rows[0], int):
        (tokens, valids), length = padded(rows), len(rows)
    else:
        pairs = [padded(r) for r in rows]
        tokens, valids = np.stack([t for t, _ in pairs]), np.stack([v for _, v in pairs])
        length = np.array([len(r) for r in rows])
    key = engine.prng_key if key is None else key
    return engine.prefill(engine.graphstate, engine.graphothers, tokens, valids, length, 0.0, 1.0, 0, key)


def test_paged_prefill_insert_decode_give_the_odrivers_tokens(paged, prompts, odriver_tokens):
    start = paged.manager.num_free
    batch = paged.init_sequence_batch()
    prefix, result = seed_prefill(paged, prompts[0])
    assert isinstance(prefix, PagedPrefix) and isinstance(result, ResultTokens)
    one = result.convert_to_numpy().get_result_at_slot(0)
    assert one.valid.tolist() == [[1]] and one.lengths.tolist() == [1]
    assert paged.manager.num_free < start and prefix.holds_pages  # the prompt's pages, not yet in a slot
    assert paged.insert(prefix, batch, 2) is batch and not prefix.holds_pages
    got = {2: [int(one.tokens[0, 0])]}

    def decode():
        nonlocal batch
        batch, result = paged.decode(paged.graphstate, paged.graphothers, batch, paged.prng_key)
        host = result.convert_to_numpy()
        for slot in got:
            got[slot].append(int(host.get_result_at_slot(slot).tokens[0, 0]))
        assert not host.get_result_at_slot(1).valid[0, 0]

    decode()
    decode()
    # prefilled while slot 2 decodes (a step of chunks alone): slot 2 goes on as if nothing ran
    prefix, result = seed_prefill(paged, prompts[1])
    assert paged.insert(prefix, batch, 0) is batch
    got[0] = [int(result.convert_to_numpy().get_result_at_slot(0).tokens[0, 0])]
    for _ in range(STEPS):
        decode()
    assert got[2] == odriver_tokens[0]  # 1 + 2 + STEPS tokens
    assert got[0] == odriver_tokens[1][: STEPS + 1]
    assert paged.free_resource(2) and paged.free_resource(0) and not paged.free_resource(0)
    assert paged.manager.num_free == start
    paged.manager.check()


def test_paged_bulk_insert_of_a_batched_prefill_decodes_both(tiny_llama, prompts, odriver_tokens):
    """Two prompts prefilled in one call, in chunks (5 tokens a step: 8 + 8 tokens take 4 steps, one of
    them ending the first prompt and starting the second), bulk-inserted into two slots, decoded together."""
    model, tok = tiny_llama
    engine = vsurge.oEngine(
        model,
        tok,
        None,
        None,
        4,
        None,
        [16],
        None,
        MAX_LEN,
        page_size=8,
        kv_cache_bytes=1 << 20,
        max_num_batched_tokens=5,
    )
    assert engine.step_tokens[-1] == 5 and all(len(p) > 5 for p in prompts)
    start = engine.manager.num_free
    batch = engine.init_sequence_batch()
    prefix, result = seed_prefill(engine, prompts)
    assert len(prefix) == 2 and prefix.lengths == [len(p) for p in prompts]
    host = result.convert_to_numpy()
    assert host.data.shape == (2, 3) and host.data[:, 1].tolist() == [1, 1]
    with pytest.raises(ValueError, match="bulk_insert"):
        engine.insert(prefix, batch, 0)  # two prompts need two slots
    with pytest.raises(ValueError, match="2 prefilled prompts for 1 slots"):
        engine.bulk_insert(prefix, batch, [0])
    assert engine.bulk_insert(prefix, batch, [3, 1]) is batch
    got = {3: [int(host.data[0, 0])], 1: [int(host.data[1, 0])]}
    for _ in range(STEPS):
        batch, res = engine.decode(engine.graphstate, engine.graphothers, batch, engine.prng_key)
        res = res.convert_to_numpy()
        for slot in got:
            got[slot].append(int(res.get_result_at_slot(slot).tokens[0, 0]))
    assert [got[3], got[1]] == [t[: STEPS + 1] for t in odriver_tokens]
    assert engine.free_resource(3) and engine.free_resource(1)
    assert engine.manager.num_free == start
    engine.manager.check()


def test_paged_bulk_insert_takes_a_list_of_prefixes(paged, prompts, odriver_tokens):
    start = paged.manager.num_free
    batch = paged.init_sequence_batch()
    prefixes = [seed_prefill(paged, ids)[0] for ids in prompts]
    batch = paged.bulk_insert(prefixes, batch, [1, 0])
    batch, res = paged.decode(paged.graphstate, paged.graphothers, batch, paged.prng_key)
    res = res.convert_to_numpy()
    assert [int(res.get_result_at_slot(s).tokens[0, 0]) for s in (1, 0)] == [t[1] for t in odriver_tokens]
    assert batch.free(0) and batch.free(1) and paged.manager.num_free == start


def test_a_prefix_never_inserted_returns_its_pages(paged, prompts, monkeypatch):
    start = paged.manager.num_free
    batch = paged.init_sequence_batch()
    prefix, _ = seed_prefill(paged, prompts[0])
    assert paged.manager.num_free < start
    del prefix  # dropped: its pages go back
    gc.collect()
    assert paged.manager.num_free == start
    prefix, _ = seed_prefill(paged, prompts)
    prefix.free()  # or at once
    assert paged.manager.num_free == start and not prefix.holds_pages
    with pytest.raises(ValueError, match="already inserted or freed"):
        paged.bulk_insert(prefix, batch, [0, 1])
    paged.manager.check()


def test_paged_insert_errors_are_clear_and_move_nothing(paged, prompts, monkeypatch):
    start = paged.manager.num_free
    batch = paged.init_sequence_batch()
    batch.admit(0, prompts[0])
    prefix, _ = seed_prefill(paged, prompts[1])
    with pytest.raises(ValueError, match="in use"):
        paged.insert(prefix, batch, 0)
    with pytest.raises(TypeError, match="ActiveSequenceBatch"):
        paged.insert(prefix, batch.state, 1)
    with pytest.raises(ValueError, match="another ActiveSequenceBatch"):
        paged.insert(prefix, paged.init_sequence_batch(), 1)
    assert prefix.holds_pages  # nothing moved
    paged.insert(prefix, batch, 1)
    with pytest.raises(ValueError, match="already inserted"):
        paged.insert(prefix, batch, 2)
    with pytest.raises(ValueError, match="true_length"):
        tokens, valids = padded(prompts[0])
        paged.prefill(paged.graphstate, None, tokens, valids, 3, 0.0, 1.0, 0, paged.prng_key)
    monkeypatch.setattr(paged, "_seed_batch", None)
    with pytest.raises(RuntimeError, match="init_sequence_batch"):
        seed_prefill(paged, prompts[0])
    batch.free(0)
    batch.free(1)
    assert paged.manager.num_free == start
    paged.manager.check()


def test_paged_admission_errors_are_clear(paged, prompts):
    batch = paged.init_sequence_batch()
    batch.admit(0, prompts[0])
    with pytest.raises(ValueError, match="in use"):
        batch.admit(0, prompts[1])
    with pytest.raises(ValueError, match="not in"):
        batch.admit(9, prompts[1])
    with pytest.raises(ValueError, match="prompt of 0"):
        batch.admit(1, [])
    batch.free(0)
    assert paged.manager.num_used == 0


def test_the_engines_own_forms_are_unchanged_beside_the_seeds(dense, prompts):
    """What the drivers call still runs: prefill(tokens, params), insert(...) -> (state, first), decode(state)."""
    state = dense.init_decode_state()
    prefix = dense.prefill(prompts[0], SamplingParams(temperature=0.0))
    state, first = dense.insert(prefix, state, 0)
    state, out = dense.decode(state)
    assert np.asarray(out.tokens).shape[0] >= 1 and np.asarray(first.tokens).shape == (1,)
    dense.free_resource(0)
    assert "decode(decode_state" in vsurge.vEngine.decode.__doc__
    assert vsurge.vEngine.decode.engine_method.__name__ == "decode"


def test_weights_other_than_the_engines_are_refused(dense, prompts):
    tokens, valids = padded(prompts[0])
    other = jax.tree.map(lambda x: x, dense.graphstate)
    with pytest.raises(ValueError, match="weights it was built with"):
        dense.prefill(other, None, tokens, valids, len(prompts[0]), 0.0, 1.0, dense.prng_key)
    with pytest.raises(ValueError, match="true_length"):
        dense.prefill(dense.graphstate, None, tokens, valids, 3, 0.0, 1.0, dense.prng_key)


def test_prng_key_is_a_new_key_on_each_access(dense):
    def first_keys(seed):
        engine = vsurge.vEngine(dense.model, dense.processor, 4, None, [16], None, MAX_LEN, None, seed)
        return [np.asarray(engine.prng_key).tobytes() for _ in range(3)]

    keys = first_keys(5)
    assert len(set(keys)) == 3
    assert first_keys(5) == keys and first_keys(6) != keys  # seeded by `seed`: reproducible


def test_result_tokens_on_device_and_host(dense):
    r = ResultTokens.from_columns(jax.numpy.array([5, 6]), np.array([1, 0]), np.array([3, 4]))
    r.copy_to_host_async()
    h = r.convert_to_numpy()
    assert isinstance(h.data, np.ndarray) and h.data.tolist() == [[5, 1, 3], [6, 0, 4]]
    d = h.get_result_at_slot(1)
    assert (d.tokens.tolist(), d.valid.tolist(), d.lengths.tolist()) == ([[6]], [[0]], [4])


def test_drivers_and_engines_are_the_seeds_protocols():
    assert issubclass(vsurge.vDriver, AbstractDriver) and issubclass(vsurge.oDriver, AbstractDriver)
    assert issubclass(vsurge.vEngine, AbstractInferenceEngine)
    assert issubclass(vsurge.oEngine, AbstractInferenceEngine)  # its prefill / insert / bulk_insert too
    assert not issubclass(vsurge.vSurge, AbstractDriver)

    class Half(AbstractDriver):
        def start(self) -> None: ...

    with pytest.raises(TypeError, match="abstract"):
        Half()
