"""oEngine's mixed step: decode rows and packed prefill chunks of several sequences in one forward.

* the ragged paged attention (pure JAX) equals a dense per-sequence reference;
* the token-budget planner never exceeds its budget and serves the oldest prompts first;
* greedy tokens of requests arriving at different times, prompts of mixed lengths split across steps and
  packed together, equal single-request generation, and decode rows keep stepping while a long prompt
  is being prefilled.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vsurge
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.contracts.token_budget import TokenBudget
from vsurge.drivers.paged.page_scheduler import PageScheduler, Seq
from vsurge.engines.paged.mixed_step import ChunkWork, plan_chunks
from vsurge.engines.paged.paging import HBMPageManager, bytes_per_page, page_hashes
from vsurge.models import greedy_generate
from vsurge.models.paged_attention import ragged_paged_attention_xla
from vsurge.seed_api.engines import oEngine


# ------------------------------------------------------------------------------------------ attention
def test_ragged_attention_matches_a_dense_reference():
    rng = np.random.default_rng(0)
    ps, w, num_pages, kvh, h, d = 4, 8, 40, 2, 4, 8
    kc = rng.standard_normal((num_pages, ps, kvh, d)).astype(np.float32)
    vc = rng.standard_normal((num_pages, ps, kvh, d)).astype(np.float32)
    # three decode rows (the second idle: kv_len 0), then chunks with and without earlier context, an
    # empty chunk slot, and padding tokens at the end
    q_lens, kv = [1, 1, 1, 5, 0, 7], [9, 0, 17, 12, 0, 7]
    rows = np.zeros((len(q_lens), w), np.int32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    for s, n in enumerate(kv):
        for j in range(-(-n // ps)):
            rows[s, j] = free.pop()
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((20, h, d)).astype(np.float32)
    fn = jax.jit(ragged_paged_attention_xla, static_argnames=("page_size", "num_decode"))
    out = fn(
        jnp.asarray(q),
        (jnp.asarray(kc), jnp.asarray(vc)),
        jnp.asarray(kv, jnp.int32),
        jnp.asarray(rows),
        jnp.asarray(cu),
        jnp.array([len(q_lens)], jnp.int32),
        page_size=ps,
        num_decode=3,  # the decode walk for the first three, the chunk walk for the rest
    )
    out = np.asarray(out)
    for s in (0, 2, 3, 5):
        keys, vals = kc[rows[s]].reshape(-1, kvh, d), vc[rows[s]].reshape(-1, kvh, d)
        for i in range(q_lens[s]):
            t, p = cu[s] + i, kv[s] - q_lens[s] + i
            for head in range(h):
                g = head // (h // kvh)
                sc = keys[: p + 1, g] @ q[t, head] / np.sqrt(d)
                pr = np.exp(sc - sc.max())
                ref = (pr / pr.sum()) @ vals[: p + 1, g]
                np.testing.assert_allclose(out[t, head], ref, atol=1e-5)


# ------------------------------------------------------------------------------------------ planner
def test_plan_chunks_respects_the_budget_oldest_first():
    rng = np.random.default_rng(1)
    for _ in range(500):
        remaining = list(rng.integers(1, 300, size=rng.integers(0, 8)))
        decoding, budget, k = int(rng.integers(0, 32)), int(rng.integers(33, 512)), int(rng.integers(1, 5))
        lens = plan_chunks(remaining, decoding, budget, k)
        assert decoding + sum(lens) <= budget
        assert len(lens) <= k and all(n >= 1 for n in lens)
        # oldest first: every sequence but the last one served gets all it has left
        assert all(n == r for n, r in zip(lens[:-1], remaining, strict=False))
        if len(lens) < min(k, len(remaining)):
            assert decoding + sum(lens) == budget  # stopped only for lack of budget
    assert plan_chunks([500, 10], decoding=30, budget=64, max_seqs=4) == [34]
    assert plan_chunks([5, 10, 7], decoding=0, budget=64, max_seqs=2) == [5, 10]
    assert plan_chunks([1500, 10], decoding=3, budget=2048, max_seqs=4, max_tokens=1024) == [1024]


def test_plan_step_advances_cursors_and_counts_decoding_rows():
    mgr = HBMPageManager(64, 8)
    sched = PageScheduler(mgr, num_slots=4, max_length=128, max_chunk=32)
    seqs = [_seq(np.arange(n) % 50 + 1, 8, 8) for n in (40, 3, 20)]
    for s in seqs:
        sched.add(s)
    sched.admit()
    chunks = sched.plan_step(budget=32, max_seqs=4)
    assert [(c.seq, c.start, c.length, c.final) for c in chunks] == [(seqs[0], 0, 32, False)]
    chunks = sched.plan_step(budget=32, max_seqs=4)
    assert [(c.start, c.length, c.final) for c in chunks] == [(32, 8, True), (0, 3, True), (0, 20, True)]
    for c in chunks:
        assert sched.start_decoding(c.seq)
    assert sched.active_rows().tolist() == [True, True, True]
    assert sched.plan_step(budget=32, max_seqs=4) == []


# ------------------------------------------------------------------------------------------ engine
def _seq(tokens, max_tokens: int, page_size: int, req=None, max_length: int = 128) -> Seq:
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    return Seq(req, 0, tokens, page_hashes(tokens, page_size), 0, n, TokenBudget(n, max_tokens, max_length))


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return vsurge.load_model(path)


@pytest.fixture(scope="module")
def engine(tiny):
    model, tok = tiny
    page_size, pages = 8, 64
    eng = oEngine(
        model,
        tok,
        max_concurrent_decodes=4,
        max_length=128,
        prefill_lengths=[16, 32],
        min_decode_tokens=32,
        page_size=page_size,
        kv_cache_bytes=(pages + 1) * bytes_per_page(model.config, page_size, model.dtype),
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )
    eng.compile(progress=lambda _: None)
    return eng


def _serve(eng: oEngine, prompts, max_tokens: int, arrive_at):
    """A synchronous step loop over PageScheduler + oEngine.step: request i joins at step arrive_at[i].
    Returns (tokens per request, steps that decoded while some prompt was mid-prefill)."""
    sched = PageScheduler(eng.manager, eng.max_concurrent_decodes, eng.max_length, eng.token_budget)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    state = eng.init_decode_state()
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step, overlapped = 0, 0
    while step < 400 and (any(len(v) < max_tokens for v in out.values())):
        for i, p in enumerate(prompts):
            if arrive_at[i] == step:
                seq = _seq(p, max_tokens, eng.page_size, req=i, max_length=eng.max_length)
                seq.inputs = eng.seq_inputs(greedy, [], np.zeros(2, np.uint32), p)
                sched.add(seq)
        sched.admit()
        sched.grow()
        chunks = sched.plan_step(eng.token_budget, eng.step_seqs)
        active = sched.active_rows()
        step += 1
        if not chunks and not active.any():
            continue
        if active.any() and (chunks and not chunks[-1].final or sched.any_prefilling()):
            overlapped += 1
        assert active.sum() + sum(c.length for c in chunks) <= eng.token_budget
        work = [
            ChunkWork(
                c.seq.tokens[c.start : c.start + c.length],
                c.start,
                sched.row(c.seq),
                c.seq.slot,
                c.seq.inputs if c.final else None,
            )
            for c in chunks
        ]
        table = jax.device_put(sched.table.copy())
        state, res, firsts = eng.step(state, table, active, work)
        if res is not None:
            toks = np.asarray(res.tokens)
            for seq in sched.decoding(len(toks)):
                if seq is not None:
                    out[seq.req].append(int(toks[seq.slot]))
        sched.stepped()
        for k, first in firsts:
            seq = chunks[k].seq
            out[seq.req].append(int(np.asarray(first.tokens)[0]))
            if not sched.start_decoding(seq):
                sched.release(seq)
    assert sched.num_used_slots == 0 and eng.manager.num_free == eng.manager.num_pages
    eng.manager.check()
    return [out[i] for i in range(len(prompts))], overlapped


# prompts of mixed lengths: 70 and 90 take several steps of a 24-token budget, short ones pack together
SIZES = [3, 70, 12, 45, 1, 30, 90, 8]
MAX_NEW = 11


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [list(rng.integers(3, 300, size=n)) for n in SIZES]


@pytest.fixture(scope="module")
def expected(tiny, prompts):
    """Single-request greedy generation (one padded batch, which never changes a row's result)."""
    return greedy_generate(tiny[0], prompts, MAX_NEW)


def test_mixed_step_greedy_equals_single_request_generation(engine, prompts, expected):
    got, overlapped = _serve(engine, prompts, MAX_NEW, arrive_at=[0, 0, 1, 3, 4, 9, 9, 12])
    assert got == expected
    assert overlapped > 0  # decode rows stepped while a long prompt was still being prefilled


# ------------------------------------------------------------------------------------------ driver
@pytest.fixture(scope="module")
def surge(engine):
    """oDriver over the module's engine (its programs are compiled once); after the engine-level tests."""
    from vsurge import vSurge
    from vsurge.drivers.paged.odriver import oDriver

    s = vSurge(oDriver(engine))
    s.start()
    yield s
    s.stop()


_HOOKS: list = []  # called with each step's chunks once it is dispatched (a test's probe)


@pytest.fixture
def steps(surge, monkeypatch):
    """Every mixed step the driver dispatches: (decode rows, [(chunk start, length, final)])."""
    eng, seen = surge.driver.engine, []
    real = eng.step

    def watched(state, table, active, chunks=()):
        seen.append((int(np.sum(active)), [(c.start, len(c.tokens), c.final) for c in chunks]))
        out = real(state, table, active, chunks)
        for hook in _HOOKS:
            hook(chunks)
        return out

    monkeypatch.setattr(eng, "step", watched)
    yield seen
    deadline = time.time() + 5
    while surge.driver.num_used_slots and time.time() < deadline:
        time.sleep(0.01)
    m = eng.manager
    assert surge.driver.num_used_slots == 0 and m.num_free == m.num_pages, "slots or pages leaked"
    m.check()
    assert all(rows + sum(n for _, n, _ in chunks) <= eng.token_budget for rows, chunks in seen)


def _request(ids, max_tokens: int):
    from vsurge.seed_api.request import vSurgeRequest

    return vSurgeRequest(
        prompt=[int(t) for t in ids],
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        is_client_side_tokenization=True,
    )


def _tokens(active) -> list[int]:
    return [t for items in active.channel for s in items for t in s.token_ids]


def test_driver_arriving_requests_match_reference(surge, steps, prompts, expected):
    lengths = [int(n) for n in np.random.default_rng(8).integers(1, MAX_NEW + 1, size=len(prompts))]
    reqs = []
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        reqs.append(surge.submit(_request(p, n)))
        # the first half arrives together (they arrive while the first step runs, so the next packs several
        # prompts); the rest join a batch that is already decoding and prefilling
        if i >= len(prompts) // 2:
            time.sleep(0.02)
    assert [_tokens(r) for r in reqs] == [row[:n] for row, n in zip(expected, lengths, strict=True)]
    assert any(len(chunks) > 1 for _, chunks in steps)  # prompts were packed into one step


def test_driver_decodes_while_a_long_prompt_is_prefilled(surge, steps):
    short = surge.submit(_request([5, 6, 7], 40))
    it = iter(short.channel)
    next(it)  # decoding now
    long = surge.submit(_request(list(np.arange(100) % 200 + 3), 2))
    assert len(_tokens(long)) == 2
    list(it)
    # the 100-token prompt takes several steps of a 24-token budget, and the short request decodes in them
    mixed = [rows for rows, chunks in steps if rows and any(not final for _, _, final in chunks)]
    assert len(mixed) >= 3, steps


def test_driver_cancel_mid_prefill_frees_everything(surge, steps):
    prompt = list(np.arange(110) % 250 + 3)
    holder = []

    def cancel_after_first_chunk(chunks):
        if holder and any(c.start == 0 and not c.final and c.tokens[0] == prompt[0] for c in chunks):
            holder[0].cancel()  # its first chunk is written, four more are to come

    _HOOKS.append(cancel_after_first_chunk)
    try:
        holder.append(surge.submit(_request(prompt, 5)))
        reasons = [x.finish_reason for items in holder[0].channel for x in items if x.finish_reason]
    finally:
        _HOOKS.clear()
    assert reasons == ["abort"]
    assert not any(final for _, chunks in steps for _, _, final in chunks)  # its prefill never ended
    # the `steps` fixture checks that no slot and no page is left behind
