"""How the paged KV cache stores a model's kv heads: replicated for tp, padded to the kernel's lanes.

Two choices a model's shapes can force on the paged cache, both decided once when the engine is built
(`kv_layout`) and then read back from the cache's own shape wherever K/V are written (`fit_kv`):

* **Replicated kv heads.** Every tp shard must hold whole kv heads next to the query heads that read
  them. When tp divides the kv heads, each shard holds ``kv_heads / tp`` of them. When the kv heads divide
  tp instead (2 kv heads at tp=8), each kv head is stored ``tp / kv_heads`` times, consecutively, so
  shard ``j`` holds a copy of kv head ``j // replicas``: exactly the one its query heads read (query
  heads split over tp in order). The cache then costs ``replicas`` times the model's KV bytes in all,
  but each chip holds one kv head's worth per layer, as vLLM does. Where neither divides, no layout
  gives every shard whole heads: refused, naming the tp sizes that work.
* **Padded head_dim (kernel path only).** JAX's ragged paged attention kernel keeps its softmax tiles
  128 lanes wide, so head_dim must be a multiple of 128. A head_dim of 64, 80, 96 (or any other) is
  stored padded with zeros to the next multiple of 128: zero K lanes add nothing to q.k, zero V lanes
  give zero output lanes, which are sliced off; the softmax scale is the true head_dim's. The pages
  cost the padded bytes (a head_dim-64 model's KV doubles). The pure-JAX paths keep the model's width.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

LANES = 128


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The paged cache's per-layer geometry for one model on one mesh."""

    kv_heads: int  # the model's
    head_dim: int  # the model's
    replicas: int = 1  # copies of each kv head (tp / kv_heads where kv heads divide tp)
    stored_head_dim: int = 0  # lanes per head in the pages (0: the model's head_dim)

    @property
    def stored_kv_heads(self) -> int:
        return self.kv_heads * self.replicas

    @property
    def padded_head_dim(self) -> int:
        return self.stored_head_dim or self.head_dim

    def bytes_per_token(self, dtype, stored: bool = True) -> int:
        """Bytes of K and V of one token in one layer, over every shard: as stored, or as the model has
        them (``stored=False``)."""
        if not stored:
            return 2 * self.kv_heads * self.head_dim * jnp.dtype(dtype).itemsize
        return 2 * self.stored_kv_heads * self.padded_head_dim * jnp.dtype(dtype).itemsize

    def describe(self, dtype, num_layers: int = 1) -> str:
        """For the start-up log: what one token's K/V costs in this layout against the model's own."""
        model = self.bytes_per_token(dtype, False) * num_layers
        stored = self.bytes_per_token(dtype) * num_layers
        why = []
        if self.padded_head_dim != self.head_dim:
            why.append(f"head_dim {self.head_dim} padded to {self.padded_head_dim} for the TPU kernel")
        if self.replicas > 1:
            why.append(
                f"each of {self.kv_heads} kv heads stored {self.replicas}x so every tp shard holds one"
            )
        how = "; ".join(why) or "the model's layout"
        return f"KV bytes per token (K+V, {num_layers} layers, all shards): {model} -> {stored} ({how})"


def kv_heads_error(num_q_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why the paged cache cannot give every tp shard whole kv heads (None: it can, maybe replicated)."""
    if num_q_heads % tp == 0 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0):
        return None
    ok = [
        n
        for n in range(1, num_q_heads + 1)
        if num_q_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)
    ]
    return (
        f"the paged KV cache gives every tp shard whole kv heads, but the model has {num_kv_heads} kv heads "
        f"({num_q_heads} query heads) and tp={tp}: tp must divide the query heads, and either divide the kv "
        f"heads or be a multiple of them (each kv head then stored tp/kv_heads times); use tp in {ok} "
        "(the rest of the chips can go to dp)"
    )


def kv_layout(
    num_q_heads: int, num_kv_heads: int, head_dim: int, tp: int = 1, kernel: bool = False
) -> KVLayout:
    """The layout of the paged cache for these shapes on ``tp`` shards (``kernel``: the TPU kernel reads
    it, so head_dim is padded to 128 lanes). Raises ValueError where no layout fits (`kv_heads_error`)."""
    err = kv_heads_error(num_q_heads, num_kv_heads, tp)
    if err:
        raise ValueError(err)
    replicas = tp // num_kv_heads if num_kv_heads < tp else 1
    stored = -(-head_dim // LANES) * LANES if kernel else 0
    return KVLayout(num_kv_heads, head_dim, replicas, stored if stored != head_dim else 0)


def fit_kv(x: jnp.ndarray, heads: int, head_dim: int) -> jnp.ndarray:
    """[..., KVH, D] K or V as the pages store them: [..., heads, head_dim] (each head repeated
    heads / KVH times, consecutively; D zero-padded to head_dim)."""
    kvh, d = x.shape[-2], x.shape[-1]
    if heads != kvh:
        if heads % kvh:
            raise ValueError(f"pages of {heads} kv heads cannot hold copies of {kvh}")
        x = jnp.repeat(x, heads // kvh, axis=-2)
    if head_dim != d:
        if head_dim < d:
            raise ValueError(f"pages {head_dim} lanes wide cannot hold head_dim {d}")
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, head_dim - d)])
    return x
