"""vSurge + vDriver + vEngine on a tiny random model: continuous batching is exact, resources come back."""

import asyncio
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import vsurge
from vsurge import vSurge
from vsurge.contracts.request import PromptTooLongError, QueueFullError, RequestFailedError
from vsurge.contracts.sampling_params import InvalidSamplingParams, SamplingParams
from vsurge.drivers.active_request import ActiveRequest
from vsurge.models import greedy_generate
from vsurge.seed_api.request import vSurgeRequest

MAX_LEN = 128
BUCKETS = [16, 64]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return vsurge.load_model(path)


@pytest.fixture(scope="module")
def surge(tiny):
    model, tok = tiny
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=4, prefill_lengths=BUCKETS, max_length=MAX_LEN
    )
    s.compile()
    s.start()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def slots_come_back(request):
    yield
    if "surge" in request.fixturenames:
        s = request.getfixturevalue("surge")
        # the slot is freed by the step thread, the request counted out by the pipeline a moment later
        # (after its stream ended): wait for both, so only a leak fails here
        deadline = time.time() + 5
        while (s.driver.num_used_slots or s.metrics().requests_running) and time.time() < deadline:
            time.sleep(0.01)
        assert s.driver.num_used_slots == 0, "a test left slots in use"
        assert s.metrics().requests_running == 0, "a test left a request running"


def ids_request(ids, max_tokens, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return vSurgeRequest(prompt=list(ids), max_tokens=max_tokens, is_client_side_tokenization=True, **kw)


async def collect(surge, req):
    text, ids, finish = {}, {}, {}
    async for items in surge.complete(req):
        for s in items:
            text[s.index] = text.get(s.index, "") + s.text
            ids.setdefault(s.index, []).extend(s.token_ids)
            finish[s.index] = s.finish_reason
    return text, ids, finish


def test_staggered_greedy_requests_match_reference(surge, tiny):
    model, _ = tiny
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, 300, size=n)) for n in rng.randint(1, 60, size=16)]
    lengths = [int(n) for n in rng.randint(1, 24, size=16)]
    expected = [greedy_generate(model, [p], n)[0] for p, n in zip(prompts, lengths, strict=True)]

    async def run():
        async def one(i):
            await asyncio.sleep(0.01 * i)  # staggered: requests join a batch that is already decoding
            _, ids, finish = await collect(surge, ids_request(prompts[i], lengths[i]))
            return ids[0], finish[0]

        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(run())
    for i, (ids, finish) in enumerate(results):
        assert ids == expected[i], f"prompt {i}"
        assert len(ids) == lengths[i] and finish == "length"


def test_max_tokens_exact_and_text_matches_tokens(surge):
    text, ids, finish = asyncio.run(
        collect(surge, vSurgeRequest(prompt="Hello world", max_tokens=7, temperature=0.0, ignore_eos=True))
    )
    assert len(ids[0]) == 7 and finish[0] == "length"
    assert text[0] == surge.processor.decode(ids[0], skip_special_tokens=True)


def test_stop_string_is_cut(surge):
    req = dict(prompt="The capital of", max_tokens=24, temperature=0.0, ignore_eos=True)
    text, ids, _ = asyncio.run(collect(surge, vSurgeRequest(**req)))
    full = text[0]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"need a visible stop string from {full!r}"
    cut, _, finish = asyncio.run(collect(surge, vSurgeRequest(**req, stop=[stop])))
    assert cut[0] == full[: full.index(stop)]
    assert finish[0] == "stop"


def test_same_seed_same_samples_and_n_shares_prefill(surge):
    base = dict(
        prompt=[5, 6, 7, 8], max_tokens=12, temperature=1.0, ignore_eos=True, is_client_side_tokenization=True
    )
    _, a, _ = asyncio.run(collect(surge, vSurgeRequest(**base, seed=1234)))
    _, b, _ = asyncio.run(collect(surge, vSurgeRequest(**base, seed=1234)))
    _, c, _ = asyncio.run(collect(surge, vSurgeRequest(**base, seed=99)))
    assert a == b
    assert a != c
    _, many, finish = asyncio.run(collect(surge, vSurgeRequest(**base, seed=1234, n=3)))
    assert sorted(many) == [0, 1, 2] and set(finish.values()) == {"length"}
    assert many[0] == a[0]  # sample 0 of n is the n=1 request with the same seed
    assert len({tuple(v) for v in many.values()}) == 3


def test_cancel_frees_slot_at_once(surge):
    async def run():
        gen = surge.complete(ids_request([1, 2, 3], MAX_LEN - 10))
        await gen.__anext__()
        # the first token streams before the insert: the slot is taken a moment later
        deadline = time.time() + 5
        while surge.driver.num_used_slots != 1 and time.time() < deadline:
            await asyncio.sleep(0.005)
        assert surge.driver.num_used_slots == 1
        await gen.aclose()
        deadline = time.time() + 2
        while surge.driver.num_used_slots and time.time() < deadline:
            await asyncio.sleep(0.005)
        return surge.driver.num_used_slots

    assert asyncio.run(run()) == 0


def test_largest_bucket_may_equal_max_length(tiny):
    # default buckets run up to max_length; such a bucket holds max_length - 1 prompt tokens
    model, tok = tiny
    s = vSurge.create_vdriver(model, tok, max_concurrent_decodes=2, max_length=64)
    assert s.driver.engines[0].prefill_lengths[-1] == 64
    s.compile()
    s.start()
    try:
        _, ids, finish = asyncio.run(collect(s, ids_request(list(range(3, 66)), 5)))
    finally:
        s.stop()
    assert len(ids[0]) == 1 and finish[0] == "length"


def test_max_length_ends_with_length(surge):
    _, ids, finish = asyncio.run(collect(surge, ids_request(list(range(3, 63)), 500)))
    assert len(ids[0]) == MAX_LEN - 60 and finish[0] == "length"


def test_bad_input_raises_clear_errors(surge):
    # prompts longer than the largest bucket (64) are prefilled in chunks: the limit is the context
    with pytest.raises(PromptTooLongError, match=f"at most {MAX_LEN - 1}"):
        asyncio.run(collect(surge, ids_request(list(range(3, 3 + MAX_LEN)), 4)))
    # asked for more than the context holds: an error, not a silent cut
    with pytest.raises(PromptTooLongError, match="maximum context length is 128"):
        asyncio.run(collect(surge, ids_request(list(range(3, 103)), 40, strict_max_tokens=True)))
    with pytest.raises(InvalidSamplingParams, match="max_tokens"):
        asyncio.run(collect(surge, ids_request([1, 2], -1)))
    with pytest.raises(ValueError, match="3 prompts but 2 sampling_params"):
        asyncio.run(surge.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()]))
    with pytest.raises(ValueError):
        surge.count_tokens(42)
    assert surge.count_tokens("Hello world") == len(surge.processor.encode("Hello world"))
    assert surge.count_tokens([{"role": "user", "content": "hi"}]) > surge.count_tokens("hi")
    with pytest.raises(TypeError, match="ActiveRequest"):
        surge.driver.submit_request({"prompt": "x"})


def test_prompt_longer_than_every_bucket_is_served_exactly(surge, tiny):
    model, _ = tiny
    prompt = list(range(3, 103))  # 100 tokens > the 64 bucket
    _, ids, finish = asyncio.run(collect(surge, ids_request(prompt, 12)))
    assert ids[0] == greedy_generate(model, [prompt], 12)[0]
    assert finish[0] == "length"


def test_failed_request_fails_alone(surge):
    # A prompt the engine cannot prefill (the whole context, no room for a token) reaching the driver
    # directly: it fails with a clear reason while a concurrent request completes.
    bad = ActiveRequest(
        list(range(3, 3 + MAX_LEN)), SamplingParams(max_tokens=4, temperature=0.0), eos_token_ids=[]
    )
    good = surge.submit(ids_request([4, 5, 6], 8))
    surge.driver.submit_request(bad)
    with pytest.raises(RequestFailedError, match="prefill failed.*leaves no room"):
        list(bad.channel)
    got = [t for items in good.channel for s in items for t in s.token_ids]
    assert len(got) == 8


def test_generate_non_stream_and_stream(surge):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    out = asyncio.run(surge.generate(["Hello", "Paris is"], params))
    assert [len(r.token_ids) for r in out] == [5, 5]

    async def streamed():
        n = 0
        async for items in await surge.generate(["Hello", "Paris is"], params, stream=True):
            n += sum(len(s.token_ids) for s in items)
        return n

    assert asyncio.run(streamed()) == 10


def test_queue_full_raises(tiny):
    model, tok = tiny
    # not compiled: the first prefill compiles for a while, so a tight submit loop fills the queue of 2
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=2, prefill_lengths=[16], max_length=32, max_queue_size=2
    )
    s.start()
    submitted = []
    try:
        with pytest.raises(QueueFullError, match="queue is full"):
            for _ in range(50):
                submitted.append(s.submit(ids_request([1, 2], 2)))
        assert isinstance(QueueFullError("x"), RuntimeError)
        assert 2 <= len(submitted) < 50
    finally:
        for r in submitted:
            r.cancel()
        s.stop()


def test_burst_is_held_back_by_the_bounded_queues(surge):
    """Requests arriving faster than the slots drain them end in QueueFullError once the bounded queues are
    full: the step thread takes prefilled prompts in only as fast as it can seat them, so no unbounded
    list of prefilled prompts (each holding its KV on the device) grows behind the slots."""
    import time

    drv = surge.driver
    q = drv.pipeline.prefill_q
    accepted, refused = [], 0
    saved = q.maxsize
    q.maxsize = 4  # the module's surge has the default queue of 1024
    try:
        deadline = time.monotonic() + 60
        while not refused and time.monotonic() < deadline:
            try:
                accepted.append(surge.submit(ids_request([1, 2, len(accepted) % 50 + 3], MAX_LEN - 8)))
            except QueueFullError:
                refused += 1
            time.sleep(0.002)  # arrivals a prefill call can keep up with: only the slots hold them back
        assert refused, f"{len(accepted)} requests accepted in 60 s and none refused"
        waiting = max(len(s.waiting) for s in drv._slots)
        assert waiting <= surge._engine.max_concurrent_decodes
        # slots + their waiting + backlog (2 x slots) + transfer queue + one prefill call + the queue
        slots = surge._engine.max_concurrent_decodes
        bound = (
            slots + slots + 2 * slots + drv._transfer_q.maxsize + 2 * surge._engine.max_concurrent_prefill + 4
        )
        assert len([r for r in accepted if not r.done]) <= bound
    finally:
        q.maxsize = saved
        for r in accepted:
            r.cancel()
        # the cancelled requests still queued end as the feeders reach them; the next test starts after
        deadline = time.monotonic() + 30
        while any(not r.done for r in accepted) and time.monotonic() < deadline:
            time.sleep(0.01)


def test_interleaved_mode_serves(tiny):
    model, tok = tiny
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=2, prefill_lengths=[16], max_length=32, interleaved_mode=True
    )
    s.start()
    try:
        reqs = [s.submit(ids_request([1, 2, i], 5)) for i in range(3, 7)]
        assert [sum(len(x.token_ids) for items in r.channel for x in items) for r in reqs] == [5] * 4
    finally:
        s.stop()


def test_disaggregated_prefill_and_decode_on_separate_devices(tiny_checkpoint):
    import jax

    from vsurge.drivers.dense.vdriver import vDriver
    from vsurge.models.sharding import make_mesh
    from vsurge.seed_api.engines import vEngine

    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    model, tok = vsurge.load_model(path)
    devs = jax.devices()
    kw = dict(max_concurrent_decodes=4, prefill_lengths=[16], max_length=64)
    pre = vEngine(model, tok, mesh=make_mesh("tp=4", devs[:4]), **kw)
    dec = vEngine(model, tok, mesh=make_mesh("tp=4", devs[4:]), **kw)

    def devices(engine):
        return {
            d.id
            for d in engine.params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
            .get_value()
            .devices()
        }

    # each engine keeps its own placement of the one model's weights (dec's did not move pre's)
    assert devices(dec) == {4, 5, 6, 7} and devices(pre) == {0, 1, 2, 3}
    disagg = vSurge(vDriver(pre, dec))
    disagg.start()
    prompts = [[3, 4, 5], list(range(10, 22)), [7]]
    try:
        got = [
            [t for items in disagg.submit(ids_request(p, 10)).channel for s in items for t in s.token_ids]
            for p in prompts
        ]
    finally:
        disagg.stop()
    assert got == [greedy_generate(model, [p], 10)[0] for p in prompts]
    whole = vSurge(vDriver(vEngine(model, tok, mesh=make_mesh("tp=8"), **kw)))
    whole.start()
    try:
        on_eight = [
            [t for items in whole.submit(ids_request(p, 10)).channel for s in items for t in s.token_ids]
            for p in prompts
        ]
    finally:
        whole.stop()
    assert on_eight == got


def test_stop_is_graceful_and_aborts_running(tiny):
    model, tok = tiny
    s = vSurge.create_vdriver(model, tok, max_concurrent_decodes=2, prefill_lengths=[16], max_length=MAX_LEN)
    s.start()
    req = s.submit(ids_request([1, 2, 3], MAX_LEN - 8))
    first = next(iter(req.channel))
    assert first
    threading.Timer(0.05, s.stop).start()
    reasons = [x.finish_reason for items in req.channel for x in items if x.finish_reason]
    assert reasons in (["abort"], ["length"])
    assert s.driver.num_used_slots == 0 or not s.driver.live


def test_stop_ends_requests_still_waiting_for_a_slot(tiny):
    model, tok = tiny
    s = vSurge.create_vdriver(model, tok, max_concurrent_decodes=1, prefill_lengths=[16], max_length=MAX_LEN)
    s.start()
    reqs = [s.submit(ids_request([1, 2, i], MAX_LEN - 8)) for i in range(3, 7)]
    next(iter(reqs[0].channel))  # one decodes, the others wait for its slot
    s.stop()
    done = threading.Event()

    def drain():
        for r in reqs:
            for _ in r.channel:
                pass
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    assert done.wait(10), "a request still queued at stop() never ended"
    assert all(r.done for r in reqs)


def test_first_token_streams_before_a_slot_is_free(tiny):
    """With every slot busy, a prefilled request's first token reaches the client at once (it does not
    wait for a slot); the insert reuses that token, and a request its first token finishes takes no slot."""
    model, tok = tiny
    # long busy requests (500 steps) against one prefill and a first-token sample: a wide margin under load
    s = vSurge.create_vdriver(model, tok, max_concurrent_decodes=2, prefill_lengths=[16], max_length=512)
    s.start()
    try:
        busy = [s.submit(ids_request([1, 2, i], 500)) for i in (3, 4)]
        for r in busy:
            next(iter(r.channel))  # both slots are decoding
        prompt = [7, 8, 9, 10]
        waits = s.submit(ids_request(prompt, 6))
        one_token = s.submit(ids_request(prompt, 1))
        sampled = s.submit(ids_request(prompt, 1, temperature=1.0, seed=7, n=2))
        gone = s.submit(ids_request(prompt, 50))  # cancelled after its early first token: no slot, no leak
        next(iter(gone.channel))
        gone.cancel()
        first_at = {}

        def read(name, r):
            items = []
            for deltas in r.channel:
                first_at.setdefault(name, time.time())
                items += deltas
            return items

        got = {}
        readers = [
            threading.Thread(target=lambda n=n, r=r: got.__setitem__(n, read(n, r)))
            for n, r in [("waits", waits), ("one", one_token), ("sampled", sampled), ("a", busy[0])]
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join(timeout=60)
        assert all(r.done for r in [*busy, waits, one_token, sampled])
        list(gone.channel)  # ends once the driver sees the cancel (at the latest when a slot frees)
        assert gone.done and gone.samples[0].finish_reason == "abort"
        a_done = min(r.metadata.finished_at for r in busy)
        for name in ("waits", "one", "sampled"):
            assert first_at[name] < a_done, f"{name}'s first token waited for a slot"
        assert one_token.metadata.finished_at < a_done and sampled.metadata.finished_at < a_done
        # the token streamed early is the one the slot continues from: greedy output is exact
        want = greedy_generate(model, [prompt], 6)[0]
        assert [t for d in got["waits"] for t in d.token_ids] == want
        assert [t for d in got["one"] for t in d.token_ids] == want[:1]
        assert sorted(d.index for d in got["sampled"] if d.token_ids) == [0, 1]
        deadline = time.time() + 5
        while s.driver.num_used_slots and time.time() < deadline:
            time.sleep(0.01)
        assert s.driver.num_used_slots == 0
    finally:
        s.stop()


class _CountingEngine:
    """Counts the decode and verify steps a vEngine runs (the engine itself runs unchanged)."""

    @staticmethod
    def build(model, tok, **kw):
        from vsurge.seed_api.engines import vEngine

        class Counting(vEngine):
            steps = 0

            def decode(self, state):
                Counting.steps += 1
                return super().decode(state)

            def verify(self, state, draft, num_draft):
                Counting.steps += 1
                return super().verify(state, draft, num_draft)

        return Counting(model, tok, **kw)


@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_a_slot_runs_no_step_past_its_last_token(tiny, speculative):
    """max_tokens is known on the host: the step thread frees a slot the step its last token is
    dispatched, without waiting for the detokenizer (which lags by the steps in flight), so a request of
    N tokens costs N - 1 decode steps (the first comes from prefill) and no more."""
    from vsurge.drivers.dense.vdriver import vDriver

    model, tok = tiny
    kw = dict(max_concurrent_decodes=2, prefill_lengths=[16], max_length=MAX_LEN)
    if speculative == "ngram":
        kw.update(speculative="ngram", num_speculative_tokens=2)
    engine = _CountingEngine.build(model, tok, **kw)
    s = vSurge(vDriver(engine, detokenizing_blocks=8))
    s.start()
    try:
        # greedy, so the count is deterministic: with speculation, these continuations draft nothing
        for n in (1, 2, 7):
            before = type(engine).steps
            got = [
                t
                for items in s.submit(ids_request([3, 4, 5, 6], n)).channel
                for x in items
                for t in x.token_ids
            ]
            assert len(got) == n
            deadline = time.time() + 5
            while s.driver.num_used_slots and time.time() < deadline:
                time.sleep(0.01)
            assert s.driver.num_used_slots == 0
            time.sleep(0.2)  # a step thread running past the end would step now
            assert type(engine).steps - before == n - 1, f"max_tokens {n}"
    finally:
        s.stop()


def _engine_greedy(engine, prefix, entries, steps):
    """Insert entries (index, slot) of one prefix and decode greedily; returns each slot's tokens."""
    state = engine.init_decode_state()
    out = {slot: [] for _, slot in entries}
    for j, slot in entries:
        state, first = engine.insert(prefix, state, slot, index=j)
        out[slot].append(int(np.asarray(first.tokens)[0]))
    for _ in range(steps - 1):
        state, res = engine.decode(state)
        toks = np.asarray(res.tokens)
        for _, slot in entries:
            out[slot].append(int(toks[slot]))
    for _, slot in entries:
        engine.free_resource(slot)
    return out


def test_packed_prefill_equals_reference(tiny):
    # Several prompts prefilled in one call, packed one after another in one bucket: each entry's cache
    # and first token are its own prompt's, whatever its neighbours are.
    from vsurge.seed_api.engines import vEngine

    model, tok = tiny
    engine = vEngine(model, tok, max_concurrent_decodes=4, prefill_lengths=[16, 64], max_length=MAX_LEN)
    prompts = [[7, 8, 9], list(range(20, 45)), [11] * 9, list(range(100, 117))]
    greedy = SamplingParams(temperature=0.0)
    prefix = engine.prefill_many(prompts, [greedy] * 4)
    assert prefix.kv[0][0].shape[:2] == (1, 64)  # 3 + 25 + 9 + 17 = 54 tokens share the 64 bucket
    got = _engine_greedy(engine, prefix, [(0, 2), (1, 0), (2, 3), (3, 1)], 12)
    want = [greedy_generate(model, [p], 12)[0] for p in prompts]
    assert [got[2], got[0], got[3], got[1]] == want
    with pytest.raises(ValueError, match="exceeds max_prefill_length"):
        engine.prefill_many([list(range(3, 70)), [5, 6]], [greedy] * 2)  # 67 + 2 > 64, and 67 > a row


def test_multi_row_prefill_equals_reference(tiny):
    # Prompts beyond one row's tokens go into rows of prefill_pack_tokens, each row its own attention,
    # first fit: every entry's cache and first token are still its own prompt's.
    from vsurge.seed_api.engines import vEngine

    model, tok = tiny
    engine = vEngine(
        model,
        tok,
        max_concurrent_decodes=4,
        prefill_lengths=[16, 32],
        max_length=MAX_LEN,
        prefill_pack_tokens=32,
        prefill_pack_rows=4,
    )
    assert engine.pack_rows == [2, 4]
    rng = np.random.RandomState(4)
    prompts = [list(rng.randint(3, 300, size=n)) for n in (20, 30, 9, 2)]  # rows: [20, 9, 2], [30]
    greedy = SamplingParams(temperature=0.0)
    assert engine.pack_rows_for([len(p) for p in prompts]) == 2
    prefix = engine.prefill_many(prompts, [greedy] * 4)
    assert prefix.kv[0][0].shape[:2] == (2, 32)
    assert list(np.asarray(prefix.starts)[:4]) == [0, 32, 20, 29]
    got = _engine_greedy(engine, prefix, [(0, 1), (1, 3), (2, 0), (3, 2)], 10)
    want = [greedy_generate(model, [p], 10)[0] for p in prompts]
    assert [got[1], got[3], got[0], got[2]] == want
    # three full rows run as four (the compiled count); five do not fit the largest, 4
    assert engine.pack_rows_for([30, 30, 30]) == 4
    assert engine.pack_rows_for([30] * 5) is None
    assert engine.pack_rows_for([30, 30, 30], max_rows=2) is None  # a busy driver's smaller calls
    assert engine.pack_rows_for([30, 30], max_rows=2) == 2
    assert engine.pack_rows_for([33, 2]) is None  # 33 fits no row and no bucket
    one_row = vEngine(
        model,
        tok,
        max_concurrent_decodes=4,
        prefill_lengths=[16, 64],
        max_length=MAX_LEN,
        prefill_pack_tokens=32,
        prefill_pack_rows=1,
    )
    assert one_row.pack_rows == [] and one_row.pack_rows_for([30, 30]) == 1  # one 64 row, as before


def test_first_sampled_before_insert_continues_like_insert(tiny):
    # sample_first then insert(first=) must give the tokens insert alone gives, for sampled requests too:
    # the same key draws the first token, and the slot's sampler stream goes on from it.
    from vsurge.seed_api.engines import vEngine

    model, tok = tiny
    engine = vEngine(model, tok, max_concurrent_decodes=2, prefill_lengths=[16], max_length=MAX_LEN)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (5, 6)]
    prefix = engine.prefill_many([[7, 8, 9], [4, 5, 6, 7]], params)

    def run(early: bool, key=None) -> list[list[int]]:
        state = engine.init_decode_state()
        out = []
        for j in (0, 1):
            first = engine.sample_first(prefix, key, j) if early else None
            state, got = engine.insert(prefix, state, j, key, j, first=first)
            out.append([int(np.asarray(got.tokens)[0])])
        for _ in range(10):
            state, res = engine.decode(state)
            for j in (0, 1):
                out[j].append(int(np.asarray(res.tokens)[j]))
        for j in (0, 1):
            engine.free_resource(j)
        return out

    assert run(True) == run(False)
    other = np.asarray([0, 77], np.uint32)  # a sample's own key (n > 1), not the entry's
    assert run(True, other) == run(False, other) != run(False)


def test_long_rows_cross_decode_chunks_exactly(tiny):
    # Decode reads the cache in chunks of 128 up to the longest live row; with max_length 300 the third
    # chunk is shifted back to fit. A 250-token prompt decoded past position 256 beside a short one.
    from vsurge.seed_api.engines import vEngine

    model, tok = tiny
    engine = vEngine(model, tok, max_concurrent_decodes=2, prefill_lengths=[64, 256], max_length=300)
    rng = np.random.RandomState(7)
    prompts = [list(rng.randint(3, 300, size=250)), [4, 5, 6]]
    greedy = SamplingParams(temperature=0.0)
    got = _engine_greedy(engine, engine.prefill_many(prompts, [greedy] * 2), [(0, 0), (1, 1)], 40)
    assert [got[0], got[1]] == [greedy_generate(model, [p], 40)[0] for p in prompts]


def test_bfloat16_kv_cache_decodes_within_bfloat16_rounding(tiny):
    # kv_cache_dtype=bfloat16 keeps the dense cache as bfloat16 bits (half the bytes a step reads): each
    # step's logits stay within bfloat16 rounding of the float32 cache's, and are not identical to them
    # (the rounding is really there).
    from vsurge.models.attention import KV_BITS, kv_load, kv_store
    from vsurge.seed_api.engines import vEngine

    x = np.random.RandomState(0).standard_normal((4, 64)).astype(np.float32)
    want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    assert np.array_equal(np.asarray(kv_load(kv_store(jnp.asarray(x), KV_BITS))), want)

    model, tok = tiny
    kw = dict(max_concurrent_decodes=2, prefill_lengths=[64], max_length=MAX_LEN)
    f32, bf16 = vEngine(model, tok, **kw), vEngine(model, tok, kv_cache_dtype="bfloat16", **kw)
    assert f32.cache_dtype == model.dtype and bf16.cache_dtype == KV_BITS
    prompt = list(np.random.RandomState(2).randint(3, 300, size=40))
    greedy = SamplingParams(temperature=0.0)
    logits = []
    for engine in (f32, bf16):
        state = engine.init_decode_state()
        assert state.caches[0][0].dtype == engine.cache_dtype
        state, _ = engine.insert(engine.prefill(prompt, greedy), state, 0)
        steps = []
        for _ in range(6):
            state, out = engine.decode_logits(state)
            steps.append(np.asarray(out[0]))
            state, _ = engine.decode_sample(state, out, np.full((2, -(-model.config.vocab_size // 32)), -1))
        logits.append(np.stack(steps))
    gap = np.abs(logits[0] - logits[1]).max()
    assert 0 < gap < 0.05 * np.abs(logits[0]).max(), gap


def _dtypes(tree) -> dict[str, set]:
    import jax

    out: dict[str, set] = {}
    for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = next(
            (k.key for k in reversed(path) if getattr(k, "key", None) in ("kernel", "embedding")), "other"
        )
        out.setdefault(name, set()).add(jnp.dtype(a.dtype).name)
    return out


def test_bfloat16_prefill_matches_float32_within_rounding(tiny):
    # prefill_dtype=bfloat16 runs packed prefill on a bfloat16 copy of the float32 matmul kernels while
    # activations stay float32: the prompt's K/V and last hidden state keep the model's dtype, close to
    # the float32 prefill's; decode keeps the float32 weights; a driver built that way serves a burst of
    # requests to their lengths.
    from vsurge.seed_api.engines import vEngine

    model, tok = tiny
    kw = dict(max_concurrent_decodes=4, prefill_lengths=[64], max_length=MAX_LEN)
    f32, bf16 = vEngine(model, tok, **kw), vEngine(model, tok, prefill_dtype="bfloat16", **kw)
    assert f32.prefill_params is f32.params
    assert _dtypes(bf16.prefill_params) == {
        "kernel": {"bfloat16"},
        "embedding": {"float32"},
        "other": {"float32"},
    }
    assert _dtypes(bf16.params) == {"kernel": {"float32"}, "embedding": {"float32"}, "other": {"float32"}}
    assert all(bf16.step_params(r) is bf16.params for r in bf16.decode_rows)
    prompts = [list(np.random.RandomState(3).randint(3, 300, size=n)) for n in (9, 30)]
    greedy = SamplingParams(temperature=0.0)
    a, b = (e.prefill_many(prompts, [greedy] * 2) for e in (f32, bf16))
    assert b.hidden.dtype == b.kv[0][0].dtype == a.hidden.dtype == jnp.float32
    for x, y in [(a.hidden, b.hidden), *((ka, kb) for (ka, _), (kb, _) in zip(a.kv, b.kv, strict=True))]:
        x, y = np.asarray(x), np.asarray(y)
        gap = np.abs(x - y).max()
        assert 0 < gap < 0.05 * np.abs(x).max(), gap

    s = vSurge.create_vdriver(model, tok, prefill_dtype="bfloat16", kv_cache_dtype="bfloat16", **kw)
    s.compile()
    s.start()
    try:
        actives = [s.submit(ids_request(p, 7)) for p in prompts * 3]
        got = [[t for items in r.channel for x in items for t in x.token_ids] for r in actives]
    finally:
        s.stop()
    assert [len(g) for g in got] == [7] * 6
    assert s.driver.num_used_slots == 0


def test_bfloat16_decode_runs_from_eight_rows_within_rounding(tiny):
    # decode_dtype=bfloat16: decode steps of BF16_DECODE_MIN_ROWS rows or more run on the bfloat16 copy,
    # smaller ones on the float32 weights (XLA:CPU's bfloat16 matrix-vector path is slow). One live row:
    # the same logits as a float32 engine; a row in slot 7 (the 8-row step): close, not equal.
    from vsurge.engines.dense.bf16_weights import BF16_DECODE_MIN_ROWS
    from vsurge.seed_api.engines import vEngine

    model, tok = tiny
    kw = dict(max_concurrent_decodes=8, prefill_lengths=[64], max_length=MAX_LEN)
    f32, bf16 = vEngine(model, tok, **kw), vEngine(model, tok, decode_dtype="bfloat16", **kw)
    assert BF16_DECODE_MIN_ROWS == 8 and bf16.decode_rows[-1] == 8
    assert bf16.step_params(4) is bf16.params and bf16.prefill_params is bf16.params
    assert _dtypes(bf16.step_params(8))["kernel"] == {"bfloat16"}
    assert all(f32.step_params(r) is f32.params for r in f32.decode_rows)
    prompt = list(np.random.RandomState(5).randint(3, 300, size=20))
    greedy = SamplingParams(temperature=0.0)
    words = np.full((8, -(-model.config.vocab_size // 32)), -1)
    steps = {}
    for name, engine in (("f32", f32), ("bf16", bf16)):
        state = engine.init_decode_state()
        state, _ = engine.insert(engine.prefill(prompt, greedy), state, 0)
        state, one = engine.decode_logits(state)
        state, _ = engine.decode_sample(state, one, words)
        state, _ = engine.insert(engine.prefill(prompt, greedy), state, 7)
        assert engine.decode_bucket() == 8
        state, eight = engine.decode_logits(state)
        steps[name] = np.asarray(one[0]), np.asarray(eight[7])
    assert np.array_equal(steps["f32"][0], steps["bf16"][0])
    gap = np.abs(steps["f32"][1] - steps["bf16"][1]).max()
    assert 0 < gap < 0.05 * np.abs(steps["f32"][1]).max(), gap


def record_prefill_calls(engine) -> list[list[int]]:
    """Wraps the engine's prefill_many: the prompt lengths of each call, in order."""
    calls: list[list[int]] = []
    real = engine.prefill_many

    def recording(prompts, *a, **kw):
        calls.append([len(p) for p in prompts])
        return real(prompts, *a, **kw)

    engine.prefill_many = recording
    return calls


def test_driver_packs_waiting_prompts_into_one_prefill(tiny):
    # A burst of requests: the prefill thread takes what is waiting in one call (within the largest
    # bucket) and every request still gets exactly its reference tokens.
    model, tok = tiny
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=4, prefill_lengths=BUCKETS, max_length=MAX_LEN
    )
    s.compile()
    calls = record_prefill_calls(s.driver.engines[0])
    rng = np.random.RandomState(3)
    prompts = [list(rng.randint(3, 300, size=n)) for n in rng.randint(2, 30, size=10)]
    want = [greedy_generate(model, [p], 6)[0] for p in prompts]
    s.driver.interleaved_mode = True  # requests pile up while the first prefill waits for a step
    s.start()
    try:
        actives = [s.submit(ids_request(p, 6)) for p in prompts]
        got = [[t for items in a.channel for x in items for t in x.token_ids] for a in actives]
    finally:
        s.stop()
    assert got == want
    sizes = [len(c) for c in calls]
    assert sum(sizes) == len(prompts) and max(sizes) > 1, sizes
    assert s.driver.num_used_slots == 0


def test_driver_prefills_a_queue_in_full_rows(tiny):
    # Prompts that queue up beyond one row's tokens go into one call of several rows, each row full: the
    # prompts of a row that would only pad the call to the next compiled row count wait for the next call.
    from vsurge.engines.dense.prefill_rows import rows_needed

    model, tok = tiny
    s = vSurge.create_vdriver(
        model,
        tok,
        max_concurrent_decodes=16,
        prefill_lengths=[16, 32],
        max_length=MAX_LEN,
        prefill_pack_tokens=32,
        prefill_pack_rows=4,
    )
    engine = s.driver.engines[0]
    assert engine.pack_rows == [2, 4]
    calls: list[list[int]] = []
    gate = threading.Event()
    real = engine.prefill_many

    def held(prompts, *a, **kw):
        calls.append([len(p) for p in prompts])
        if len(calls) == 1:
            gate.wait(20)  # the rest queue up behind the first call
        return real(prompts, *a, **kw)

    s.compile()
    engine.prefill_many = held
    rng = np.random.RandomState(8)
    lengths = (11, 20, 20, 20, 12, 12, 5, 16, 17, 9, 9, 9, 9)
    prompts = [list(rng.randint(3, 300, size=n)) for n in lengths]
    want = [greedy_generate(model, [p], 5)[0] for p in prompts]
    want[0] = want[0][:1]
    s.start()
    try:
        # max_tokens 1: its first token ends it, so it takes no slot and the engine stays idle (full-size
        # calls) while the rest are taken
        first = s.submit(ids_request(prompts[0], 1))
        deadline = time.time() + 10
        while not calls and time.time() < deadline:
            time.sleep(0.01)
        queued = [ids_request(p, 5) for p in prompts[1:]]
        rest = [s.submit(r) for r in queued]  # within ms: the queue's shortest-first order holds
        gate.set()
        got = [[t for items in a.channel for x in items for t in x.token_ids] for a in [first, *rest]]
    finally:
        s.stop()
    assert got == want
    # the queue hands out shortest first; rows of 32, first fit: 5 9 9 9 | 9 12 | 12 16 | 17 fill the four
    # rows (the 20s find no room); then 20 | 20 | 20 would take three rows, which run as four, so the
    # third 20 waits for the next call
    assert calls == [[11], [5, 9, 9, 9, 9, 12, 12, 16, 17], [20, 20], [20]], calls
    assert sorted(n for c in calls for n in c) == sorted(len(p) for p in prompts)
    for c in calls:
        assert rows_needed(c, 32) == engine.pack_rows_for(c), c  # whole rows, no padded row
    assert s.driver.num_used_slots == 0


def test_prefill_lingers_for_a_burst_then_not(tiny, monkeypatch):
    # Clients that submit together arrive some ms apart: an idle driver's prefill call keeps taking
    # prompts while each arrives within PREFILL_GAP_S of the last, so the burst is prefilled in one call
    # and decodes as one cohort; a prompt that comes after a longer pause goes in a call of its own.
    from vsurge.drivers.dense import vdriver

    # wide bounds, so a loaded machine's scheduling jitter cannot split the burst
    monkeypatch.setattr(vdriver, "PREFILL_GAP_S", 0.3)
    monkeypatch.setattr(vdriver, "PREFILL_LINGER_S", 2.0)
    model, tok = tiny
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=8, prefill_lengths=BUCKETS, max_length=MAX_LEN
    )
    s.compile()
    calls = record_prefill_calls(s.driver.engines[0])
    rng = np.random.RandomState(9)
    prompts = [list(rng.randint(3, 300, size=n)) for n in (3, 4, 5, 6, 7)]
    want = [greedy_generate(model, [p], 4)[0] for p in prompts]
    s.start()
    try:
        actives = []
        for p in prompts[:4]:
            actives.append(s.submit(ids_request(p, 4)))
            time.sleep(0.03)  # a trickle: each arrives well inside the gap, none with the one before
        first_four = [[t for items in a.channel for x in items for t in x.token_ids] for a in actives]
        time.sleep(0.5)  # longer than the gap: the fifth is a call of its own
        last = s.submit(ids_request(prompts[4], 4))
        fifth = [t for items in last.channel for x in items for t in x.token_ids]
    finally:
        s.stop()
    assert [*first_four, fifth] == want
    assert calls == [[3, 4, 5, 6], [7]], calls
    assert s.driver.num_used_slots == 0


def test_busy_driver_prefills_in_smaller_calls(tiny, monkeypatch):
    # While a stream decodes, a prefill call holds at most BUSY_PREFILL_PROMPTS prompts (a call's prompts
    # see their first token only when the whole call is done); an idle driver takes a queue like this in
    # one call (test_prefill_lingers_for_a_burst_then_not).
    from vsurge.drivers.dense import vdriver

    monkeypatch.setattr(vdriver, "BUSY_PREFILL_PROMPTS", 2)
    model, tok = tiny
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=8, prefill_lengths=BUCKETS, max_length=MAX_LEN
    )
    engine = s.driver.engines[0]
    steps_may_run = threading.Event()  # the first request holds its slot until the calls are counted
    real_decode = engine.decode

    def held(state):
        steps_may_run.wait(20)
        return real_decode(state)

    s.compile()
    calls = record_prefill_calls(engine)
    engine.decode = held
    rng = np.random.RandomState(10)
    prompts = [list(rng.randint(3, 300, size=n)) for n in (4, 5, 6, 7, 8)]
    want = [greedy_generate(model, [p], 4)[0] for p in prompts]
    s.start()
    try:
        first = s.submit(ids_request([5, 6, 7], 4))
        deadline = time.time() + 20
        while s.driver.num_used_slots == 0 and time.time() < deadline:
            time.sleep(0.01)
        actives = [s.submit(ids_request(p, 4)) for p in prompts]
        while sum(map(len, calls)) < 1 + len(prompts) and time.time() < deadline:
            time.sleep(0.01)
        steps_may_run.set()
        got = [[t for items in a.channel for x in items for t in x.token_ids] for a in actives]
        assert len([t for items in first.channel for x in items for t in x.token_ids]) == 4
    finally:
        steps_may_run.set()
        s.stop()
    assert got == want
    assert calls[0] == [3] and all(len(c) <= 2 for c in calls[1:]), calls
    assert sorted(n for c in calls[1:] for n in c) == [4, 5, 6, 7, 8]
    assert s.driver.num_used_slots == 0


BF16 = {"prefill_dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "decode_dtype": "bfloat16"}


@pytest.mark.parametrize("dtypes", [{}, BF16], ids=["model", "bfloat16"])
def test_no_compilation_on_live_requests(tiny, dtypes):
    from jit_watch import compiled_while_serving

    model, tok = tiny
    slots = 8 if dtypes else 4  # 8: the bfloat16 decode step is one of the buckets
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=slots, prefill_lengths=BUCKETS, max_length=MAX_LEN, **dtypes
    )
    s.compile()
    # start-up's parallel pool compiled each of its programs with the signature live calls use: nothing it
    # compiled compiles again after it (on TPU the pool also holds insert and the first-token samplers;
    # on CPU those compile on their first run: dense/warmup.compile_engine)
    report = s.driver.engines[0].compile_report
    late = {name for name, _ in report["after_pool"]}
    assert not late & set(report["pool"]), report
    assert "jit(_prefill_layer_impl)" in report["pool"] and "jit(_chunk_layer_impl)" in report["pool"], report
    compiled = compiled_while_serving(s)
    assert not compiled, compiled


def test_decode_does_not_wait_for_prompts_being_prefilled(tiny):
    # Issue 14: no "prompts first" stall. While a new prompt is held in prefill, the running request
    # decodes to its end (max_decode_stall, which once bounded that wait, is gone: test_engine_config).
    model, tok = tiny
    s = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=4, prefill_lengths=BUCKETS, max_length=MAX_LEN
    )
    engine = s.driver.engines[0]
    s.compile()
    gate, held, let_go = threading.Event(), threading.Event(), threading.Event()
    real_prefill = engine.prefill_many

    def gated_prefill(prompts, *a, **kw):
        if prompts[0][0] == 77:  # the second request's prompt waits until the first one has finished
            held.set()
            gate.wait(20)
            let_go.set()
        return real_prefill(prompts, *a, **kw)

    engine.prefill_many = gated_prefill
    s.start()
    try:
        running = s.submit(ids_request([3, 4, 5], 12))
        it = iter(running.channel)
        got = [t for x in next(it) for t in x.token_ids]  # decoding now
        waiting = s.submit(ids_request([77, 6, 7], 3))
        assert held.wait(10)
        got += [t for items in it for x in items for t in x.token_ids]
        assert not let_go.is_set()  # it ended while the other prompt was still held in prefill
        assert len(got) == 12
        gate.set()
        assert len([t for items in waiting.channel for x in items for t in x.token_ids]) == 3
    finally:
        gate.set()
        s.stop()
