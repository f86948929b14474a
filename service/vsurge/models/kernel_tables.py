"""Block sizes and VMEM limits of the ragged paged attention kernel, per TPU generation and shape class.

JAX's kernel looks its block sizes up by the *local* device (`get_tuned_block_sizes` reads
``jax.devices()`` and raises off TPU), so a program lowered on a CPU machine for a TPU, or for another
generation than the one at hand, would get no sizes or the wrong ones. Here the generation is an argument:
chosen by ``device_kind`` (``"TPU v5 lite"`` is a v5e, ``"TPU v5"`` a v5p, ``"TPU v6 lite"`` a v6e), and
the sizes are always passed to the kernel.

Each entry says where it comes from (``BlockSizes.source``):

* ``measured``: timed on the chip (v5e, TPU probe 1 of 2026-12-05: 64 decode rows of Llama-3.2-1B shape,
  ctx 400, head_dim 64 padded to 128, 16 layers: ps=128 kvb=4 qb=8 3.62 ms, the best; ps=64 kvb=8 qb=32
  4.81 ms; JAX's tuned default 6.97 ms; kvb=16 qb=64 ran out of VMEM at compile);
* ``derived``: the measured rule carried to another page size (512 keys per block, as both measured
  points have);
* ``inherited``: JAX's own tuned table (jax/experimental/pallas/ops/tpu/ragged_paged_attention/
  tuned_block_sizes.py, keyed by the first two words of the device kind, so v5e and v5p share one) or,
  where it has no entry for the shape, its default (128 pages, 32 queries), as JAX would pick them.

Two shape classes: ``decode`` (a step whose query tokens are mostly decode rows, one query each) and
``prefill`` (chunks of many queries per sequence). Whatever the entry, the sizes are clamped to the call's
shapes and shrunk until the kernel's VMEM estimate fits the class's ``vmem_limit_bytes`` (JAX's default of
128 pages per block would need 64 MiB at page_size 128 and 32 pages per sequence for Llama-1B).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

MIB = 1 << 20
DECODE, PREFILL = "decode", "prefill"
_JAX_DEFAULT = (128, 32)  # JAX's block sizes where its table has no entry (tuned_block_sizes.py)


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation: how it names itself and what the kernel may use on it."""

    name: str  # v5e, v5p, v6e
    device_kinds: tuple[str, ...]  # jax Device.device_kind values
    jax_table: str  # the key of JAX's tuned table ("TPU v5", "TPU v6")
    num_cores: int  # TensorCores per jax device (megacore)
    vmem_bytes: int  # VMEM per TensorCore
    vmem_limit: dict  # shape class -> vmem_limit_bytes passed to the kernel
    default_page_size: int
    page_size_source: str
    # (shape class, page size) -> (kv pages per block, queries per block), timed on the chip
    measured: dict = dataclasses.field(default_factory=dict)


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation(
            "v5e",
            ("TPU v5 lite", "TPU v5e"),
            "TPU v5",
            1,
            128 * MIB,
            {DECODE: 32 * MIB, PREFILL: 64 * MIB},
            128,
            "measured: ps=128 decodes 1.33x faster than ps=64 (TPU probe 1)",
            {(DECODE, 128): (4, 8), (DECODE, 64): (8, 32)},
        ),
        Generation(
            "v5p",
            ("TPU v5", "TPU v5p"),
            "TPU v5",
            2,
            64 * MIB,
            {DECODE: 24 * MIB, PREFILL: 40 * MIB},
            128,
            "not measured: as on v5e",
        ),
        Generation(
            "v6e",
            ("TPU v6 lite", "TPU v6e"),
            "TPU v6",
            1,
            128 * MIB,
            {DECODE: 32 * MIB, PREFILL: 64 * MIB},
            128,
            "not measured: as on v5e",
        ),
    )
}
_DECODE_KEYS_PER_BLOCK = 512  # both measured v5e decode points read 512 keys per block


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """What the kernel is called with, and why."""

    num_kv_pages_per_block: int
    num_queries_per_block: int
    vmem_limit_bytes: int | None
    source: str

    def kernel_kwargs(self) -> dict:
        return {
            "num_kv_pages_per_block": self.num_kv_pages_per_block,
            "num_queries_per_block": self.num_queries_per_block,
            "vmem_limit_bytes": self.vmem_limit_bytes,
        }


def generation_for(device_kind: str | None) -> Generation | None:
    """The generation a jax ``device_kind`` names (None: not a TPU this table knows)."""
    if device_kind is None:
        return None
    return next((g for g in GENERATIONS.values() if device_kind in g.device_kinds), None)


def resolve_generation(generation: str) -> Generation:
    """A generation by its name (``v5e``) or by a device kind (``TPU v5 lite``)."""
    g = GENERATIONS.get(generation) or generation_for(generation)
    if g is None:
        known = ", ".join(f"{n} ({', '.join(x.device_kinds)})" for n, x in GENERATIONS.items())
        raise ValueError(f"unknown TPU generation {generation!r}; known: {known}")
    return g


def _unknown(device_kind: str | None) -> Generation:
    """A chip this table does not know (v4, 7x, none): JAX's table for its name, JAX's defaults, no VMEM
    limit passed (the compiler's default; the blocks are still shrunk to fit the smallest one, 16 MiB)."""
    name = device_kind or "unknown"
    table = " ".join(name.split()[:2])
    return Generation(name, (name,), table, 1, 16 * MIB, {DECODE: None, PREFILL: None}, 128, "unknown chip")


def default_page_size(device_kind: str | None, fallback: int = 128) -> int:
    """Tokens per KV page on this chip (``fallback`` where the table does not know it)."""
    g = generation_for(device_kind)
    return g.default_page_size if g is not None else fallback


def heads_per_block(num_q_heads: int, num_combined_kv_heads: int, q_dtype, kv_dtype) -> tuple[int, int]:
    """(query heads, combined kv heads) the kernel takes per block: its own rule (get_min_heads_per_blk),
    restated so that an untileable shape is a message here rather than a ValueError deep in tracing."""

    def packing(dtype) -> int:
        return max(1, 4 // jnp.dtype(dtype).itemsize)

    def tiles(x: int, pack: int) -> bool:
        return x % pack == 0 and (x // pack in (1, 2, 4, 8) or (x // pack) % 8 == 0)

    kv_pack = packing(kv_dtype)
    if not tiles(num_combined_kv_heads, kv_pack):
        raise ValueError(
            f"{num_combined_kv_heads} combined kv heads cannot be tiled for {jnp.dtype(kv_dtype)}"
        )
    ratio = num_q_heads // (num_combined_kv_heads // 2)
    most = 8 * kv_pack
    combined = most if num_combined_kv_heads % most == 0 else num_combined_kv_heads
    q = combined // 2 * ratio
    if tiles(q, packing(q_dtype)):
        return q, combined
    return num_q_heads, num_combined_kv_heads


def vmem_estimate(
    kv_pages_per_block: int,
    queries_per_block: int,
    *,
    page_size: int,
    q_heads_per_block: int,
    combined_kv_heads_per_block: int,
    head_dim: int,
    q_dtype,
    kv_dtype,
) -> int:
    """Bytes of VMEM one kernel instance holds: the double-buffered KV block, the pipelined query and
    output blocks, the f32 accumulator, the softmax statistics (kept 128 lanes wide) and one kv head's
    f32 scores (the kernel walks the heads of a block one at a time). Checked against the probe:
    kvb=16 qb=64 at ps=128 (Llama-1B) is ~23 MiB (it ran out of v5e's default 16 MiB), kvb=4 qb=8
    ~4.7 MiB."""
    kvh = combined_kv_heads_per_block // 2
    ratio = q_heads_per_block // max(1, kvh)
    kv = 2 * kv_pages_per_block * page_size * combined_kv_heads_per_block * head_dim
    kv *= jnp.dtype(kv_dtype).itemsize
    q_out = 2 * 2 * queries_per_block * q_heads_per_block * head_dim * jnp.dtype(q_dtype).itemsize
    acc = queries_per_block * q_heads_per_block * head_dim * 4
    stats = 2 * kvh * queries_per_block * ratio * 128 * 4
    scores = queries_per_block * ratio * kv_pages_per_block * page_size * 4
    return kv + q_out + acc + stats + scores


def _jax_table_entry(g: Generation, key: tuple) -> tuple[int, int] | None:
    """JAX's tuned entry for the simplified key, if its table has one (read, never called by device)."""
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned
    except ImportError:  # pragma: no cover - depends on the jax build
        return None
    return tuned.TUNED_BLOCK_SIZES.get(g.jax_table, {}).get(tuned.simplify_key(key))


def block_sizes(
    generation: str | Generation | None,
    *,
    shape_class: str,
    q_dtype,
    kv_dtype,
    num_q_heads: int,
    num_combined_kv_heads: int,
    head_dim: int,
    page_size: int,
    num_tokens: int,
    pages_per_seq: int,
) -> BlockSizes:
    """The kernel's block sizes and VMEM limit for one call's (per-shard) shapes on ``generation`` (a
    name, a device kind, or None / a kind this table does not know: JAX's defaults, see `_unknown`)."""
    if shape_class not in (DECODE, PREFILL):
        raise ValueError(f"shape_class must be {DECODE!r} or {PREFILL!r}, got {shape_class!r}")
    if isinstance(generation, Generation):
        g = generation
    else:
        g = GENERATIONS.get(generation or "") or generation_for(generation) or _unknown(generation)
    qh, ckh = heads_per_block(num_q_heads, num_combined_kv_heads, q_dtype, kv_dtype)
    key = (q_dtype, kv_dtype, qh, ckh // 2, head_dim, page_size, num_tokens, pages_per_seq)
    if (shape_class, page_size) in g.measured:
        (kvb, qb), source = g.measured[(shape_class, page_size)], f"measured on {g.name}"
    elif shape_class == DECODE and g.measured:
        kvb, qb = max(1, _DECODE_KEYS_PER_BLOCK // page_size), 8
        source = f"derived from the measured {g.name} decode entries"
    elif (entry := _jax_table_entry(g, key)) is not None:
        (kvb, qb), source = entry, f"inherited: jax's tuned table [{g.jax_table!r}]"
    else:
        (kvb, qb), source = _JAX_DEFAULT, "inherited: jax's default (no tuned entry)"
    kvb, qb = max(1, min(kvb, pages_per_seq)), max(1, min(qb, num_tokens))
    limit = g.vmem_limit[shape_class]
    fits = limit or 16 * MIB

    def need(kvb: int, qb: int) -> int:
        return vmem_estimate(
            kvb,
            qb,
            page_size=page_size,
            q_heads_per_block=qh,
            combined_kv_heads_per_block=ckh,
            head_dim=head_dim,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
        )

    shrunk = False
    while need(kvb, qb) > fits and (kvb > 1 or qb > 8):
        kvb, qb = (kvb // 2, qb) if kvb > 1 else (kvb, qb // 2)
        shrunk = True
    if shrunk:
        source += f", shrunk to fit {fits // MIB} MiB of VMEM"
    return BlockSizes(kvb, qb, limit, source)


def table_rows() -> list[dict]:
    """The table as rows (for docs and the benchmark's report): every measured entry, and per
    generation what the rest comes from."""
    rows = []
    for g in GENERATIONS.values():
        for (cls, ps), (kvb, qb) in sorted(g.measured.items()):
            rows.append(
                dict(generation=g.name, shape_class=cls, page_size=ps, kvb=kvb, qb=qb, source="measured")
            )
        rows.append(
            dict(
                generation=g.name,
                shape_class="other",
                page_size=g.default_page_size,
                kvb=None,
                qb=None,
                source=f"derived / inherited from jax's {g.jax_table!r} table",
            )
        )
    return rows
