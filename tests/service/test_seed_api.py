"""Code written against the seed's vSurge runs unchanged (issue 36, items 1-5): every name imports from
`vsurge`; the seed's positional order builds drivers and engines (`config=` a keyword, never overridden by
an argument left at its default); `generate("one prompt")` is a list; a vSurgeRequest's sampling fields are
a record the driver reads; `is_client_side_tokenization` is the seed's response mode, with its helpers."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

import vsurge
from vsurge import EngineConfig, SamplingParams, vSurge, vSurgeRequest
from vsurge.contracts.request import ReturnSample

MAX_LEN = 64


def test_the_seed_names_import_from_vsurge():
    from vsurge.drivers.dense.vdriver import vDriver
    from vsurge.drivers.paged.odriver import oDriver
    from vsurge.engines.paged.paging import HBMPageManager, PagedAttentionCache
    from vsurge.seed_api.engines import oEngine, vEngine
    from vsurge.server import vSurgeApiServer

    assert (vsurge.vDriver, vsurge.oDriver, vsurge.vEngine, vsurge.oEngine) == (
        vDriver,
        oDriver,
        vEngine,
        oEngine,
    )
    assert (vsurge.HBMPageManager, vsurge.PagedAttentionCache) == (HBMPageManager, PagedAttentionCache)
    assert vsurge.vSurgeApiServer is vSurgeApiServer
    for name in (
        "ActiveRequest",
        "ReturnSample",
        "vSurgeMetadata",
        "ResultTokens",
        "AbstractDriver",
        "CountTokenRequest",
    ):
        assert isinstance(getattr(vsurge, name), type), name
    assert set(vsurge.__all__) <= set(dir(vsurge))
    with pytest.raises(AttributeError):
        _ = vsurge.NotASeedName
    assert vsurge.vSurgeMetadata().start_time > 0  # the seed's field name


# ---------------------------------------------------------------------------------------- positional order


def test_engines_take_the_seed_positional_order(tiny_llama):
    model, tok = tiny_llama
    e = vsurge.vEngine(model, tok, 2, 3, [16], 16, MAX_LEN, 2, 7)
    assert (e.max_concurrent_decodes, e.max_concurrent_prefill, e.prefill_lengths) == (2, 3, [16])
    assert (e.max_prefill_length, e.max_length, e.batch_size, e.engine_config.seed) == (16, MAX_LEN, 2, 7)
    # the seed's batch size is the decode batch: alone it sets the slots, against another count it is refused
    assert vsurge.vEngine(model, tok, None, None, [16], None, MAX_LEN, 3).max_concurrent_decodes == 3
    with pytest.raises(ValueError, match="batch_size 5 and max_concurrent_decodes 2"):
        vsurge.vEngine(model, tok, 2, 3, [16], 16, MAX_LEN, 5, 7)
    storage = vsurge.PagedAttentionCache.create(model.config, 16, 0.6, 1 << 20, dtype=model.dtype)
    manager = vsurge.HBMPageManager.for_cache(storage)
    o = vsurge.oEngine(model, tok, storage, manager, 2, None, [16], None, MAX_LEN)
    assert o.storage is storage and o.manager is manager and o.max_concurrent_decodes == 2


def test_a_default_keeps_the_config_and_a_given_value_wins(tiny_llama):
    model, tok = tiny_llama
    cfg = EngineConfig(seed=7, max_length=MAX_LEN, max_concurrent_decodes=2, prefill_lengths=[16])
    assert (
        vsurge.vEngine(model, tok, config=cfg).engine_config.seed == 7
    )  # seed=894 is the default, not given
    assert vsurge.vEngine(model, tok, seed=894, config=cfg).engine_config.seed == 894
    assert vsurge.vEngine(model, tok, 3, config=cfg).max_concurrent_decodes == 3
    # an EngineConfig third (the signature before the seed's order came back) is the config
    assert vsurge.vEngine(model, tok, cfg).engine_config.seed == 7
    with pytest.raises(TypeError, match="config given twice"):
        vsurge.vEngine(model, tok, cfg, config=cfg)
    with pytest.raises(TypeError, match="unknown engine option"):
        vsurge.vEngine(model, tok, max_lenght=64)


def test_create_odriver_and_create_vdriver_take_the_seed_order(tiny_llama):
    model, tok = tiny_llama
    storage = vsurge.PagedAttentionCache.create(model.config, 16, 0.6, 1 << 20, dtype=model.dtype)
    # create_odriver(model, processor, storage) raised TypeError before
    s = vSurge.create_odriver(model, tok, storage, None, 16, 0.5, 1, 2, [16], None, MAX_LEN, 11, "paged")
    e = s.driver.engine
    assert e.storage is storage and s.vsurge_name == "paged"
    assert (e.page_size, e.engine_config.hbm_utilization, e.max_concurrent_decodes) == (16, 0.5, 2)
    assert (e.max_length, e.engine_config.seed) == (MAX_LEN, 11)
    v = vSurge.create_vdriver(
        model, tok, 2, [16], None, MAX_LEN, 3, "dense", config=EngineConfig(page_size=32)
    )
    ve = v.driver.engines[0]
    assert (ve.max_concurrent_decodes, ve.prefill_lengths, ve.engine_config.seed, v.vsurge_name) == (
        2,
        [16],
        3,
        "dense",
    )
    assert ve.engine_config.page_size == 32  # the config's own knobs stay


# ---------------------------------------------------------------------------------------- a running surge


@pytest.fixture(scope="module")
def surge(tiny_llama):
    model, tok = tiny_llama
    s = vSurge.create_vdriver(model, tok, 4, [16], None, MAX_LEN)
    s.start()  # compiled on first use: these tests run few shapes
    yield s
    s.stop()


def run(coro):
    return asyncio.run(coro)


async def steps(surge, request) -> list[list[ReturnSample]]:
    return [step async for step in surge.complete(request)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_generate_returns_a_list_for_one_prompt_and_n_samples_in_a_row(surge):
    (one,) = run(surge.generate("Hello", greedy(max_tokens=4)))
    assert isinstance(one, ReturnSample) and len(one.token_ids) == 4
    out = run(surge.generate(["Hello", "Paris is"], greedy(max_tokens=3, n=2)))
    assert [s.index for s in out] == [0, 1, 0, 1]
    assert out[0].token_ids == one.token_ids[:3] == out[1].token_ids  # greedy: the n samples agree
    (ids,) = run(surge.generate(surge.tokenize("Hello"), greedy(max_tokens=4)))  # token ids are a prompt
    assert ids.token_ids == one.token_ids


def test_a_request_is_a_record_the_driver_reads(surge):
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    want = run(surge.generate("Hello", greedy(max_tokens=6)))[0].token_ids
    sampled = [
        t
        for step in run(steps(surge, vSurgeRequest.from_sampling_params("Hello", sp)))
        for s in step
        for t in s.token_ids
    ]
    assert sampled != want  # seeded sampling at temperature 1: another sequence than greedy
    request = vSurgeRequest.from_sampling_params("Hello", sp)
    request.temperature = 0.0  # set after construction: the seed's request is a plain record
    request.max_tokens = 5
    got = [t for step in run(steps(surge, request)) for s in step for t in s.token_ids]
    assert got == want[:5]
    assert (sp.temperature, sp.max_tokens) == (1.0, 6)  # the SamplingParams it came from is not changed
    assert (request.temperature, request.sampling.temperature) == (0.0, 0.0)
    with pytest.raises(TypeError):
        request.sampling = {"temperature": 0.0}


def _byte_token(tok, byte: int) -> int:
    """The byte-level BPE token of one raw byte: bytes 0xA1-0xAC and 0xAE-0xFF stand for themselves in
    the GPT-2 byte alphabet (chr(byte))."""
    assert 0xA1 <= byte <= 0xFF and byte != 0xAD
    token = tok.convert_tokens_to_ids(chr(byte))
    assert tok.decode([token]) == "\ufffd"  # one byte of a multi-byte character: no character alone
    return token


def test_client_side_tokenization_passes_steps_through_with_ids(surge):
    want = run(surge.generate("Hello", greedy(max_tokens=6)))[0]
    client = run(
        steps(
            surge,
            vSurgeRequest("Hello", 6, temperature=0.0, ignore_eos=True, is_client_side_tokenization=True),
        )
    )
    assert [t for step in client for s in step for t in s.token_ids] == want.token_ids
    assert all(s.text == "" for step in client for s in step)  # the client detokenizes
    assert surge.process_client_side_tokenization_response(client[0]) == client[0]
    # a text prompt is tokenized by the server in either mode, token ids are a prompt in either mode
    ids = surge.tokenize("Hello")
    server = run(steps(surge, vSurgeRequest(ids, 6, temperature=0.0, ignore_eos=True)))
    text = "".join(s.text for step in server for s in step)
    assert text == surge.processor.decode(want.token_ids) == want.text


def test_server_side_steps_never_end_inside_a_character(surge):
    tok = surge.processor
    lead = _byte_token(tok, 0xC3)  # the first byte of "é" (C3 A9): alone, half a character
    only_lead = greedy(max_tokens=5, allowed_token_ids=[lead])
    server = run(steps(surge, vSurgeRequest.from_sampling_params("Hello", only_lead)))
    client = run(
        steps(surge, vSurgeRequest.from_sampling_params("Hello", only_lead, is_client_side_tokenization=True))
    )
    # every step ended inside a character, so the server side held them all and sent one merged item
    assert len(server) == 1 and server[0][0].token_ids == [lead] * 5
    assert [t for step in client for s in step for t in s.token_ids] == [lead] * 5
    assert server[0][0].num_generated_tokens == 5 and server[0][0].finish_reason == "length"


def test_should_buffer_response_and_the_merge(surge):
    tok = surge.processor
    lead, tail = _byte_token(tok, 0xC3), _byte_token(tok, 0xA9)
    ascii_id = tok.convert_tokens_to_ids("a")
    step = lambda ids, text="", **kw: ReturnSample(text=text, token_ids=ids, **kw)  # noqa: E731
    assert surge.should_buffer_response([step([ascii_id, lead])])
    assert not surge.should_buffer_response([step([lead, tail], "é")])
    assert not surge.should_buffer_response([step([lead], finish_reason="length")])  # finished: flushed
    assert not surge.should_buffer_response([step([])])
    first = [step([lead], num_generated_tokens=1, prompt_token_ids=[1, 2]), step([ascii_id], "a", index=1)]
    merged = surge.process_server_side_tokenization_response(
        [step([tail], "é", num_generated_tokens=2)], [first]
    )
    assert [(m.index, m.token_ids, m.text) for m in merged] == [(0, [lead, tail], "é"), (1, [ascii_id], "a")]
    assert merged[0].num_generated_tokens == 2 and merged[0].prompt_token_ids == [1, 2]
    assert first[0].token_ids == [lead]  # the inputs are not changed
    assert dataclasses.is_dataclass(merged[0])


def test_a_prompt_that_is_neither_text_nor_ids_is_refused(surge):
    with pytest.raises(ValueError, match="token ids"):
        run(steps(surge, vSurgeRequest(3.5, 4)))
    with pytest.raises(ValueError, match=r"integers in \[0"):
        run(steps(surge, vSurgeRequest([1, -2], 4)))
    assert np.array_equal(vSurgeRequest(np.array([1, 2]), 4).prompt, [1, 2])
