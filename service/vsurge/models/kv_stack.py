"""KV caches stacked over layers, and one layer's view of them, as the forward hands them to a backend.

A dense engine keeps every layer's cache in one array per K and V (``StackedKV``), so the decoder layers
can run as the body of one `lax.scan` (models/layer_stack.py): one layer's program, however deep the
model. The forward hands each layer a ``LayerKV``: the stacked arrays and the layer's index (an int when
the layers are unrolled, a traced i32 inside the scan); the backend writes and reads that layer in place,
and returns the stacked arrays it updated. No layer is ever copied out of the stack or written back whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class StackedKV(NamedTuple):
    """Every layer's K and V in one array each, the layer axis where the cache's owner keeps it (vEngine's
    decode state: [S, L, M, KVH * D], rows first, so row moves ignore it; a prefill's output and a chunked
    row: [L, ...]). ``k is None``: a forward with no cache to read (prefill), which returns the new K/V
    stacked [L, ...]."""

    k: Any
    v: Any


class LayerKV(NamedTuple):
    """Layer ``layer`` of a StackedKV (an int, or a traced i32 under the layer scan)."""

    k: Any
    v: Any
    layer: Any


NO_CACHE = StackedKV(None, None)

# Where the layer axis sits in vEngine's stacked decode cache: 1 (rows first, [S, L, M, F]: a slot move
# copies one row of one array) or 0 (layers first, [L, S, M, F]). Backends index through `at_layer` /
# `layer_slice`, so the two compare like for like (benchmarks/tpu_layer_layouts.py): on a v5e, 1B shape,
# 64 rows at 400 positions, both ran the decode step as one cache per layer did (5.38 / 5.41 / 5.42 ms).
LAYER_AXIS = 1


def at_layer(layer: Any, row: Any, *rest: Any) -> tuple:
    """An index into a stacked decode cache: (row, *rest) of layer ``layer``."""
    return (layer, row, *rest) if LAYER_AXIS == 0 else (row, layer, *rest)


def layer_slice(x: Any, layer: Any, starts: tuple, sizes: tuple) -> Any:
    """The slice ``sizes`` at ``starts`` (row axis first) of layer ``layer``: a dynamic slice of the stack,
    never a copy of the layer."""
    import jax

    out = jax.lax.dynamic_slice(x, at_layer(layer, *starts), at_layer(1, *sizes))
    return out[0] if LAYER_AXIS == 0 else out[:, 0]


def one_layer_stack(x: Any) -> Any:
    """One layer's rows [S, ...] as a stack of one layer."""
    return x[None] if LAYER_AXIS == 0 else x[:, None]


def only_layer(x: Any) -> Any:
    return x[0] if LAYER_AXIS == 0 else x[:, 0]
