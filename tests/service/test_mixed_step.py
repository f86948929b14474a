"""oEngine's mixed step: decode rows and packed prefill chunks of several sequences in one forward.

* the ragged paged attention (pure JAX) equals a dense per-sequence reference;
* the token-budget planner never exceeds its budget and serves the oldest prompts first;
* greedy tokens of requests arriving at different times, prompts of mixed lengths split across steps and
  packed together, equal single-request generation, and decode rows keep stepping while a long prompt
  is being prefilled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vsurge
from vsurge.engines.mixed_step import ChunkWork
from vsurge.engines.oengine import oEngine
from vsurge.engines.page_scheduler import PageScheduler, Seq, plan_chunks
from vsurge.engines.paging import HBMPageManager, bytes_per_page, page_hashes
from vsurge.models import greedy_generate
from vsurge.models.paged_attention import ragged_paged_attention_xla
from vsurge.sampling_params import SamplingParams


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
def _seq(tokens, max_tokens: int, page_size: int, req=None) -> Seq:
    tokens = np.asarray(tokens, np.int32)
    return Seq(req, 0, tokens, page_hashes(tokens, page_size), 0, len(tokens), max_tokens)


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
    eng.legacy_programs = False
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
                seq = _seq(p, max_tokens, eng.page_size, req=i)
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


def test_mixed_step_greedy_equals_single_request_generation(engine, tiny):
    model, _ = tiny
    rng = np.random.default_rng(3)
    lens = [5, 61, 17, 3, 40, 9]  # 61 and 40 take several steps of a 24-token budget
    prompts = [list(rng.integers(3, model.config.vocab_size, size=n)) for n in lens]
    got, overlapped = _serve(engine, prompts, 6, arrive_at=[0, 0, 1, 3, 4, 9])
    ref = greedy_generate(model, prompts, 6)
    assert got == ref
    assert overlapped > 0  # decode rows stepped while a long prompt was still being prefilled
