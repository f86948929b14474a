"""Attention backends against a plain numpy softmax: chunked dense decode and packed prefill."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vsurge.models import tpu_lowering as tl
from vsurge.models.attention import DenseDecodeAttention, PrefillAttention, prefill_block, use_dense_reader

# Every dense read runs in both forms: "heads" (XLA:CPU's, per-head 4-d contractions) and "flat" (TPU's,
# block-diagonal queries against the flat rows), on the flat cache the engine keeps and on a 4-d one.
READERS = pytest.mark.parametrize("reader", ["heads", "flat"])


def _softmax_attend(q, k, v, allowed):
    """q [H, D], k/v [N, KVH, D], allowed bool[N] -> [H, D] (GQA: head h reads kv head h // group)."""
    h, d = q.shape
    group = h // k.shape[1]
    out = np.zeros((h, d), np.float64)
    for i in range(h):
        s = (k[:, i // group] @ q[i]) / np.sqrt(d)
        s = np.where(allowed, s, -np.inf)
        p = np.exp(s - s.max())
        out[i] = (p / p.sum()) @ v[:, i // group]
    return out


@pytest.mark.parametrize(
    "positions, window, limit",
    [
        ([0, 5, 99, 40], None, None),  # the last chunk (96..99 of 100) is shifted back and masked
        ([17, 64, 80, 3], 20, None),  # sliding window: early chunks entirely masked for some rows
        ([30, 2, 70, 71], None, 72),  # limit from the host: stale positions beyond it are not read
    ],
)
@READERS
@pytest.mark.parametrize("flat", [True, False])
def test_chunked_dense_decode_matches_softmax(positions, window, limit, reader, flat):
    rng = np.random.default_rng(0)
    s, m, kvh, g, d = 4, 100, 2, 3, 8
    kc = rng.normal(size=(s, m, kvh, d)).astype(np.float32)
    vc = rng.normal(size=(s, m, kvh, d)).astype(np.float32)
    q = rng.normal(size=(s, 1, kvh * g, d)).astype(np.float32)
    k = rng.normal(size=(s, 1, kvh, d)).astype(np.float32)
    v = rng.normal(size=(s, 1, kvh, d)).astype(np.float32)
    pos = np.array(positions, np.int32)
    meta = jnp.asarray(pos) if limit is None else (jnp.asarray(pos), jnp.int32(limit))
    backend = DenseDecodeAttention(window=window, chunk=16)
    layout = (lambda x: x.reshape(s, m, kvh * d)) if flat else (lambda x: x)
    with use_dense_reader(reader):
        out, (kn, vn) = backend(
            jnp.asarray(q),
            jnp.asarray(k),
            jnp.asarray(v),
            (jnp.asarray(layout(kc)), jnp.asarray(layout(vc))),
            meta,
        )
    assert kn.shape == layout(kc).shape  # the cache comes back in the layout it was given
    kn, vn = np.asarray(kn).reshape(kc.shape), np.asarray(vn).reshape(vc.shape)
    for r in range(s):
        kc[r, pos[r]], vc[r, pos[r]] = k[r, 0], v[r, 0]
        n = np.arange(m)
        allowed = n <= pos[r]
        if window is not None:
            allowed &= pos[r] - n < window
        want = _softmax_attend(q[r, 0], kc[r], vc[r], allowed)
        np.testing.assert_allclose(np.asarray(out[r, 0]), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(kn), kc)  # the new token's K/V written in place
    np.testing.assert_array_equal(np.asarray(vn), vc)


@pytest.mark.parametrize("block", [64, 6])  # one block, and blocks of queries that end mid-prompt
def test_packed_prefill_attends_within_each_prompt(block):
    # Three prompts packed in one row (positions restart at 0): each token's output equals attention over
    # its own prompt alone; the padding after them changes nothing.
    rng = np.random.default_rng(1)
    lengths = [5, 9, 3]
    t, kvh, g, d = 20, 2, 2, 8
    segments = np.concatenate([np.full(n, j) for j, n in enumerate(lengths)] + [np.full(t - 17, 3)])
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(t - 17, int)]).astype(np.int32)
    q = rng.normal(size=(1, t, kvh * g, d)).astype(np.float32)
    k = rng.normal(size=(1, t, kvh, d)).astype(np.float32)
    v = rng.normal(size=(1, t, kvh, d)).astype(np.float32)
    meta = (jnp.asarray(positions[None]), jnp.asarray([sum(lengths)]), jnp.asarray(segments[None]))
    out, _ = PrefillAttention(block=block)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None, meta)
    start = 0
    for n in lengths:
        for i in range(n):
            allowed = np.zeros(t, bool)
            allowed[start : start + i + 1] = True
            want = _softmax_attend(q[0, start + i], k[0], v[0], allowed)
            np.testing.assert_allclose(np.asarray(out[0, start + i]), want, rtol=2e-5, atol=2e-5)
        start += n


@pytest.mark.parametrize("window", [None, 5])
def test_blocked_prefill_equals_one_softmax(window):
    """Rows of different lengths, queries a block at a time (blocks of 7 over 30 positions): the same
    outputs as one softmax over the whole row, sliding window included."""
    rng = np.random.default_rng(2)
    b, t, kvh, g, d = 2, 30, 2, 3, 8
    q = jnp.asarray(rng.normal(size=(b, t, kvh * g, d)).astype(np.float32))
    k = jnp.asarray(rng.normal(size=(b, t, kvh, d)).astype(np.float32))
    v = jnp.asarray(rng.normal(size=(b, t, kvh, d)).astype(np.float32))
    meta = (jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), jnp.asarray([30, 17]))
    whole, _ = PrefillAttention(window=window, block=t)(q, k, v, None, meta)
    blocked, _ = PrefillAttention(window=window, block=7)(q, k, v, None, meta)
    np.testing.assert_allclose(np.asarray(blocked)[0], np.asarray(whole)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(blocked)[1, :17], np.asarray(whole)[1, :17], rtol=1e-5, atol=1e-5)


def test_prefill_blocks_by_backend():
    """A prefill traced for a TPU computes 512 queries per block (each block is unrolled per layer into
    the program a start compiles), on CPU 64; the TPU's blocks give the same outputs."""
    rng = np.random.default_rng(4)
    b, t, kvh, g, d = 1, 600, 1, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, kvh * g, d)).astype(np.float32))
    k = jnp.asarray(rng.normal(size=(b, t, kvh, d)).astype(np.float32))
    v = jnp.asarray(rng.normal(size=(b, t, kvh, d)).astype(np.float32))
    meta = (jnp.arange(t, dtype=jnp.int32)[None], jnp.asarray([t]))
    assert prefill_block() == 64
    with tl.targeting("v5e", None):
        assert prefill_block() == 512
        tpu_text = jax.jit(lambda *a: PrefillAttention()(*a, None, meta)[0]).lower(q, k, v).as_text()
    cpu_text = jax.jit(lambda *a: PrefillAttention()(*a, None, meta)[0]).lower(q, k, v).as_text()
    # one exp per block of queries: 2 blocks for a TPU, 10 on CPU
    assert tpu_text.count("stablehlo.exponential") < cpu_text.count("stablehlo.exponential")
    cpu, _ = PrefillAttention()(q, k, v, None, meta)
    tpu, _ = PrefillAttention(block=prefill_block() * 8)(q, k, v, None, meta)
    np.testing.assert_allclose(np.asarray(tpu), np.asarray(cpu), rtol=1e-5, atol=1e-5)


def _rows(rng, s, m, t, kvh, g, d):
    kc = rng.normal(size=(s, m, kvh, d)).astype(np.float32)
    vc = rng.normal(size=(s, m, kvh, d)).astype(np.float32)
    q = rng.normal(size=(s, t, kvh * g, d)).astype(np.float32)
    k = rng.normal(size=(s, t, kvh, d)).astype(np.float32)
    v = rng.normal(size=(s, t, kvh, d)).astype(np.float32)
    return kc, vc, q, k, v


def _live_rows(backend, kc, vc, q, k, v, pos, lengths) -> np.ndarray:
    """The backend's output over rows with per-row read lengths; rows of length 0 must come out 0."""
    cache = (jnp.asarray(kc), jnp.asarray(vc))
    out, _ = backend(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cache, (jnp.asarray(pos), jnp.asarray(lengths))
    )
    out = np.asarray(out)
    np.testing.assert_array_equal(out[lengths == 0], 0)
    return out


@READERS
@pytest.mark.parametrize("s, spread", [(20, True), (32, True), (32, False)])
def test_rows_read_in_sorted_groups_match_softmax(s, spread, reader):
    # More rows than READ_GROUP: rows are sorted by the length they read and, when lengths differ enough
    # (spread), read in groups, each group stopping after its own longest row; else in one pass. Every
    # live row gets its exact attention either way (groups of unequal lengths, a last group smaller than
    # READ_GROUP at 20 rows); an idle row (length 0) comes out 0.
    from vsurge.models.attention import READ_GROUP

    assert s > READ_GROUP
    rng = np.random.default_rng(2)
    m, kvh, g, d = 100, 2, 3, 8
    kc, vc, q, k, v = _rows(rng, s, m, 1, kvh, g, d)
    pos = rng.integers(0, m, size=s) if spread else rng.integers(m - 6, m, size=s)
    pos = pos.astype(np.int32)
    live = rng.random(s) < 0.7 if spread else np.ones(s, bool)
    live[:2] = [True, not spread]
    lengths = np.where(live, pos + 1, 0).astype(np.int32)
    with use_dense_reader(reader):
        out = _live_rows(DenseDecodeAttention(chunk=16), kc, vc, q, k, v, pos, lengths)
    for r in np.flatnonzero(live):
        kc[r, pos[r]], vc[r, pos[r]] = k[r, 0], v[r, 0]
        want = _softmax_attend(q[r, 0], kc[r], vc[r], np.arange(m) <= pos[r])
        np.testing.assert_allclose(np.asarray(out[r, 0]), want, rtol=2e-5, atol=2e-5)


@READERS
def test_verify_rows_read_in_sorted_groups_match_softmax(reader):
    # The verify step's attention (T new tokens per row) reads the same way: token t of row r sees the
    # row's cache up to its own position, the new tokens before it included; idle rows read nothing.
    from vsurge.engines.dense.spec_verify import DenseVerifyAttention

    rng = np.random.default_rng(3)
    s, m, t, kvh, g, d = 12, 90, 3, 2, 2, 8
    kc, vc, q, k, v = _rows(rng, s, m, t, kvh, g, d)
    pos = rng.integers(0, m - t, size=s).astype(np.int32)
    live = np.ones(s, bool)
    live[[3, 7]] = False
    lengths = np.where(live, pos + t, 0).astype(np.int32)
    with use_dense_reader(reader):
        out = _live_rows(DenseVerifyAttention(chunk=16), kc, vc, q, k, v, pos, lengths)
    for r in np.flatnonzero(live):
        kc[r, pos[r] : pos[r] + t], vc[r, pos[r] : pos[r] + t] = k[r], v[r]
        for i in range(t):
            want = _softmax_attend(q[r, i], kc[r], vc[r], np.arange(m) <= pos[r] + i)
            np.testing.assert_allclose(np.asarray(out[r, i]), want, rtol=2e-5, atol=2e-5)
