"""vEngine's prefill as a chain of programs (embed, one program per decoder layer, finish) and the chunk
program as one too (engines/dense/layered_prefill.py, engines/layered_chunk.py): the same hidden states and K/V
as the model's own forward over the whole stack, one compiled layer program for every layer, the chain
dispatched under the engine's dispatch lock (or, on XLA:CPU, a few programs queued at a time), and the
compile pool starting with the slowest programs."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vsurge
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.engines.dense.warmup import longest_first, program_jobs
from vsurge.engines.dispatch_window import CPU_WINDOW, DispatchWindow
from vsurge.models.attention import ChunkAttention, PrefillAttention
from vsurge.seed_api.engines import vEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return vsurge.load_model(path)


def _engine(tiny, **kw):
    model, tok = tiny
    return vEngine(model, tok, max_concurrent_decodes=4, prefill_lengths=[16, 32], max_length=64, **kw)


def test_the_chain_is_the_models_forward(tiny):
    """Three prompts packed into rows of the engine's prefill: every layer's K/V and each prompt's last
    hidden state equal the model's forward over the whole stack on the same rows (float32, one device)."""
    engine = _engine(tiny)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 31)), [3]]
    packed = engine._pack(prompts, [GREEDY] * 3, None)
    tokens, positions, segments, totals, starts, lengths, _, _ = packed
    prefix = engine._prefill(engine.prefill_params, *packed)
    model = engine.model
    meta = (jnp.asarray(positions), jnp.asarray(totals), jnp.asarray(segments))
    hidden, kv = model(
        jnp.asarray(tokens), jnp.asarray(positions), PrefillAttention(), [None] * len(prefix.kv), meta
    )
    assert len(prefix.kv) == model.config.num_layers
    for (k, v), (k_ref, v_ref) in zip(prefix.kv, kv, strict=True):
        np.testing.assert_allclose(np.asarray(k), np.asarray(k_ref), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(v), np.asarray(v_ref), rtol=1e-5, atol=1e-5)
    r, t = tokens.shape
    last = np.asarray(hidden).reshape(r * t, -1)[np.maximum(starts + lengths - 1, 0)]
    np.testing.assert_allclose(np.asarray(prefix.hidden)[:3], last[:3], rtol=1e-5, atol=1e-5)
    mask = np.asarray(prefix.prompt_mask)
    for j, p in enumerate(prompts):
        assert set(np.flatnonzero(mask[j])) == set(p)
    # one executable serves every layer of a shape
    assert engine._prefill._layer._cache_size() == 1


def test_the_chunk_chain_is_the_models_forward(tiny):
    """A prompt of 40 tokens in chunks of 32 (the largest bucket): the row the chunk chain writes and its
    hidden states equal the model's forward with `ChunkAttention` over the same chunks."""
    engine = _engine(tiny)
    chunked = engine.chunked
    ids = list(range(40, 80))
    rows, last, _ = chunked.run(ids, False)
    model = engine.model
    ref = [(jnp.zeros_like(k), jnp.zeros_like(v)) for k, v in rows]
    hidden = None
    for start in range(0, len(ids), chunked.chunk):
        part = ids[start : start + chunked.chunk]
        b = next(x for x in chunked.buckets if x >= len(part))
        chunk = np.full(b, engine.pad_token_id, np.int32)
        chunk[: len(part)] = part
        positions = (start + jnp.arange(b, dtype=jnp.int32))[None]
        hidden, ref = model(jnp.asarray(chunk)[None], positions, ChunkAttention(), ref, (positions, start))
        ref = [tuple(r) for r in ref]
        n = len(part)
    for (k, v), (k_ref, v_ref) in zip(rows, ref, strict=True):
        np.testing.assert_allclose(np.asarray(k)[:40], np.asarray(k_ref)[:40], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(v)[:40], np.asarray(v_ref)[:40], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(last), np.asarray(hidden)[0, n - 1], rtol=1e-5, atol=1e-5)


def test_the_chain_and_the_decode_steps_take_the_dispatch_lock(tiny):
    """Where the whole chain is queued at once (a TPU; here with the window off), while the engine's
    dispatch lock is held neither a prefill nor a decode step is dispatched: a decode block never lands
    between two layers of a prefill on the device's queue."""
    engine = _engine(tiny, decode_steps=2)
    engine._prefill.window = DispatchWindow(None)  # the TPU's chain: queued at once, under the lock
    state = engine.init_decode_state()
    done = {}

    def prefill():
        done["prefill"] = engine.prefill([1, 2, 3], GREEDY)

    def block():
        done["block"] = engine.decode_block(state)

    for name, fn in (("prefill", prefill), ("block", block)):
        with engine.dispatch_lock:
            t = threading.Thread(target=fn)
            t.start()
            t.join(0.5)
            assert name not in done, f"{name} dispatched while the lock was held"
        t.join(60)
        assert name in done
    jax.block_until_ready(done["prefill"].hidden)


def test_on_cpu_a_chain_keeps_a_window_of_programs_queued(tiny):
    """XLA:CPU blocks a dispatching thread once a device has 32 programs in flight, so a whole chain
    queued at once held every later dispatch (the decode step's) behind the prefill's layers
    (engines/dispatch_window.py). On CPU a prefill returns with at most CPU_WINDOW of its programs still
    queued, every earlier layer's K/V computed; its layers take the decode step's dispatch lock in turns
    (CPU_TURNS), so it waits while the lock is held; the chunk chain keeps the window too."""
    engine = _engine(tiny)
    assert engine._prefill.window.size == CPU_WINDOW and engine.chunked.window.size == CPU_WINDOW
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("prefix", engine.prefill(list(range(5, 30)))))
    with engine.dispatch_lock:  # a decode step dispatching: the prefill's next turn waits for it
        t.start()
        t.join(0.5)
        assert "prefix" not in done, "the CPU chain ran its layers while the dispatch lock was held"
    t.join(60)
    assert "prefix" in done
    prefix = done["prefix"]
    pending = [i for i, (k, v) in enumerate(prefix.kv) if not (k.is_ready() and v.is_ready())]
    assert not pending or min(pending) >= len(prefix.kv) - CPU_WINDOW, pending
    waited = engine.prefill_waited
    rows, _, _ = engine.chunked.run(list(range(40, 80)), False)
    assert len(rows) - sum(k.is_ready() and v.is_ready() for k, v in rows) <= CPU_WINDOW
    assert engine.prefill_waited >= waited


def test_the_pool_starts_with_the_slowest_programs(tiny):
    """The decode blocks first, then the first-token samplers, then the prefill chains and the rest, each
    group in its own order."""
    engine = _engine(tiny, decode_steps=2)
    jobs = program_jobs(engine, engine.init_decode_state())
    jobs += [("first token", engine._first, ()), ("first tokens", engine._firsts, ())]
    names = [name for name, _, _ in longest_first(engine, jobs)]
    blocks = [n for n in names if n.startswith("decode block")]
    assert blocks and names[: len(blocks)] == blocks
    assert names[len(blocks) : len(blocks) + 2] == ["first token", "first tokens"]
    rest = [n for n, _, _ in jobs if n not in blocks and not n.startswith("first token")]
    assert names[len(blocks) + 2 :] == rest


def test_a_serving_vsurge_hands_the_gil_over_sooner(tiny):
    """Started, a vSurge shortens the interpreter's switch interval (drivers/switch_interval.py); the last
    one to stop restores the interval it found."""
    import sys

    from vsurge import vSurge
    from vsurge.drivers.switch_interval import SERVING_SWITCH_S

    model, tok = tiny
    before = sys.getswitchinterval()
    a = vSurge.create_vdriver(model, tok, max_concurrent_decodes=2, prefill_lengths=[16], max_length=32)
    b = vSurge.create_vdriver(model, tok, max_concurrent_decodes=2, prefill_lengths=[16], max_length=32)
    a.start()
    try:
        assert sys.getswitchinterval() == min(before, SERVING_SWITCH_S)
        b.start()
        a.stop()
        assert sys.getswitchinterval() == min(before, SERVING_SWITCH_S)  # b still serves
    finally:
        a.stop()
        b.stop()
    assert sys.getswitchinterval() == before


def test_prompt_masks_packed_on_the_host_are_the_prompts_tokens():
    """`prompt_mask_words` unpacked on the device marks exactly each prompt's tokens (bit 31 included:
    the sign bit of an i32 word), rows past the prompts empty."""
    from vsurge.engines.sampling.penalties import unpack_token_mask
    from vsurge.engines.sampling.state import prompt_mask_words

    vocab = 100
    prompts = [[0, 31, 32, 99, 31], [63, 64], [5]]
    words = prompt_mask_words(prompts, 4, vocab)
    assert words.shape == (4, 4) and words.dtype == np.int32
    mask = np.asarray(unpack_token_mask(jnp.asarray(words), vocab))
    assert mask.shape == (4, vocab)
    for j, p in enumerate(prompts):
        assert set(np.flatnonzero(mask[j])) == set(p)
    assert not mask[3].any()
