"""int8 weight-only quantization: the weights stay int8 in device memory, the matmul dequantizes in-program.

A quantized weight is a pair ``(q, scale)``:

* ``q``: int8, in the weight's own layout (a Linear kernel ``[in, out]``, the embedding ``[vocab, hidden]``);
* ``scale``: float32 with one entry per output channel and per group of the contraction axis:
  ``[G, out]`` for a kernel, ``[vocab, G]`` for the embedding. From a bf16/f32 checkpoint, symmetric int8
  per output channel in groups of ``GROUP_SIZE`` (64) inputs, ``G == in / 64`` (``G == 1``, one scale per
  channel, where 64 does not divide ``in`` or a device would hold part of a group: `groups_for`);
  ``G == in / 32`` is GGUF Q8_0 kept as it is stored (its f16 block scales, no second rounding).

The weight is ``q * scale`` (each scale broadcast over its group). With ``G == 1`` the scale is applied to
the matmul's output (``(x @ q) * scale``: exact, and the cheapest); with groups it is applied to the weight
tile before the matmul. On TPU and GPU, XLA fuses the int8 -> float convert (and the group scale) into the
matmul's operand fusion, so only int8 is read from memory. XLA:CPU does not: it would write the whole
weight in float32 before its gemm, so on CPU the matmul runs over output tiles (``TILE_BYTES`` of float
each) in a loop, and the full-precision weight never exists there either.

The embedding and the (tied or separate) lm_head are quantized too, per vocabulary row (in groups of the
hidden axis): the row scales are the lm_head's output-channel scales, so one int8 table serves the lookup and the logits of a tied model.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..contracts.engine_config import QUANTIZATIONS  # one list of choices: the config's
from .target import target_backend

__all__ = [
    "QUANTIZATIONS",
    "GROUP_SIZE",
    "TILE_BYTES",
    "check_quantization",
    "dequantize",
    "embed_rows",
    "groups_for",
    "int8_matmul",
    "quantize",
    "quantize_on_device",
]

# Scales per output channel and per GROUP_SIZE inputs: one scale per whole channel put top-1 agreement
# with f32 on the default model at 97.1%, groups of 64 at 98.1% (KL 0.0033 -> 0.0016), groups of 32 no
# better than 64, for 4 more bytes per 64 weights (0.54x bf16 instead of 0.52x).
GROUP_SIZE = 64
# CPU only: the largest float tile of a weight one matmul step dequantizes (fits in L2).
TILE_BYTES = 512 * 1024


def check_quantization(value: Any) -> str:
    """`None` -> "none"; anything but none|int8 is a ValueError naming the choices."""
    value = "none" if value is None else value
    if value not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {value!r}; choose one of {', '.join(QUANTIZATIONS)}")
    return value


# ------------------------------------------------------------------------------ making the int8 weights


def groups_for(n_in: int, shards: int = 1, backend: str | None = None) -> int:
    """Scale groups along a contraction axis of `n_in` split over `shards` devices: groups of GROUP_SIZE
    when they divide it and each device holds whole groups, else one (per output channel).

    On TPU always one: XLA fuses a per-channel weight's int8 -> bf16 convert into the matmul (the scale goes
    on the output), but not a grouped one's multiply, which then writes the whole weight out first (a
    [64, 4096] x [4096, 14336] matmul measured 2.3x slower with groups of 64 on a v5e chip)."""
    if (backend or target_backend()) == "tpu":
        return 1
    if n_in % GROUP_SIZE or (n_in // GROUP_SIZE) % max(1, shards):
        return 1
    return n_in // GROUP_SIZE


@partial(jax.jit, static_argnames=("axis", "groups"))
def _quantize(w: jax.Array, axis: int, groups: int = 1) -> tuple[jax.Array, jax.Array]:
    wf = w.astype(jnp.float32)
    shape, n = wf.shape, wf.shape[axis]
    if axis == 0:  # kernel [in, out] -> [G, in/G, out]
        grouped, over = wf.reshape(groups, n // groups, shape[1]), 1
    else:  # embedding [vocab, hidden] -> [vocab, G, hidden/G]
        grouped, over = wf.reshape(shape[0], groups, n // groups), 2
    amax = jnp.max(jnp.abs(grouped), axis=over, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)  # an all-zero group stays zero with any scale
    q = jnp.clip(jnp.round(grouped / scale), -127, 127).astype(jnp.int8).reshape(shape)
    return q, jnp.squeeze(scale, over)


def quantize(w: Any, axis: int, groups: int = 1) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 of `w` per output channel, in `groups` groups along `axis` (the contraction axis):
    (q, scale) with scale's `axis` of size `groups`. Runs where `w` lives (host arrays go to the default
    device)."""
    return _quantize(jnp.asarray(w), axis, groups)


def quantize_on_device(
    w: np.ndarray | jax.Array,
    axis: int,
    q_sharding: jax.sharding.Sharding,
    s_sharding: jax.sharding.Sharding,
    groups: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Quantize one checkpoint tensor at load: it goes to the devices in its own dtype, sharded as the int8
    weight will be (so no device holds more than its shard of it), and only the int8 result and the scales
    stay. One tensor at a time: the model never exists in full precision on the device. `w` may already be
    placed on `q_sharding` (the loader places it shard by shard)."""
    placed = w if isinstance(w, jax.Array) else jax.device_put(w, q_sharding)
    q, scale = _placed_quantizer(axis, groups, q_sharding, s_sharding)(placed)
    del placed
    return q, scale


@lru_cache(maxsize=64)
def _placed_quantizer(
    axis: int, groups: int, q_sharding: jax.sharding.Sharding, s_sharding: jax.sharding.Sharding
):
    # one jitted function per (axis, groups, shardings): a model's few weight shapes compile once each
    return jax.jit(partial(_quantize, axis=axis, groups=groups), out_shardings=(q_sharding, s_sharding))


def dequantize(q: jax.Array, scale: jax.Array, axis: int, dtype: Any) -> jax.Array:
    """`q * scale` in `dtype`; `axis` is q's contraction axis, over which scale's groups run."""
    groups = scale.shape[axis]
    w = q.astype(jnp.float32)
    if groups == 1:
        return (w * scale).astype(dtype)
    shape = q.shape
    n = shape[axis]
    if axis == 0:  # kernel [in, out], scale [G, out]
        w = w.reshape(groups, n // groups, shape[1]) * scale[:, None, :]
    else:  # embedding [vocab, hidden], scale [vocab, G]
        w = w.reshape(shape[0], groups, n // groups) * scale[:, :, None]
    return w.reshape(shape).astype(dtype)


# ------------------------------------------------------------------------------ using them


def _tile_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, axis: int) -> jax.Array:
    """x [..., in] times one (tile of a) weight; float32 out. `axis`: q's contraction axis."""
    groups = scale.shape[axis]
    dims = (((x.ndim - 1,), (axis,)), ((), ()))
    if groups == 1:  # per channel: the scale goes on the output, the weight is only converted
        y = lax.dot_general(x, q.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return y * scale.reshape(-1)
    w = dequantize(q, scale, axis, x.dtype)
    return lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def _tile_size(n_out: int, n_in: int, itemsize: int) -> int:
    """The largest divisor of n_out whose float tile [n_in, tile] fits in TILE_BYTES (at least 1)."""
    limit = max(1, TILE_BYTES // max(1, n_in * itemsize))
    if limit >= n_out:
        return n_out
    for t in range(limit, 0, -1):
        if n_out % t == 0:
            return t
    return 1


def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, *, axis: int = 0) -> jax.Array:
    """`x @ (q * scale)` contracting q's `axis` (0 for a kernel [in, out], 1 for the embedding used as the
    lm_head), in float32, reading q as int8. On CPU: over output tiles, so no float copy of the whole
    weight is made."""
    out_axis = 1 - axis
    n_out, n_in = q.shape[out_axis], q.shape[axis]
    tile = n_out
    if target_backend() == "cpu":
        tile = _tile_size(n_out, n_in, jnp.dtype(x.dtype).itemsize)  # a weight under one tile: one step
    if tile == n_out:
        return _tile_matmul(x, q, scale, axis)

    def step(_, i):
        qt = lax.dynamic_slice_in_dim(q, i * tile, tile, axis=out_axis)
        st = lax.dynamic_slice_in_dim(scale, i * tile, tile, axis=out_axis)
        return None, _tile_matmul(x, qt, st, axis)

    _, ys = lax.scan(step, None, jnp.arange(n_out // tile))  # [tiles, ..., tile]
    return jnp.moveaxis(ys, 0, -2).reshape(*x.shape[:-1], n_out)


def embed_rows(q: jax.Array, scale: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
    """Embedding lookup from an int8 table [vocab, hidden] with row scales [vocab, G]: only the looked-up
    rows are dequantized."""
    rows = jnp.take(q, ids, axis=0).astype(jnp.float32)  # [..., hidden]
    s = jnp.take(scale, ids, axis=0)  # [..., G]
    groups, hidden = s.shape[-1], rows.shape[-1]
    if groups == 1:
        return (rows * s).astype(dtype)
    rows = rows.reshape(*rows.shape[:-1], groups, hidden // groups) * s[..., None]
    return rows.reshape(*rows.shape[:-2], hidden).astype(dtype)
