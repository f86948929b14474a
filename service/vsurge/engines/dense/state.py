"""vEngine's dense KV cache: its dtype, shape and shardings, where a prefix must land, and a fresh state.

A mixin of vEngine (vengine.py), which holds the model, the mesh and the engine config it reads.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ...models.attention import KV_BITS
from ...models.sharding import dense_cache_sharding
from ..sampling import DEFAULT_MAX_STOP_IDS, SlotSampling, make_slot_sampling
from .programs import GenerationState, Prefix


class DenseCache:
    """The dense cache's layout and a fresh decode state: one row of max_length per decode slot."""

    @property
    def cache_dtype(self) -> Any:
        """What the dense KV cache holds: the model's dtype, or bfloat16 bits (kv_cache_dtype=bfloat16)."""
        if self.engine_config.kv_cache_dtype == "bfloat16" and self.model.dtype != jnp.bfloat16:
            return KV_BITS
        return self.model.dtype

    def _cache_shape(self) -> tuple[int, ...]:
        c = self.model_config
        return (self.max_concurrent_decodes, self.max_length, c.num_kv_heads * c.head_dim)

    def _kv_sharding(self) -> jax.sharding.Sharding:
        return dense_cache_sharding(self.mesh, self._cache_shape(), self.model_config.num_kv_heads)

    def _make_state_shardings(self) -> GenerationState | None:
        if self.mesh is None:
            return None
        kv = self._kv_sharding()
        rep = NamedSharding(self.mesh, P())
        return GenerationState(
            caches=tuple((kv, kv) for _ in range(self.model_config.num_layers)),
            tokens=rep,
            positions=rep,
            steps=rep,
            counts=rep,
            prompt_mask=rep,
            sampling=SlotSampling(*([rep] * len(SlotSampling._fields))),
        )

    def get_state_shardings(self, is_decode: bool = False):
        return self._state_shardings if is_decode else self.get_prefix_destination_sharding()

    def get_prefix_destination_sharding(self) -> Any:
        """Where a prefix must live to be inserted here (used by the transfer thread)."""
        if self.mesh is None:
            return self._replicated()
        c = self.model_config
        kv = NamedSharding(
            self.mesh, P(None, None, "tp", None) if c.num_kv_heads % self.mesh.shape["tp"] == 0 else P()
        )
        rep = NamedSharding(self.mesh, P())
        return Prefix(
            kv=tuple((kv, kv) for _ in range(c.num_layers)),
            hidden=rep,
            starts=rep,
            lengths=rep,
            prompt_mask=rep,
            sampling=SlotSampling(*([rep] * len(SlotSampling._fields))),
        )

    def init_decode_state(self, *args, **kwargs) -> GenerationState:
        s, v = self.max_concurrent_decodes, self.model_config.vocab_size
        dtype = self.cache_dtype
        rep = self._replicated()
        kv_sharding = self._kv_sharding() if self.mesh is not None else rep
        if self._zeros is None:  # one program, kept: a restarted generate thread must not compile again
            self._zeros = jax.jit(lambda: jnp.zeros(self._cache_shape(), dtype), out_shardings=kv_sharding)
        caches = tuple((self._zeros(), self._zeros()) for _ in range(self.model_config.num_layers))
        put = partial(jax.device_put, device=rep)
        sampling = make_slot_sampling([None] * s, max_stop_ids=DEFAULT_MAX_STOP_IDS)
        self._pos[:] = 0
        self._active[:] = False
        return GenerationState(
            caches=caches,
            tokens=put(np.zeros(s, np.int32)),
            positions=put(np.zeros(s, np.int32)),
            steps=put(np.zeros(s, np.int32)),
            counts=put(np.zeros((s, v), np.int32)),
            prompt_mask=put(np.zeros((s, v), bool)),
            sampling=jax.tree.map(put, sampling),
        )
