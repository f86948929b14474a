"""vSurge + oDriver + oEngine on a tiny random model: paged decoding is exact, pages always come back.

Greedy output must equal the reference loop with page sizes that do and do not divide the prompts, with
chunked prefill (prompts past the largest bucket), after preemption and on prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import vsurge
from vsurge import vSurge
from vsurge.contracts.request import PromptTooLongError, RequestFailedError
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.drivers.active_request import ActiveRequest
from vsurge.engines.paged.paging import bytes_per_page
from vsurge.models import greedy_generate
from vsurge.seed_api.request import vSurgeRequest

MAX_LEN = 128
BUCKETS = [16, 32]  # prompts past 32 tokens are prefilled in chunks
SMALL = dict(prefill_lengths=BUCKETS, max_length=MAX_LEN, min_decode_tokens=32)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return vsurge.load_model(path)


def _odriver(model, tok, page_size: int, pages: int, **kw) -> vSurge:
    per_page = bytes_per_page(model.config, page_size, model.dtype)
    s = vSurge.create_odriver(
        model, tok, page_size=page_size, kv_cache_bytes=(pages + 1) * per_page, **{**SMALL, **kw}
    )
    s.compile()
    s.start()
    return s


@pytest.fixture(scope="module")
def surge(tiny):
    s = _odriver(*tiny, page_size=8, pages=64, max_concurrent_decodes=4)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tight(tiny):
    """Page size 5 (divides neither the prompts nor max_length) and 30 pages: one long sequence needs 26."""
    s = _odriver(*tiny, page_size=5, pages=30, max_concurrent_decodes=4)
    yield s
    s.stop()


def _idle(s: vSurge) -> None:
    # the slot is freed by the step thread, the request counted out by the pipeline a moment later
    deadline = time.time() + 5
    while (s.driver.num_used_slots or s.metrics().requests_running) and time.time() < deadline:
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def no_page_leaks(request):
    """After every test: no slot in use, every page free (cached pages count as free), invariants hold."""
    yield
    for name in ("surge", "tight"):
        if name in request.fixturenames:
            s = request.getfixturevalue(name)
            _idle(s)
            m = s.driver.engine.manager
            assert s.driver.num_used_slots == 0, "a test left slots in use"
            assert m.num_free == m.num_pages, f"{m.num_pages - m.num_free} pages leaked"
            m.check()
            assert s.metrics().requests_running == 0


def ids_request(ids, max_tokens, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return vSurgeRequest(
        prompt=[int(t) for t in ids], max_tokens=max_tokens, is_client_side_tokenization=True, **kw
    )


def tokens_of(active: ActiveRequest) -> list[int]:
    return [t for items in active.channel for s in items for t in s.token_ids]


def run_all(s: vSurge, prompts, lengths, **kw) -> list[list[int]]:
    reqs = [s.submit(ids_request(p, n, **kw)) for p, n in zip(prompts, lengths, strict=True)]
    return [tokens_of(r) for r in reqs]


def reference(model, prompts, lengths):
    # one right-padded batch (padding never changes a row's result): one compile instead of one per shape
    rows = greedy_generate(model, prompts, max(lengths))
    return [row[:n] for row, n in zip(rows, lengths, strict=True)]


def test_staggered_greedy_requests_match_reference(surge, tiny):
    model, _ = tiny
    rng = np.random.RandomState(0)
    # multiples of the page size and not, one page, and past the largest prefill bucket (chunked)
    sizes = [1, 7, 8, 16, 17, 31, 32, 33, 48, 64, 75, 100]
    prompts = [list(rng.randint(3, 300, size=n)) for n in sizes]
    lengths = [int(n) for n in rng.randint(1, 24, size=len(sizes))]
    expected = reference(model, prompts, lengths)

    async def run():
        async def one(i):
            await asyncio.sleep(0.01 * i)  # requests join a batch that is already decoding
            ids = []
            async for items in surge.complete(ids_request(prompts[i], lengths[i])):
                ids += [t for s in items for t in s.token_ids]
            return ids

        return await asyncio.gather(*(one(i) for i in range(len(sizes))))

    assert asyncio.run(run()) == expected


def test_long_prompt_is_chunked_not_truncated_and_ends_at_max_length(surge, tiny):
    model, _ = tiny
    prompt = list(np.random.RandomState(1).randint(3, 300, size=120))
    assert surge.max_prompt_length == MAX_LEN - 1  # chunked: any prompt that leaves room for a token
    r = surge.submit(ids_request(prompt, 500))
    got = tokens_of(r)
    assert got == reference(model, [prompt], [MAX_LEN - 120])[0]
    assert r.samples[0].finish_reason == "length"
    with pytest.raises(PromptTooLongError, match="at most 127"):
        surge.submit(ids_request(list(range(3, 3 + MAX_LEN)), 4))


def test_prefix_cache_hit_is_exact_and_counted(surge, tiny):
    model, _ = tiny
    rng = np.random.RandomState(2)
    system = list(rng.randint(3, 300, size=43))  # five full pages and a partial one
    prompts = [system + list(rng.randint(3, 300, size=n)) for n in (4, 9, 0)]
    hits, hit_pages = surge.driver.engine.manager.hits, surge.driver.engine.manager.hit_pages
    first = run_all(surge, prompts[:1], [12])
    rest = run_all(surge, prompts[1:], [12, 12])
    assert first + rest == reference(model, prompts, [12] * 3)
    m = surge.driver.engine.manager
    assert m.hits - hits == 2 and m.hit_pages - hit_pages == 10
    assert surge.metrics().prefix_cache_hits_total == m.hits


def test_cached_tokens_and_prompt_logprobs_reach_the_caller(surge, tiny):
    # usage.prompt_tokens_details.cached_tokens and prompt_logprobs come with a request's first delta
    from vsurge.seed_api.engines import vEngine

    model, tok = tiny
    prompt = [int(t) for t in np.random.RandomState(9).randint(3, 300, size=50)]

    def first_delta(**kw):
        active = surge.submit(ids_request(prompt, 2, **kw))
        items = [s for batch in active.channel for s in batch]
        return items[0]

    first_delta()  # publishes the prompt's pages
    again = first_delta(prompt_logprobs=3)
    assert again.num_cached_tokens == 48  # six full pages of 8; the last token is always computed
    assert again.prompt_token_ids == prompt
    dense = vEngine(
        model, tok, max_concurrent_decodes=1, **{k: SMALL[k] for k in ("prefill_lengths", "max_length")}
    )
    want = dense.score_prompt(prompt, 3)
    got = again.prompt_logprobs
    assert got[0] is None and len(got) == len(want) == len(prompt)
    for a, b in zip(got[1:], want[1:], strict=True):
        assert a.token_id == b.token_id and a.rank == b.rank
        np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-5)


def test_n_samples_share_the_prompt_pages(surge):
    prompt = list(range(3, 23))  # two full pages
    base = dict(temperature=1.0, seed=1234)
    one = run_all(surge, [prompt], [10], **base)[0]
    hits = surge.driver.engine.manager.hits
    r = surge.submit(ids_request(prompt, 10, n=3, **base))
    by_index: dict[int, list[int]] = {}
    for items in r.channel:
        for s in items:
            by_index.setdefault(s.index, []).extend(s.token_ids)
    assert by_index[0] == one  # sample 0 of n is the n=1 request with the same seed
    assert len({tuple(v) for v in by_index.values()}) == 3
    assert surge.driver.engine.manager.hits - hits >= 2  # samples 1 and 2 reuse sample 0's prompt pages


def test_preemption_recomputes_exactly(tight, tiny):
    model, _ = tiny
    rng = np.random.RandomState(3)
    prompts = [list(rng.randint(3, 300, size=n)) for n in (9, 23, 40, 12)]
    lengths = [80, 70, 60, 90]  # 4 sequences of 90-100 tokens: ~76 pages wanted, 30 there
    before = tight.metrics().preemptions_total
    got = run_all(tight, prompts, lengths)
    assert tight.metrics().preemptions_total > before
    assert got == reference(model, prompts, lengths)


def test_seeded_sampling_survives_preemption(tight):
    prompt = list(range(5, 14))
    kw = dict(temperature=1.0, seed=7, frequency_penalty=0.5, top_k=50)
    alone = run_all(tight, [prompt], [70], **kw)[0]
    before = tight.metrics().preemptions_total
    crowd = [list(range(40, 40 + n)) for n in (8, 10, 12)]
    reqs = [tight.submit(ids_request(p, 90)) for p in crowd]
    time.sleep(0.05)  # the seeded request arrives last: the youngest, so the one preempted
    mine = tight.submit(ids_request(prompt, 70, **kw))
    assert tokens_of(mine) == alone
    for r in reqs:
        assert len(tokens_of(r)) == 90
    assert tight.metrics().preemptions_total > before


def test_cancel_frees_slot_and_pages_at_once(surge):
    async def run():
        gen = surge.complete(ids_request([1, 2, 3], MAX_LEN - 10))
        await gen.__anext__()
        assert surge.driver.num_used_slots == 1
        assert surge.metrics().pages_used >= 1
        await gen.aclose()
        deadline = time.time() + 2
        while surge.driver.num_used_slots and time.time() < deadline:
            await asyncio.sleep(0.005)
        return surge.driver.num_used_slots, surge.metrics().pages_used

    assert asyncio.run(run()) == (0, 0)


def test_failed_requests_fail_alone(surge, monkeypatch):
    eng = surge.driver.engine
    good = surge.submit(ids_request([4, 5, 6], 8))
    too_long = ActiveRequest(list(range(3, 3 + MAX_LEN)), SamplingParams(max_tokens=4, temperature=0.0))
    bad_id = ActiveRequest([5, 10**6], SamplingParams(max_tokens=4, temperature=0.0))
    surge.driver.submit_request(too_long)
    surge.driver.submit_request(bad_id)
    with pytest.raises(RequestFailedError, match="prefill failed.*no room to generate within max_length"):
        list(too_long.channel)
    with pytest.raises(RequestFailedError, match="prefill failed"):
        list(bad_id.channel)
    assert len(tokens_of(good)) == 8

    real = eng.step

    def flaky(state, table, active, chunks=()):
        if any(c.start == 0 and c.tokens[0] == 299 for c in chunks):
            raise RuntimeError("device said no")
        return real(state, table, active, chunks)

    monkeypatch.setattr(eng, "step", flaky)
    # `fine` decodes while the failing chunk's step runs: the step's decode rows survive it. (A request
    # whose chunk shares that step fails with it: the step is one device call.)
    fine = surge.submit(ids_request([7, 8, 9], 40))
    stream = iter(fine.channel)
    head = next(stream)
    doomed = surge.submit(ids_request([299] + list(range(3, 50)), 5, n=2))
    with pytest.raises(RequestFailedError, match="device said no"):
        tokens_of(doomed)
    assert len([t for items in [head, *stream] for s in items for t in s.token_ids]) == 40


def test_metrics_report_pages(surge):
    m = surge.metrics()
    assert m.pages_total == 64 and m.pages_used == 0
    r = surge.submit(ids_request(list(range(3, 40)), 40))
    next(iter(r.channel))
    assert surge.metrics().pages_used >= 5  # 37 prompt tokens in pages of 8
    tokens_of(r)


def test_stop_aborts_returns_every_page_and_restarts(surge, tiny):
    model, _ = tiny
    running = surge.submit(ids_request([1, 2, 3], MAX_LEN - 8))
    next(iter(running.channel))
    queued = [surge.submit(ids_request(list(range(3, 60)), 50)) for _ in range(6)]
    surge.stop()
    reasons = [x.finish_reason for items in running.channel for x in items if x.finish_reason]
    assert reasons == ["abort"]
    for r in queued:
        assert [x.finish_reason for items in r.channel for x in items if x.finish_reason] in (
            ["abort"],
            ["length"],
        )
    m = surge.driver.engine.manager
    assert m.num_free == m.num_pages and m.num_cached == 0  # the pages' contents are gone with the state
    surge.start()
    assert run_all(surge, [[9, 8, 7]], [5]) == reference(model, [[9, 8, 7]], [5])


def test_cancellations_at_any_moment_always_end_the_request(surge):
    """Cancel while queued, prefilling, decoding, or just after the last token was dispatched: every request
    still ends (its channel closes) and every page comes back."""
    rng = np.random.RandomState(4)
    reqs = [
        surge.submit(ids_request(list(rng.randint(3, 300, size=rng.randint(1, 60))), int(rng.randint(1, 8))))
        for _ in range(24)
    ]
    for r, delay in zip(reqs, rng.uniform(0, 0.02, size=len(reqs)), strict=True):
        time.sleep(delay)
        r.cancel()
    ended = []

    def drain(r):
        list(r.channel)
        ended.append(r)

    threads = [threading.Thread(target=drain, args=(r,), daemon=True) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(ended) == len(reqs), f"{len(reqs) - len(ended)} cancelled requests never ended"


def test_pages_sharded_over_kv_heads_on_a_mesh(tiny):
    """tp=4 on 8 fake devices: one kv head of every page per device, and the same tokens as unsharded."""
    from vsurge.models.sharding import make_mesh

    model, tok = tiny
    s = _odriver(
        model,
        tok,
        page_size=8,
        pages=16,
        max_concurrent_decodes=2,
        mesh=make_mesh("tp=4"),
        prefill_lengths=[32],
        max_length=64,
    )
    try:
        k, _ = s.driver.engine.init_decode_state().pages[0]  # a fresh state: the driver holds its own
        assert k.sharding.shard_shape(k.shape) == (17, 8, 1, 8)
        prompts = [[5, 6, 7], list(range(10, 50))]  # the second one is prefilled in two chunks
        assert run_all(s, prompts, [12, 12]) == reference(model, prompts, [12, 12])
    finally:
        s.stop()
    m = s.driver.engine.manager
    assert m.num_free == m.num_pages


def test_no_compilation_on_live_requests(tiny_checkpoint):
    from jit_watch import compiled_while_serving

    # a model of its own: the module's `tiny` may have been placed on a mesh by an earlier test
    model, tok = vsurge.load_model(tiny_checkpoint("llama", heads=8, kv_heads=4)[0])
    per_page = bytes_per_page(model.config, 8, model.dtype)
    s = vSurge.create_odriver(
        model, tok, page_size=8, kv_cache_bytes=65 * per_page, max_concurrent_decodes=4, **SMALL
    )
    s.compile()
    compiled = compiled_while_serving(s)
    assert not compiled, compiled
