"""The ragged kernel's block sizes per TPU generation (models/kernel_tables.py): chosen by device kind,
measured where measured, JAX's own table elsewhere, always within VMEM and the call's shapes."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned

from vsurge.models import kernel_tables as kt

BF16 = jnp.bfloat16
# Llama-3.2-1B (32 query heads, 8 kv heads, head_dim 64 padded to 128) at tp=1
LLAMA_1B = dict(q_dtype=BF16, kv_dtype=BF16, num_q_heads=32, num_combined_kv_heads=16, head_dim=128)


def test_generations_by_device_kind():
    assert kt.generation_for("TPU v5 lite").name == "v5e"
    assert kt.generation_for("TPU v5").name == "v5p"
    assert kt.generation_for("TPU v6 lite").name == "v6e"
    assert kt.generation_for("cpu") is None and kt.generation_for(None) is None
    assert kt.resolve_generation("v6e") is kt.resolve_generation("TPU v6 lite")
    with pytest.raises(ValueError, match="unknown TPU generation 'v9'"):
        kt.resolve_generation("v9")
    assert kt.default_page_size("TPU v5 lite") == 128 and kt.default_page_size("cpu", 64) == 64


def test_v5e_decode_is_the_measured_entry():
    """64 decode rows of the 1B shape: the probe's best (ps=128: 4 pages, 8 queries per block), and the
    measured ps=64 point; other page sizes keep its 512 keys per block."""
    at = dict(LLAMA_1B, shape_class=kt.DECODE, num_tokens=64, pages_per_seq=32)
    best = kt.block_sizes("TPU v5 lite", page_size=128, **at)
    assert (best.num_kv_pages_per_block, best.num_queries_per_block) == (4, 8)
    assert best.source == "measured on v5e" and best.vmem_limit_bytes == 32 * kt.MIB
    ps64 = kt.block_sizes("v5e", page_size=64, **{**at, "pages_per_seq": 64})
    assert (ps64.num_kv_pages_per_block, ps64.num_queries_per_block) == (8, 32)
    ps32 = kt.block_sizes("v5e", page_size=32, **{**at, "pages_per_seq": 128})
    assert (ps32.num_kv_pages_per_block, ps32.source) == (16, "derived from the measured v5e decode entries")


@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e"])
def test_prefill_entries_are_jaxs_table(generation):
    """Where JAX tuned the shape, its entry (by its own key simplification, on its table for the chip's
    name) is what the kernel gets."""
    g = kt.resolve_generation(generation)
    key = (BF16, BF16, 32, 8, 128, 128, 512, 8)  # 512 tokens, 1024 positions
    want = tuned.TUNED_BLOCK_SIZES[g.jax_table][tuned.simplify_key(key)]
    got = kt.block_sizes(
        generation, shape_class=kt.PREFILL, page_size=128, num_tokens=512, pages_per_seq=8, **LLAMA_1B
    )
    assert (got.num_kv_pages_per_block, got.num_queries_per_block) == want
    assert got.source.startswith("inherited: jax's tuned table")


def test_sizes_fit_the_call_and_vmem():
    # JAX's default (128 pages) is clamped to the table width and the query count
    small = kt.block_sizes(
        "v6e", shape_class=kt.DECODE, page_size=128, num_tokens=4, pages_per_seq=2, **LLAMA_1B
    )
    assert (small.num_kv_pages_per_block, small.num_queries_per_block) == (2, 4)
    # 32 pages of 128 at head_dim 256 would need ~70 MiB: shrunk until the estimate fits the limit
    wide = dict(LLAMA_1B, head_dim=256)
    big = kt.block_sizes(
        "v5p", shape_class=kt.PREFILL, page_size=128, num_tokens=512, pages_per_seq=32, **wide
    )
    assert "shrunk" in big.source
    need = kt.vmem_estimate(
        big.num_kv_pages_per_block,
        big.num_queries_per_block,
        page_size=128,
        q_heads_per_block=32,
        combined_kv_heads_per_block=16,
        head_dim=256,
        q_dtype=BF16,
        kv_dtype=BF16,
    )
    assert need <= big.vmem_limit_bytes == 40 * kt.MIB


def test_vmem_estimate_matches_the_probe():
    """On v5e the probe compiled kvb=4 qb=8 and ran out of VMEM (default scoped limit 16 MiB) at
    kvb=16 qb=64, for the 1B shape at ps=128."""
    kw = dict(page_size=128, q_heads_per_block=32, combined_kv_heads_per_block=16, head_dim=128)
    assert kt.vmem_estimate(4, 8, q_dtype=BF16, kv_dtype=BF16, **kw) < 16 * kt.MIB
    assert kt.vmem_estimate(16, 64, q_dtype=BF16, kv_dtype=BF16, **kw) > 16 * kt.MIB


def test_unknown_chips_get_jaxs_defaults_without_a_limit():
    got = kt.block_sizes(
        "TPU v4", shape_class=kt.DECODE, page_size=16, num_tokens=64, pages_per_seq=8, **LLAMA_1B
    )
    assert (got.num_kv_pages_per_block, got.num_queries_per_block, got.vmem_limit_bytes) == (8, 32, None)


def test_heads_per_block_is_the_kernels_rule():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

    for q, ckv, dtype in [
        (32, 16, BF16),
        (4, 2, BF16),
        (8, 4, jnp.float32),
        (28, 8, BF16),
        (16, 2, jnp.float32),
    ]:
        assert kt.heads_per_block(q, ckv, dtype, dtype) == get_min_heads_per_blk(q, ckv, dtype, dtype)
    with pytest.raises(ValueError, match="cannot be tiled"):
        kt.heads_per_block(8, 6, jnp.int8, jnp.int8)


def test_table_rows_name_their_sources():
    rows = kt.table_rows()
    measured = [
        (r["generation"], r["page_size"], r["kvb"], r["qb"]) for r in rows if r["source"] == "measured"
    ]
    assert measured == [("v5e", 64, 8, 32), ("v5e", 128, 4, 8)]
    assert {r["generation"] for r in rows} == {"v5e", "v5p", "v6e"}
