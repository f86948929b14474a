"""Paging without a model: page hashing, HBMPageManager invariants, the page scheduler, KV budgets, and
paged attention against the dense backends and JAX's own ragged paged attention reference."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vsurge.contracts.token_budget import TokenBudget
from vsurge.drivers.paged.page_scheduler import PageScheduler, Seq
from vsurge.engines.paged.paging import (
    DEFAULT_HOST_KV_BYTES,
    HBMPageManager,
    PagedAttentionCache,
    bytes_per_page,
    kv_budget_bytes,
    page_hashes,
)
from vsurge.models.attention import DenseDecodeAttention, PrefillAttention
from vsurge.models.paged_attention import PagedDecodeAttention, PagedPrefillAttention, combine_kv, gather_kv
from vsurge.models.sharding import make_mesh

# ------------------------------------------------------------------------------------------ prefix keys


def test_page_hashes_name_whole_prefixes():
    a = page_hashes(list(range(20)), 4)
    assert len(a) == 5 and len(set(a)) == 5
    assert page_hashes(list(range(19)), 4) == a[:4]  # the partial page has no key
    b = page_hashes(list(range(8)) + [99] + list(range(9, 20)), 4)
    assert b[:2] == a[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    # the same page of tokens after a different prefix is a different key
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] != page_hashes([0, 0, 0, 0, 5, 6, 7, 8], 4)[1]


# ------------------------------------------------------------------------------------------ manager


def test_manager_allocates_grows_shares_and_evicts_lru():
    m = HBMPageManager(num_pages=6, page_size=4)
    keys = page_hashes(list(range(12)), 4)
    assert m.allocate("a", 12, keys[:2]) == 0  # nothing cached yet
    assert len(m.table("a")) == 3 and m.num_free == 3
    m.register("a", keys)
    assert m.num_cached == 3
    # b shares a's first two pages (it must compute at least its last token itself)
    assert m.allocate("b", 10, keys[:2]) == 8
    assert m.table("b")[:2] == m.table("a")[:2] and m.hits == 1
    assert m.num_free == 2
    assert m.grow("b", 13) and len(m.table("b")) == 4 and m.num_free == 1
    assert not m.grow("b", 21)  # two more pages do not fit: nothing changes
    assert len(m.table("b")) == 4
    assert m.allocate("c", 9) is None  # three pages do not fit either
    m.check()
    m.free("a")  # a's private third page stays cached (it has a key), unowned
    assert m.num_free == 2 and m.num_cached == 3
    m.free("b")
    assert m.num_free == m.num_pages and m.num_used == 0
    m.check()
    # a new prompt takes free pages first, then evicts the least recently used cached page
    assert m.allocate("d", 16) == 0  # 3 free pages + 1 evicted
    assert m.evictions == 1 and m.num_cached == 2
    # the evicted one is a's tail (freed first into the LRU), so the head of the prefix is still there
    assert m.lookup(keys) == m.lookup(keys[:2]) and len(m.lookup(keys)) == 2
    m.free("d")
    m.check()


def test_manager_rejects_misuse():
    m = HBMPageManager(num_pages=2, page_size=4)
    with pytest.raises(ValueError):
        HBMPageManager(num_pages=0, page_size=4)
    m.allocate("a", 4)
    with pytest.raises(ValueError, match="already has pages"):
        m.allocate("a", 4)
    m.reset()
    assert m.num_free == 2


class ManagerMachine(RuleBasedStateMachine):
    """Random submit / grow / publish / finish / cancel / preempt against the manager's invariants."""

    def __init__(self):
        super().__init__()
        self.m = HBMPageManager(num_pages=12, page_size=3)
        self.seqs: dict[int, list[int]] = {}  # id -> tokens
        self.ids = itertools.count()

    @rule(
        prefix=st.sampled_from([(), (1, 2, 3), (1, 2, 3, 4, 5, 6), (7, 7, 7)]),
        rest=st.lists(st.integers(0, 3), min_size=1, max_size=10),
    )
    def submit(self, prefix, rest):
        tokens = list(prefix) + rest
        keys = page_hashes(tokens, 3)
        sid = next(self.ids)
        got = self.m.allocate(sid, len(tokens), keys[: (len(tokens) - 1) // 3])
        if got is None:
            return
        assert got % 3 == 0 and got < len(tokens)
        assert len(self.m.table(sid)) == self.m.pages_for(len(tokens))
        self.seqs[sid] = tokens

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def publish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[sid]
        self.m.register(sid, page_hashes(tokens, 3))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), more=st.integers(1, 7))
    def grow(self, data, more):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        before = list(self.m.table(sid))
        if self.m.grow(sid, len(self.seqs[sid]) + more):
            self.seqs[sid] = self.seqs[sid] + [0] * more
            assert self.m.table(sid)[: len(before)] == before
        else:
            assert self.m.table(sid) == before

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), how=st.sampled_from(["finish", "cancel", "preempt"]))
    def end(self, data, how):
        # all three return the pages the same way; preempt is a finish whose sequence comes back later
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs.pop(sid)
        self.m.free(sid)
        if how == "preempt":
            self.submit_back(tokens)

    def submit_back(self, tokens):
        sid = next(self.ids)
        if self.m.allocate(sid, len(tokens), page_hashes(tokens, 3)[: (len(tokens) - 1) // 3]) is not None:
            self.seqs[sid] = tokens

    @invariant()
    def consistent(self):
        self.m.check()

    def teardown(self):
        for sid in list(self.seqs):
            self.m.free(sid)
        assert self.m.num_free == self.m.num_pages
        self.m.check()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ------------------------------------------------------------------------------------------ scheduler


def _seq(rid, tokens, max_tokens, ps, generated=0, prompt_len=None, max_length=64):
    req = SimpleNamespace(id=rid)
    tokens = np.asarray(tokens, np.int32)
    n = prompt_len or len(tokens)
    return Seq(req, 0, tokens, page_hashes(tokens, ps), generated, n, TokenBudget(n, max_tokens, max_length))


def _simulate(prompts, max_tokens, stops, *, pages, ps, slots, max_length, chunk):
    """Drive the scheduler as the generate thread does, with the detokenizer's part done inline.

    Returns (steps, preemptions); every sequence must finish, and every page must come back.
    """
    m = HBMPageManager(pages, ps)
    s = PageScheduler(m, slots, max_length, chunk)
    out = {rid: [] for rid in range(len(prompts))}  # tokens "generated" per request
    ended = set()
    for rid, p in enumerate(prompts):
        s.add(_seq(rid, p, max_tokens[rid], ps, max_length=max_length))
    steps = 0
    while len(ended) < len(prompts):
        steps += 1
        assert steps < 5000, "no progress: the scheduler deadlocked"
        s.admit()
        for c in s.plan_prefill():
            s.written(c.seq, c.start + c.length)
            if c.final:
                rid = c.seq.req.id
                out[rid].append(1000 + len(out[rid]))  # the first token after the prefill
                if not s.start_decoding(c.seq) or len(out[rid]) == stops[rid]:
                    s.release(c.seq)
                    ended.add(rid)
        m.check()
        for v in s.grow():
            rid = v.req.id
            if v.decoding:  # recompute from the prompt and everything it produced
                p = prompts[rid]
                s.add(
                    _seq(rid, list(p) + out[rid], max_tokens[rid], ps, len(out[rid]), len(p), max_length),
                    front=True,
                )
            else:
                s.add(v.fresh(), front=True)
        m.check()
        snapshot = [q for q in s.decoding(slots) if q is not None]
        finished = s.stepped()
        for q in snapshot:
            rid = q.req.id
            out[rid].append(1000 + len(out[rid]))
            if q in finished:
                ended.add(rid)
            elif len(out[rid]) == stops[rid]:  # a stop token, seen later by the detokenizer
                s.release(q)
                ended.add(rid)
    for rid, p in enumerate(prompts):
        assert len(out[rid]) == min(max_tokens[rid], stops[rid], max_length - len(p)), rid
    assert not s.waiting and s.num_used_slots == 0
    assert m.num_free == m.num_pages
    m.check()
    return steps, s.preemptions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    ps=st.sampled_from([2, 3, 4]),
    slots=st.integers(1, 5),
    extra_pages=st.integers(0, 6),
)
def test_scheduler_never_deadlocks_or_leaks(data, ps, slots, extra_pages):
    max_length = 24
    width = -(-max_length // ps)
    n = data.draw(st.integers(1, 8))
    shared = data.draw(st.lists(st.integers(0, 2), max_size=8))
    prompts = [
        (shared + data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=15)))[: max_length - 1]
        for _ in range(n)
    ]
    max_tokens = [data.draw(st.integers(1, 20)) for _ in range(n)]
    stops = [data.draw(st.integers(1, 25)) for _ in range(n)]
    _simulate(
        prompts,
        max_tokens,
        stops,
        pages=width + extra_pages,
        ps=ps,
        slots=slots,
        max_length=max_length,
        chunk=data.draw(st.sampled_from([3, 8])),
    )


def test_scheduler_preempts_the_youngest_when_pages_run_out():
    # 3 sequences want 5 pages each over time; 8 pages hold one whole and some of another
    _, preemptions = _simulate(
        [[1] * 3, [2] * 3, [3] * 3], [17, 17, 17], [99] * 3, pages=8, ps=4, slots=3, max_length=20, chunk=8
    )
    assert preemptions > 0


def test_scheduler_refuses_a_cache_smaller_than_one_sequence():
    with pytest.raises(ValueError, match="needs 5"):
        PageScheduler(HBMPageManager(4, 4), 2, 20, 8)


def test_scheduler_chunks_long_prompts_and_reuses_prefixes():
    m = HBMPageManager(32, 4)
    s = PageScheduler(m, 2, 64, 8)
    a = _seq("a", list(range(21)), 4, 4)
    s.add(a)
    s.admit()
    chunks = []
    while not a.decoding:
        for c in s.plan_prefill():
            chunks.append((c.start, c.length, c.final))
            s.written(a, c.start + c.length)
            if c.final:
                s.start_decoding(a)
    assert chunks == [(0, 8, False), (8, 8, False), (16, 5, True)]
    b = _seq("b", list(range(16)) + [50, 51], 4, 4)
    s.add(b)
    assert s.admit() == [b] and b.cursor == 16 and m.hits == 1
    assert [(c.start, c.length) for c in s.plan_prefill()] == [(16, 2)]
    # a prompt that is entirely cached still computes its last page
    c = _seq("c", list(range(16)), 4, 4)
    s.release(b)
    s.add(c)
    s.admit()
    assert c.cursor == 12


# ------------------------------------------------------------------------------------------ budgets


class _Dev:
    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_kv_budget_from_device_memory_or_explicit_bytes():
    assert kv_budget_bytes([_Dev(None)], 0.6, None) == (
        DEFAULT_HOST_KV_BYTES,
        "default (device reports no memory)",
    )
    stats = {"bytes_limit": 1000, "bytes_in_use": 200}
    assert kv_budget_bytes([_Dev(stats), _Dev({"bytes_limit": 2000})], 0.5, None)[0] == 400
    assert kv_budget_bytes([_Dev(stats)], 0.5, 12345)[0] == 12345
    with pytest.raises(ValueError):
        kv_budget_bytes([_Dev(stats)], 1.5, None)
    with pytest.raises(ValueError):
        kv_budget_bytes([_Dev(stats)], 0.5, 0)


def test_cache_size_and_sharding():
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=4, head_dim=8)
    per_page = bytes_per_page(cfg, 16, jnp.float32)
    assert per_page == 2 * 16 * 2 * 4 * 8 * 4
    c = PagedAttentionCache.create(cfg, 16, kv_cache_bytes=11 * per_page)
    assert c.num_pages == 10 and c.page_shape == (11, 16, 4, 8)  # one page of the budget is scratch
    assert c.layout == "split" and c.nbytes == 11 * per_page
    # jax reports no memory on CPU: the default budget, never a guess from host memory
    assert PagedAttentionCache.create(cfg, 16).num_pages == DEFAULT_HOST_KV_BYTES // per_page - 1
    with pytest.raises(ValueError, match="holds no page"):
        PagedAttentionCache.create(cfg, 16, kv_cache_bytes=per_page // 2)
    mesh = make_mesh("tp=4")
    k, v = PagedAttentionCache.create(cfg, 16, kv_cache_bytes=11 * per_page, mesh=mesh).allocate()[0]
    assert k.sharding.shard_shape(k.shape) == (11, 16, 1, 8)  # one kv head per device
    combined = PagedAttentionCache.create(cfg, 16, kv_cache_bytes=11 * per_page, mesh=mesh, layout="combined")
    pages = combined.allocate()
    assert len(pages) == 2 and combined.nbytes == 11 * per_page
    assert pages[0].sharding.shard_shape(pages[0].shape) == (11, 16, 2, 8)  # K and V of one head per device
    odd = PagedAttentionCache.create(
        SimpleNamespace(num_layers=1, num_kv_heads=3, head_dim=8),
        16,
        kv_cache_bytes=4 * per_page,
        mesh=make_mesh("tp=2"),
        layout="combined",
    )
    assert odd.sharding.is_fully_replicated  # 3 heads do not split in 2: K and V of a head stay together


# ------------------------------------------------------------------------------------------ attention


def _paged_copy(k, v, ps, rng, layout):
    """Scatter dense K, V [B, N, KVH, D] into shuffled pages; returns (cache, table [B, N/ps])."""
    b, n, kvh, d = k.shape
    per = n // ps
    ids = rng.permutation(np.arange(1, b * per + 1)).reshape(b, per).astype(np.int32)
    arrays = [np.asarray(combine_kv(k, v))] if layout == "combined" else [np.asarray(k), np.asarray(v)]
    out = []
    for x in arrays:
        pages = np.zeros((b * per + 1, ps) + x.shape[2:], np.float32)
        for i in range(b):
            for j in range(per):
                pages[ids[i, j]] = x[i, j * ps : (j + 1) * ps]
        out.append(jnp.asarray(pages))
    return (out[0] if layout == "combined" else tuple(out)), ids


@pytest.mark.parametrize("layout", ["split", "combined", "split-walk"])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_equals_dense_decode(window, layout, monkeypatch):
    if layout == "split-walk":  # the page walk in blocks of 2 pages: 3 steps, some fully masked
        import vsurge.models.paged_attention as pa

        monkeypatch.setattr(pa, "_BLOCK_TOKENS", 8)
        layout = "split"
    rng = np.random.RandomState(0)
    s, n, h, kvh, d, ps = 3, 24, 4, 2, 8, 4
    kc, vc = (jnp.asarray(rng.randn(s, n, kvh, d), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.randn(s, 1, h, d), jnp.float32)
    k, v = (jnp.asarray(rng.randn(s, 1, kvh, d), jnp.float32) for _ in range(2))
    pos = jnp.asarray([3, 11, 20], jnp.int32)
    dense, (kd, _) = DenseDecodeAttention(window=window)(q, k, v, (kc, vc), pos)
    pages, table = _paged_copy(kc, vc, ps, rng, layout)
    table = np.concatenate([table, np.zeros((s, 2), np.int32)], axis=1)  # columns past the read are ignored
    paged, new_pages = PagedDecodeAttention(ps, 6, window=window)(q, k, v, pages, (pos, jnp.asarray(table)))
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), rtol=1e-5, atol=1e-5)
    # the new token landed in its page (combined: K at even and V at odd heads)
    kn, vn = gather_kv(new_pages, jnp.asarray(table[:, :6]))
    for i, p in enumerate(np.asarray(pos)):
        np.testing.assert_array_equal(np.asarray(kn[i, p]), np.asarray(k[i, 0]))
        np.testing.assert_array_equal(np.asarray(vn[i, p]), np.asarray(v[i, 0]))
    # and it matches JAX's own ragged paged attention reference (the TPU kernel's contract)
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    if window is None and layout == "combined":
        ref = ref_ragged_paged_attention(
            q[:, 0],
            new_pages,
            pos + 1,
            jnp.asarray(table[:, :6]),
            jnp.arange(s + 1, dtype=jnp.int32),
            jnp.array([s], jnp.int32),
            sm_scale=1.0 / np.sqrt(d),
        )
        np.testing.assert_allclose(np.asarray(ref), np.asarray(paged[:, 0]), rtol=1e-5, atol=1e-5)


def test_tpu_kernel_call_matches_dense(monkeypatch):
    """The TPU path, with JAX's pure-JAX reference standing in for the Pallas kernel (it cannot run here)."""
    import jax.experimental.pallas.ops.tpu.ragged_paged_attention as rpa

    import vsurge.models.paged_attention as pa

    monkeypatch.setattr(pa, "use_pallas", lambda: True)
    monkeypatch.setattr(rpa, "ragged_paged_attention", rpa.ref_ragged_paged_attention)
    rng = np.random.RandomState(5)
    s, n, h, kvh, d, ps = 3, 16, 4, 2, 8, 4
    kc, vc = (jnp.asarray(rng.randn(s, n, kvh, d), jnp.float32) for _ in range(2))
    q, k, v = (jnp.asarray(rng.randn(s, 1, x, d), jnp.float32) for x in (h, kvh, kvh))
    pos = jnp.asarray([0, 9, 15], jnp.int32)
    dense, _ = DenseDecodeAttention()(q, k, v, (kc, vc), pos)
    pages, table = _paged_copy(kc, vc, ps, rng, "combined")
    got, _ = PagedDecodeAttention(ps, 4)(q, k, v, pages, (pos, jnp.asarray(table)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["split", "combined"])
@pytest.mark.parametrize("start", [0, 8, 12])
def test_chunk_prefill_over_pages_equals_whole_prefill(start, layout):
    """A chunk attending to pages written before it == prefill of the whole sequence at once."""
    rng = np.random.RandomState(1)
    total, t, h, kvh, d, ps = 19, 20, 4, 2, 8, 4
    q, k, v = (jnp.asarray(rng.randn(1, total, n, d), jnp.float32) for n in (h, kvh, kvh))
    positions = jnp.arange(total, dtype=jnp.int32)[None]
    whole, _ = PrefillAttention()(q, k, v, None, (positions, jnp.asarray([total])))
    # pages 1..5 in shuffled order hold the first `start` tokens already
    row = np.asarray(rng.permutation(np.arange(1, 6)), np.int32)
    if layout == "combined":
        pages = jnp.zeros((6, ps, 2 * kvh, d), jnp.float32)
        kv = combine_kv(k[0], v[0])
        for p in range(start):
            pages = pages.at[row[p // ps], p % ps].set(kv[p])
    else:
        pages = (jnp.zeros((6, ps, kvh, d), jnp.float32), jnp.zeros((6, ps, kvh, d), jnp.float32))
        for p in range(start):
            pages = (
                pages[0].at[row[p // ps], p % ps].set(k[0, p]),
                pages[1].at[row[p // ps], p % ps].set(v[0, p]),
            )
    n = total - start  # the chunk, right-padded to t
    pad = lambda x: jnp.pad(x[:, start:], ((0, 0), (0, t - n), (0, 0), (0, 0)))  # noqa: E731
    pos = (start + jnp.arange(t, dtype=jnp.int32))[None]
    out, new = PagedPrefillAttention(ps, 5)(
        pad(q), pad(k), pad(v), pages, (pos, jnp.int32(total), jnp.asarray(row))
    )
    np.testing.assert_allclose(np.asarray(out[0, :n]), np.asarray(whole[0, start:]), rtol=1e-5, atol=1e-5)
    # padding went to the scratch page, every real token to its page
    kn, vn = gather_kv(new, jnp.asarray(row))
    np.testing.assert_array_equal(np.asarray(kn[:total]), np.asarray(k[0]))
    np.testing.assert_array_equal(np.asarray(vn[:total]), np.asarray(v[0]))


def test_paged_decode_on_a_mesh_equals_unsharded():
    rng = np.random.RandomState(2)
    s, h, kvh, d, ps = 4, 8, 4, 8, 4
    pages = tuple(jnp.asarray(rng.randn(9, ps, kvh, d), jnp.float32) for _ in range(2))
    table = jnp.asarray(rng.permutation(np.arange(1, 9)).reshape(s, 2).astype(np.int32))
    q, k, v = (jnp.asarray(rng.randn(s, 1, n, d), jnp.float32) for n in (h, kvh, kvh))
    pos = jnp.asarray([1, 5, 6, 7], jnp.int32)
    att = jax.jit(lambda q, k, v, p, t: PagedDecodeAttention(ps, 2)(q, k, v, p, (pos, t)))
    want, _ = att(q, k, v, pages, table)
    mesh = make_mesh("tp=4")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shard = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    spec = P(None, None, "tp")
    got, new = att(
        shard(q, spec), shard(k, spec), shard(v, spec), tuple(shard(x, spec) for x in pages), table
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
