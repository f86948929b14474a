"""The TPU attention path on CPU: the ragged Pallas kernel's call in shard_map, on an 8-device CPU mesh.

What runs on TPU is `pallas_sharded.paged_attention` / `ragged_attention` (called from paged_attention.py's
`_pallas`), each a `shard_map` over the engine's mesh with the Mosaic kernel inside. Here the same
functions, the same call sites and the same shardings run with the kernel in Pallas' TPU interpret mode
where this jax can interpret it; where it cannot (`interpret_failure` says why, and the kernel tests
skip with that reason), with the kernel's pure-JAX reference in its place. The engine's greedy tokens
with ``attention="pallas"`` must equal those with ``attention="jax"`` on tp=1, 2, 4, 8 and dp=2 x tp=4.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_greedy import greedy_steps, sharp_checkpoint

import vsurge
from vsurge.cli.main import parse_serve_config
from vsurge.contracts.engine_config import EngineConfig
from vsurge.models import pallas_sharded as ps
from vsurge.models.paged_attention import (
    PagedDecodeAttention,
    PagedPrefillAttention,
    gather_kv,
    ragged_paged_attention_xla,
    use_pallas,
)
from vsurge.models.sharding import make_mesh
from vsurge.seed_api.engines import oEngine

MESHES = ["tp=1", "tp=2", "tp=4", "tp=8", "dp=2,tp=4"]
# kv_heads=8 so tp=8 splits them; head_dim=128 so the shapes are ones the TPU kernel takes
MODEL = dict(hidden=64, heads=8, kv_heads=8, head_dim=128, layers=1)
ENGINE = dict(
    page_size=8,
    max_concurrent_decodes=2,
    max_length=32,
    prefill_lengths=[16],
    min_decode_tokens=32,
    enable_prefix_caching=False,
)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


@pytest.fixture(autouse=True)
def _unconfigured():
    """Every test leaves the process-wide attention setting as it found it (unconfigured)."""
    yield
    ps.reset()


def _kernel_here() -> str:
    return "interpret" if ps.interpret_failure() is None else "reference"


# ------------------------------------------------------------------------------------------ the kernel


def _inputs(rng, s=4, h=8, kvh=8, d=128, page_size=4, num_pages=17, width=4):
    pages = jnp.asarray(rng.randn(num_pages, page_size, 2 * kvh, d), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(s, width).astype(np.int32))
    q = jnp.asarray(rng.randn(s, 1, h, d), jnp.float32)
    return q, pages, table


def _dense_decode(q, pages, table, kv_lens):
    """Plain attention of each row's query over its first kv_len keys (gathered densely)."""
    ks, vs = gather_kv(pages, table)
    s, _, h, d = q.shape
    kvh = ks.shape[2]
    qg = q[:, 0].reshape(s, kvh, h // kvh, d) / np.sqrt(d)
    scores = jnp.einsum("skgd,snkd->skgn", qg, ks)
    ok = jnp.arange(ks.shape[1])[None, :] < kv_lens[:, None]
    probs = jax.nn.softmax(jnp.where(ok[:, None, None], scores, -1e30), axis=-1)
    return jnp.einsum("skgn,snkd->skgd", probs, vs).reshape(s, 1, h, d)


@pytest.mark.parametrize("spec", MESHES)
def test_interpreted_kernel_in_shard_map_equals_reference(spec):
    """The Mosaic kernel itself, interpreted, inside the shard_map it runs in on TPU."""
    why = ps.interpret_failure()
    if why is not None:
        known = "ReshapeTransform" in why  # jax 0.10: the interpreter indexes refs, it cannot reshape one
        pytest.skip(
            "jax.experimental.pallas.ops.tpu.ragged_paged_attention cannot run in Pallas' TPU interpret mode "
            f"here ({why})"
            + (
                ": its kernel reshapes a VMEM ref, which the interpreter's ref indexing does not support"
                if known
                else ""
            )
            + "; the shard_map wrapping runs with the reference kernel in the other tests"
        )
    q, pages, table = _inputs(np.random.RandomState(0))
    kv_lens = jnp.asarray([1, 6, 10, 16], jnp.int32)
    got = jax.jit(lambda *a: ps.paged_attention(*a, mesh=make_mesh(spec), kernel="interpret"))(
        q, pages, kv_lens, table
    )
    np.testing.assert_allclose(got, jax.jit(_dense_decode)(q, pages, table, kv_lens), rtol=2e-5, atol=2e-5)


def test_reference_kernel_is_the_kernels_semantics():
    """The stand-in follows the kernel's rule on a mixed batch (decode rows, a chunk after a prefix,
    padding rows: zeros) as the mixed step's XLA ragged attention computes it."""
    rng = np.random.RandomState(1)
    _, pages, table = _inputs(rng)
    # two decode rows, then a 5-token chunk whose sequence has 11 keys, then 3 padding rows
    flat = jnp.asarray(rng.randn(10, 8, 128), jnp.float32)
    lens, cu = jnp.asarray([7, 3, 11, 1], jnp.int32), jnp.asarray([0, 1, 2, 7, 7], jnp.int32)
    num = jnp.asarray([3], jnp.int32)

    @jax.jit
    def run():  # one program for both: each compile costs more than the attention itself
        return (
            ps.ragged_attention(flat, pages, lens, table, cu, num, kernel="reference"),
            ragged_paged_attention_xla(flat, pages, lens, table, cu, num, page_size=4, num_decode=2),
        )

    got, want = run()
    np.testing.assert_allclose(got[:7], want[:7], rtol=2e-5, atol=2e-5)
    assert not np.any(np.asarray(got[7:]))


def test_call_sites_in_shard_map_equal_pure_jax():
    """Decode and a right-padded prefill chunk through paged_attention.py's backends: the kernel path
    (configured as an engine configures it) on dp=2 x tp=4 equals the pure-JAX path on one device (the
    engine tests below take the same call sites through every mesh)."""
    rng = np.random.RandomState(2)
    q, pages, table = _inputs(rng)
    k, v = (jnp.asarray(rng.randn(4, 1, 8, 128), jnp.float32) for _ in range(2))
    pos = jnp.asarray([0, 5, 9, 15], jnp.int32)
    split = (pages[:, :, 0::2], pages[:, :, 1::2])
    # a chunk of 3 valid tokens (of 8) at positions 13..15 of a sequence whose first 13 keys are cached
    cq, ck, cv = (jnp.asarray(rng.randn(1, 8, 8, 128), jnp.float32) for _ in range(3))
    meta = ((13 + jnp.arange(8, dtype=jnp.int32))[None], jnp.int32(16), table[3])
    setup = ps.configure("pallas", make_mesh("dp=2,tp=4"))
    assert use_pallas() and setup.kernel == _kernel_here()

    @jax.jit
    def run(cache):  # a split cache takes the pure-JAX path, the combined one the kernel's
        dec, new = PagedDecodeAttention(4, 4)(q, k, v, cache, (pos, table))
        pre, _ = PagedPrefillAttention(4, 4)(cq, ck, cv, cache, meta)
        return dec, pre, new

    (want, want_pre, want_pages), (got, pre, got_pages) = run(split), run(pages)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got_pages[:, :, 0::2], want_pages[0])
    np.testing.assert_allclose(pre[0, :3], want_pre[0, :3], rtol=2e-5, atol=2e-5)
    assert not np.any(np.asarray(pre[0, 3:]))  # padding queries: zeros, never NaN


# ------------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return sharp_checkpoint(tmp_path_factory.mktemp("sharp-llama"), **MODEL)


@pytest.fixture(scope="module")
def jax_tokens(checkpoint):
    tokens, _, _ = greedy_steps(checkpoint, None, "jax", ENGINE)
    ps.reset()
    return tokens


# tp=2 and tp=4 sit between tp=1 and tp=8 / dp=2 x tp=4; they run in `make test` (about 6 s each)
ENGINE_MESHES = [
    "tp=1",
    pytest.param("tp=2", marks=pytest.mark.slow),
    pytest.param("tp=4", marks=pytest.mark.slow),
    "tp=8",
    "dp=2,tp=4",
]


@pytest.mark.parametrize("spec", ENGINE_MESHES)
def test_engine_greedy_tokens_pallas_equal_jax(checkpoint, jax_tokens, spec):
    t0 = time.perf_counter()
    tokens, eng, pages = greedy_steps(checkpoint, spec, "pallas", ENGINE)
    setup = ps.current()
    assert setup.pallas and setup.kernel == _kernel_here(), setup
    assert eng.storage.layout == "combined"  # the kernel's layout: K/V interleaved per head
    pages = pages[0]
    tp = eng.mesh.shape["tp"]
    assert pages.sharding.shard_shape(pages.shape)[2] == 2 * MODEL["kv_heads"] // tp
    assert tokens == jax_tokens, f"{spec}: pallas ({setup.kernel}) {tokens} != jax {jax_tokens}"
    print(f"{spec}: {setup.kernel} kernel, {time.perf_counter() - t0:.1f}s ({setup.reason})")


# ------------------------------------------------------------------------------------------ the switch


def test_attention_switch_and_its_variable():
    assert EngineConfig().attention == "auto"
    with pytest.raises(ValueError, match="attention: must be one of auto, pallas, jax"):
        EngineConfig(attention="mosaic")
    assert parse_serve_config([], {"VSURGE_ATTENTION": "pallas"}).engine.attention == "pallas"
    assert (
        parse_serve_config(["--attention", "jax"], {"VSURGE_ATTENTION": "pallas"}).engine.attention == "jax"
    )
    assert not ps.configure("jax", make_mesh("tp=2")).pallas and not use_pallas()
    auto = ps.configure("auto", None)
    assert auto.pallas == (jax.default_backend() == "tpu")
    assert ps.configure("pallas", None).pallas and use_pallas()


def test_kv_heads_no_tp_layout_splits_are_refused(tiny_checkpoint):
    """Where tp neither divides the kv heads nor is a multiple of them, no layout gives every shard
    whole heads: the engine refuses at start-up, naming the numbers and the tp sizes that work (kv heads
    that divide tp are served replicated: test_paged_layouts.py)."""
    path, _ = tiny_checkpoint("llama", heads=6, kv_heads=3, hidden=48)
    model, tok = vsurge.load_model(path)
    for attention in ("jax", "pallas"):
        with pytest.raises(ValueError, match=r"3 kv heads \(6 query heads\) and tp=2.*use tp in \[1, 3, 6\]"):
            oEngine(model, tok, EngineConfig(mesh="tp=2", attention=attention, **ENGINE))
    assert ps.kv_heads_error(9, 3, 3) is None and ps.kv_heads_error(8, 2, 8) is None
    assert ps.kv_heads_error(4, 2, 8) is not None  # query heads must split over tp too
    # any head_dim takes the kernel (padded); the kv heads per shard must still tile
    assert ps.kernel_shape_error(32, 8, 64, jnp.bfloat16) is None
    assert ps.kernel_shape_error(32, 8, 128, jnp.bfloat16, tp=8) is None
    assert ps.kernel_shape_error(32, 2, 64, jnp.bfloat16, tp=8) is None  # one replicated head per shard
    assert "cannot be tiled for int8" in ps.kernel_shape_error(32, 8, 128, jnp.int8, tp=8)
