"""Decode blocks (decode_steps > 1): K steps per program give the tokens of K single steps, to the token."""

import asyncio
import threading

import numpy as np
import pytest
from jit_watch import compilations

import vsurge
from vsurge import vSurge
from vsurge.contracts.engine_config import EngineConfig
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.drivers.active_request import ActiveRequest
from vsurge.drivers.dense.transfer import transfer_group
from vsurge.drivers.pipeline import drain
from vsurge.drivers.queue_messages import FirstToken, PrefilledPack
from vsurge.models import greedy_generate
from vsurge.seed_api.request import vSurgeRequest


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return vsurge.load_model(path)


def _surge(tiny, steps: int, **kw):
    model, tok = tiny
    s = vSurge.create_vdriver(
        model,
        tok,
        max_concurrent_decodes=4,
        prefill_lengths=[16, 64],
        max_length=96,
        decode_steps=steps,
        **kw,
    )
    s.compile()
    s.start()
    return s


async def _collect(surge, req):
    ids, lps, tops, finish = [], [], [], None
    async for items in surge.complete(req):
        for s in items:
            ids.extend(s.token_ids)
            for lp in s.logprobs or []:
                lps.append(lp.logprob)
                tops.append([t for t, _ in lp.top])
            finish = s.finish_reason
    return ids, lps, tops, finish


def _run(surge, reqs):
    async def go():
        return await asyncio.gather(*(_collect(surge, r) for r in reqs))

    return asyncio.run(go())


def _requests(seed: int = 0):
    rng = np.random.RandomState(seed)
    prompts = [list(rng.randint(3, 300, size=n)) for n in rng.randint(2, 40, size=7)]
    # lengths that are not multiples of the block: rows finish inside a block
    lengths = [1, 3, 5, 9, 14, 22, 31]
    greedy = [
        vSurgeRequest(
            prompt=p, max_tokens=n, temperature=0.0, ignore_eos=True, is_client_side_tokenization=True
        )
        for p, n in zip(prompts, lengths, strict=True)
    ]
    sampled = [
        vSurgeRequest(
            prompt=p,
            max_tokens=n,
            temperature=0.9,
            top_p=0.9,
            seed=100 + i,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=3,
            is_client_side_tokenization=True,
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    return prompts, lengths, greedy, sampled


def test_blocks_give_the_tokens_of_single_steps(tiny):
    model, _ = tiny
    prompts, lengths, _, _ = _requests()
    want = [greedy_generate(model, [p], n)[0] for p, n in zip(prompts, lengths, strict=True)]
    results = {}
    for steps in (1, 4):
        surge = _surge(tiny, steps)
        try:
            assert (surge.driver._decode_engines[0].blocks is None) == (steps == 1)
            _, _, greedy, sampled = _requests()
            with compilations() as seen:
                results[steps] = (_run(surge, greedy), _run(surge, sampled))
            assert not seen, f"compiled on live requests: {seen}"
        finally:
            surge.stop()
    for (ids, _, _, finish), w, n in zip(results[4][0], want, lengths, strict=True):
        assert ids == w and len(ids) == n and finish == "length"  # exact, and no token past max_tokens
    # seeded sampling, logprobs and top logprobs: the same with blocks of 4 as one step at a time
    for one, four in zip(results[1][1], results[4][1], strict=True):
        assert one[0] == four[0]
        np.testing.assert_allclose(one[1], four[1], rtol=1e-5, atol=1e-5)
        assert len(four[2]) == len(four[0]) and one[2] == four[2]


def test_eos_inside_a_block_ends_the_request_there(tiny):
    model, tok = tiny
    prompt = [5, 17, 42, 9, 33]
    ref = greedy_generate(model, [prompt], 12)[0]
    stop_at = ref[6]  # a token the model emits at position 6: made an EOS, it must end the stream there
    surge = _surge(tiny, 4)
    try:
        req = vSurgeRequest(
            prompt=prompt,
            max_tokens=12,
            temperature=0.0,
            stop_token_ids=[stop_at],
            is_client_side_tokenization=True,
        )
        ids, _, _, finish = _run(surge, [req])[0]
    finally:
        surge.stop()
    end = ref.index(stop_at) + 1
    assert ids == ref[:end] and finish == "stop"


def test_decode_steps_is_vdriver_only():
    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(driver="odriver", decode_steps=4)
    assert EngineConfig(driver="odriver").decode_steps is None


@pytest.mark.parametrize(("steps", "ahead", "items"), [(1, 8, 8), (4, 8, 2), (4, 6, 2), (3, 1, 1)])
def test_run_ahead_counts_decode_steps_not_blocks(tiny, steps, ahead, items):
    # detokenizing_blocks bounds how many decode *steps* the step thread may queue ahead of the
    # detokenizer: with blocks of K steps the lane holds ceil(ahead / K) items. Counted in blocks, a TPU
    # 8B engine queued 32 steps (~0.5 s of device work) that every prefill and first token waited behind.
    model, tok = tiny
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=4, prefill_lengths=[16], max_length=32,
        decode_steps=steps, detokenizing_blocks=ahead,
    )  # fmt: skip
    assert [slots.lane.detok.maxsize for slots in s.driver._slots] == [items]


def test_first_tokens_of_a_burst_pass_a_full_detokenize_queue(tiny):
    # The detokenize queue's bound holds back decode steps (the step thread's run-ahead), not first
    # tokens already on the host. When the transfer thread queued them under that bound, each waited for
    # the detokenizer to read a decode block off the device: on the 8B chip run a 64-prompt burst reached
    # its slots in four waves 0.8 s apart. Here the queue is full and nothing drains it: the transfer of a
    # two-prompt pack must still stream both first tokens and hand both requests to the step thread.
    model, tok = tiny
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=4, prefill_lengths=[16], max_length=32,
        decode_steps=4, detokenizing_blocks=1,
    )  # fmt: skip
    driver, engine = s.driver, s.driver._slots[0].engine
    lane = driver._slots[0].lane
    blocker = object()
    lane.detok.put(blocker)
    assert lane.detok.full()
    reqs = [ActiveRequest([5, 6, 7 + i], SamplingParams(max_tokens=4, temperature=0.0)) for i in range(2)]
    prefix = engine.prefill_many([r.prompt_ids for r in reqs], [r.params for r in reqs])
    driver.pipeline.live = True  # the backlog takes puts only while the pipeline runs; no thread is started
    try:
        t = threading.Thread(target=transfer_group, args=(driver, [PrefilledPack(reqs, engine, prefix)]))
        t.start()
        t.join(timeout=60)
        assert not t.is_alive(), "the transfer waited for room in the detokenize queue"
    finally:
        driver.pipeline.live = False
    queued = drain(lane.detok)
    assert queued[0] is blocker
    assert [type(x) for x in queued[1:]] == [FirstToken, FirstToken]
    assert [x.owner.req for x in queued[1:]] == reqs
    assert [x.req for x in drain(lane.backlog)] == reqs
