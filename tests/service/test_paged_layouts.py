"""The paged cache's layouts (models/kv_layout.py) and the kernel path's fall back, on 8 fake CPU devices.

* head_dim 64 (and 80, 96, 256) on the kernel path: pages padded to 128 lanes; the tokens equal the pure
  JAX path's, and the pages cost (and the log states) the padded bytes;
* kv heads that tp does not divide but divides tp: stored replicated, one per shard; sharded tokens equal
  unsharded ones, on both paths;
* a kernel that fails to compile at start: the engine serves on the pure-JAX path, the reason logged.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_greedy import greedy_steps, greedy_tokens, sharp_checkpoint

import vsurge
from vsurge import vSurge
from vsurge.engines.paged.kernel_fallback import check_kernel
from vsurge.engines.paged.paging import PagedAttentionCache, bytes_per_page
from vsurge.models import greedy_generate
from vsurge.models import pallas_sharded as ps
from vsurge.models.kv_layout import fit_kv, kv_layout
from vsurge.models.paged_attention import PagedDecodeAttention, PagedPrefillAttention, PagedRaggedAttention
from vsurge.models.sharding import make_mesh
from vsurge.seed_api.engines import oEngine
from vsurge.seed_api.request import vSurgeRequest

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

# 2 kv heads (tp=4 and tp=8 store them replicated), head_dim 64 (the kernel path pads it to 128)
MODEL = dict(hidden=64, heads=8, kv_heads=2, head_dim=64, layers=1)
ENGINE = dict(
    page_size=8,
    max_concurrent_decodes=2,
    max_length=32,
    prefill_lengths=[16],
    min_decode_tokens=32,
    enable_prefix_caching=False,
)


@pytest.fixture(autouse=True)
def _unconfigured():
    yield
    ps.reset()


# ------------------------------------------------------------------------------------------ the layout


def test_layouts_replicate_and_pad():
    kv = kv_layout(8, 2, 64, tp=8, kernel=True)
    assert (kv.replicas, kv.stored_kv_heads, kv.padded_head_dim) == (4, 8, 128)
    assert kv.bytes_per_token(jnp.bfloat16, stored=False) == 2 * 2 * 64 * 2
    assert kv.bytes_per_token(jnp.bfloat16) == 2 * 8 * 128 * 2  # 8x: 4 copies, twice the lanes
    assert "head_dim 64 padded to 128" in kv.describe(jnp.bfloat16, 16)
    assert "512 -> 4096" in kv.describe(jnp.bfloat16)
    assert kv_layout(8, 2, 64, tp=8).padded_head_dim == 64  # the pure-JAX paths keep the model's width
    assert kv_layout(32, 8, 128, tp=4, kernel=True) == kv_layout(32, 8, 128, tp=4)  # nothing to change
    for hd, width in [(80, 128), (96, 128), (256, 256), (192, 256)]:
        assert kv_layout(4, 4, hd, kernel=True).padded_head_dim == width
    with pytest.raises(ValueError, match=r"use tp in \[1, 3, 6\]"):
        kv_layout(6, 3, 16, tp=4)


def test_fit_kv_repeats_heads_in_order_and_pads_with_zeros():
    x = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4)  # [N, KVH=3, D=4]
    got = np.asarray(fit_kv(x, 6, 8))
    assert got.shape == (2, 6, 8)
    for j in range(6):  # stored head j is kv head j // 2: tp shard j's query heads read that one
        np.testing.assert_array_equal(got[:, j, :4], np.asarray(x[:, j // 2]))
    assert not got[..., 4:].any()
    with pytest.raises(ValueError):
        fit_kv(x, 4, 4)


def test_the_pages_cost_the_padded_bytes(caplog):
    cfg = SimpleNamespace(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64)
    budget = 64 * bytes_per_page(cfg, 16, jnp.bfloat16)
    ps.configure("jax", make_mesh("tp=4"), cfg, jnp.bfloat16)
    plain = PagedAttentionCache.create(
        cfg, 16, kv_cache_bytes=budget, dtype=jnp.bfloat16, mesh=make_mesh("tp=4")
    )
    ps.configure("pallas", make_mesh("tp=4"), cfg, jnp.bfloat16)
    with caplog.at_level(logging.INFO, logger="vsurge.engines.paged.paging"):
        padded = PagedAttentionCache.create(
            cfg, 16, kv_cache_bytes=budget, dtype=jnp.bfloat16, mesh=make_mesh("tp=4")
        )
    # replicated for tp=4 on both paths (2x), padded on the kernel's (2x more)
    assert (plain.layout, plain.num_kv_heads, plain.head_dim, plain.num_pages) == ("split", 4, 64, 31)
    assert (padded.layout, padded.num_kv_heads, padded.head_dim, padded.num_pages) == ("combined", 4, 128, 15)
    assert padded.nbytes <= budget and plain.nbytes <= budget
    line = next(r.getMessage() for r in caplog.records if "KV bytes per token" in r.getMessage())
    assert "1024 -> 4096" in line and "head_dim 64 padded to 128" in line and "stored 2x" in line
    pages = padded.allocate()[0]
    assert pages.sharding.shard_shape(pages.shape) == (16, 16, 2, 128)  # K and V of one kv head per chip
    back = padded.for_jax_path()
    assert (back.layout, back.num_kv_heads, back.head_dim, back.num_pages) == ("split", 4, 64, 15)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_call_sites_on_padded_replicated_pages_equal_pure_jax(head_dim):
    """Decode, a prefill chunk and a mixed step through paged_attention.py's backends: the kernel path
    (pages padded, 2 kv heads stored 4x at tp=8; the kernel's reference inside shard_map) equals the
    pure-JAX path on the model's own layout, one device."""
    rng = np.random.RandomState(3)
    s, h, kvh, ps_, n = 4, 8, 2, 4, 17
    cfg = SimpleNamespace(num_heads=h, num_kv_heads=kvh, head_dim=head_dim)
    rand = lambda *shape: jnp.asarray(rng.randn(*shape), jnp.float32)  # noqa: E731
    table = jnp.asarray(rng.permutation(np.arange(1, n)).reshape(s, 4).astype(np.int32))
    k0, v0 = rand(n, ps_, kvh, head_dim), rand(n, ps_, kvh, head_dim)
    q, k, v = rand(s, 1, h, head_dim), rand(s, 1, kvh, head_dim), rand(s, 1, kvh, head_dim)
    pos = jnp.asarray([0, 5, 9, 15], jnp.int32)
    cq, ck, cv = rand(1, 8, h, head_dim), rand(1, 8, kvh, head_dim), rand(1, 8, kvh, head_dim)
    chunk_meta = ((13 + jnp.arange(8, dtype=jnp.int32))[None], jnp.int32(16), table[3])
    # a mixed step: rows 0, 1 decode, then a 5-token chunk of a sequence with 11 keys
    fq, fk, fv = rand(1, 7, h, head_dim), rand(1, 7, kvh, head_dim), rand(1, 7, kvh, head_dim)
    ragged_meta = (
        jnp.asarray([7, 3, 11, 1], jnp.int32),
        table,
        jnp.asarray([0, 1, 2, 7, 7], jnp.int32),
        jnp.asarray([3], jnp.int32),
    )

    def run(cache):
        dec, new = PagedDecodeAttention(ps_, 4)(q, k, v, cache, (pos, table))
        pre, new = PagedPrefillAttention(ps_, 4)(cq, ck, cv, new, chunk_meta)
        mix, new = PagedRaggedAttention(ps_, num_decode=2)(fq, fk, fv, new, ragged_meta)
        return dec, pre[0, :3], mix[0]

    ps.configure("jax", None, cfg)
    want = jax.jit(run)((k0, v0))
    setup = ps.configure("pallas", make_mesh("tp=8"), cfg)
    kv = setup.layout
    assert (kv.stored_kv_heads, kv.padded_head_dim) == (8, 128)
    pages = jnp.stack([fit_kv(k0, 8, 128), fit_kv(v0, 8, 128)], axis=-2).reshape(n, ps_, 16, 128)
    got = jax.jit(run)(pages)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------------------------------ engines


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return sharp_checkpoint(tmp_path_factory.mktemp("hd64-kv2"), **MODEL)


@pytest.fixture(scope="module")
def unsharded(checkpoint):
    tokens, _, _ = greedy_steps(checkpoint, None, "jax", ENGINE)
    ps.reset()
    return tokens


@pytest.mark.parametrize(
    "spec, attention",
    [
        ("tp=4", "jax"),
        ("tp=8", "pallas"),
        pytest.param("tp=8", "jax", marks=pytest.mark.slow),
        pytest.param("tp=4", "pallas", marks=pytest.mark.slow),
        pytest.param(None, "pallas", marks=pytest.mark.slow),
    ],
)
def test_sharded_replicated_kv_heads_equal_unsharded(checkpoint, unsharded, spec, attention):
    """2 kv heads at tp=4 / tp=8: served with each kv head stored tp/2 times (one per chip), and the
    greedy tokens are the unsharded pure-JAX engine's (the kernel path also pads head_dim 64 to 128)."""
    tokens, eng, pages = greedy_steps(checkpoint, spec, attention, ENGINE)
    tp = eng.mesh.shape["tp"] if eng.mesh is not None else 1
    layer = pages[0]
    per_chip = max(2, tp) // tp  # kv heads each chip holds: one, once they are replicated
    if attention == "pallas":
        assert eng.storage.layout == "combined" and eng.storage.head_dim == 128
        assert layer.sharding.shard_shape(layer.shape)[2:] == (2 * per_chip, 128)  # K and V side by side
    else:
        assert eng.storage.head_dim == 64
        assert layer[0].sharding.shard_shape(layer[0].shape)[2:] == (per_chip, 64)
    assert eng.storage.num_kv_heads == max(2, tp)
    assert tokens == unsharded, f"{spec} {attention}: {tokens} != {unsharded}"


def test_a_kernel_that_fails_to_lower_falls_back_to_pure_jax(checkpoint, unsharded, monkeypatch, caplog):
    """The Mosaic kernel forced on CPU, where it cannot lower (the real Pallas error): the engine's
    start-up check falls back to pure JAX with the reason logged, keeps its page count, and serves the
    unsharded engine's tokens."""
    monkeypatch.setenv(ps.KERNEL_ENV, "mosaic")
    model, tok = vsurge.load_model(checkpoint)
    eng = oEngine(model, tok, attention="pallas", kv_cache_bytes=2 << 20, **ENGINE)
    assert ps.current().kernel == "mosaic" and eng.storage.layout == "combined"
    pages = eng.storage.num_pages
    with caplog.at_level(logging.WARNING, logger="vsurge.models.pallas_sharded"):
        reason = check_kernel(eng)
    assert "Only interpret mode is supported on CPU backend" in reason and reason in ps.current().reason
    assert any(
        "falls back to pure JAX" in r.getMessage() and reason in r.getMessage() for r in caplog.records
    )
    assert not ps.current().pallas and check_kernel(eng) is None
    assert (eng.storage.layout, eng.storage.head_dim, eng.storage.num_pages) == ("split", 64, pages)
    tokens, _ = greedy_tokens(eng)
    assert tokens == unsharded


@pytest.mark.slow
def test_a_start_on_a_failing_kernel_serves_on_pure_jax(checkpoint, monkeypatch, caplog):
    """The same through vSurge + oDriver: compile() falls back, and the driver (whose scheduler was
    built on the engine's page manager before the fall back) serves the reference tokens."""
    monkeypatch.setenv(ps.KERNEL_ENV, "mosaic")
    model, tok = vsurge.load_model(checkpoint)
    s = vSurge.create_odriver(model, tok, attention="pallas", kv_cache_bytes=1 << 20, **ENGINE)
    eng = s.driver.engine
    pages = eng.storage.num_pages
    with caplog.at_level(logging.WARNING, logger="vsurge.models.pallas_sharded"):
        s.compile()
    assert "Only interpret mode is supported on CPU backend" in ps.current().reason
    assert any("falls back to pure JAX" in r.getMessage() for r in caplog.records)
    assert (eng.storage.layout, eng.storage.num_pages) == ("split", pages)
    s.start()
    try:
        prompts = [[5, 6, 7], list(range(3, 23))]
        reqs = [
            s.submit(
                vSurgeRequest(
                    prompt=p, max_tokens=6, temperature=0.0, ignore_eos=True, is_client_side_tokenization=True
                )
            )
            for p in prompts
        ]
        got = [[t for items in r.channel for x in items for t in x.token_ids] for r in reqs]
    finally:
        s.stop()
    assert got == [list(row[:6]) for row in greedy_generate(model, prompts, 6)]
    assert eng.manager.num_free == eng.manager.num_pages
