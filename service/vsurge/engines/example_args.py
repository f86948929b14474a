"""Example arguments both engines compile their programs from, without running them.

A program is lowered and compiled from the shapes, dtypes and shardings of its arguments
(`jax.ShapeDtypeStruct`), at start-up and for a TPU target (program_inventory.py); the programs that only run
on real arrays are warmed on zeros placed where the engine keeps them. Warm-up samples greedily.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..contracts.sampling_params import SamplingParams

__all__ = ["GREEDY", "abstract", "sds", "spec_of", "zeros_of"]

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def sds(shape: tuple, dtype: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract(tree: Any, sharding: Any = None) -> Any:
    """Every array of ``tree`` as a jax.ShapeDtypeStruct: arrays committed to devices keep their sharding;
    host arrays and uncommitted ones (which jit places where the program wants them) get ``sharding``
    (default none: as the engine passes them)."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x if x.sharding is not None or sharding is None else sds(x.shape, x.dtype, sharding)
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            own = x.sharding if isinstance(x, jax.Array) and x.committed else None
            return sds(np.shape(x), x.dtype, own if own is not None else sharding)
        return x

    return jax.tree.map(one, tree)


def spec_of(a: Any) -> jax.ShapeDtypeStruct:
    """One array's shape, dtype and sharding, whether or not it is committed."""
    return sds(a.shape, a.dtype, getattr(a, "sharding", None))


def zeros_of(spec: Any) -> jax.Array:
    """Zeros of ``spec``'s shape and dtype, placed as its sharding says."""
    return jax.device_put(np.zeros(spec.shape, spec.dtype), spec.sharding)
