"""vEngine's bfloat16 copy of the weights (``--prefill-dtype`` / ``--decode-dtype bfloat16``), and which
weights each decode step runs on."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# decode_dtype=bfloat16 runs the steps of this many rows or more on the bfloat16 kernels: XLA:CPU's bfloat16
# matmuls run ~3x faster than float32 from 8 rows up, its matrix-vector path ~4x slower (measured at 1 row)
BF16_DECODE_MIN_ROWS = 8


def bf16_kernels(params: Any, model_dtype: Any, prefill_dtype: str, decode_dtype: str) -> Any | None:
    """The weights with a bfloat16 copy of every float32 matmul kernel (the layers', an untied head's),
    or None when no knob asks for one or the model is not float32. Everything else stays float32: norms,
    the embedding table (a tied head's transposed bfloat16 dot is slower than float32 on XLA:CPU:
    measured 151 -> 227 ms per 32-row step), activations and the residual stream; Linear casts its
    input to the kernel's dtype and accumulates in float32. Packed prefill runs ~1.7x faster than on
    float32 weights (and ~8% faster than with bfloat16 activations). Built once and shared by packed
    and chunked prefill (prefill_dtype), decode (decode_dtype) and the mixed step."""
    if model_dtype != jnp.float32 or "bfloat16" not in (prefill_dtype, decode_dtype):
        return None

    def narrow(path: Any, a: Any) -> Any:
        kernel = any(getattr(k, "key", None) == "kernel" for k in path)
        return a.astype(jnp.bfloat16) if kernel and a.dtype == jnp.float32 else a

    return jax.tree_util.tree_map_with_path(narrow, params)


def decode_weights(params: Any, bf16: Any | None, decode_dtype: str, rows: int) -> Any:
    """The weights a decode step of ``rows`` rows runs on: decode_dtype=bfloat16 takes the bfloat16 copy
    from BF16_DECODE_MIN_ROWS rows up, the model's weights below."""
    if decode_dtype == "bfloat16" and bf16 is not None and rows >= BF16_DECODE_MIN_ROWS:
        return bf16
    return params
