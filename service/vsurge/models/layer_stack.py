"""The decoder layers' weights stacked [L, ...] and run as the body of one `lax.scan` (layer_scan=on).

Every decoder layer has the same structure and shapes, so a program needs only one of them: with the
weights stacked and the KV cache stacked (models/kv_stack.py), the forward is a scan over the layers, and
XLA compiles one layer whatever the depth. Measured on one TPU v5e, 1B shape (head_dim 64), bf16, batch
64 (docs/performance.md): a start's compile 72.8 -> 35.4 s, a warm start's 18.4 -> 9.7 s; but the decode
step 5.42 -> 6.72 ms at 400 positions. The cost is the stacked weights, not the loop: unrolled over
static slices of the same stack the step took 6.94 ms, while the stacked cache alone (rows or layers
first) costs nothing (5.38-5.41 ms). So the scan is a choice (fast starts for pods that scale from zero,
or slower steps), off by default. On XLA:CPU the scanned step ran ~5-8% slower and compiled ~2.5x faster.

`stack_layers` / `unstack_layers` change a model's layout in place, leaf by leaf (a model never needs
twice its layers' memory); `run_layers` is the forward's loop for every combination: stacked weights with
a stacked cache scan; per-layer weights, or a per-layer cache list, unroll (the layer traced once and its
equations inlined per layer, `jax.jit(inline=True)`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .kv_stack import LayerKV, StackedKV

__all__ = ["StackedLayers", "is_stacked", "run_layers", "stack_layers", "unstack_layers"]

STACKED_PATH = "layers/stacked/"  # where a stacked layer's weights sit in a parameter path
# Whether a step that reads a cache (decode, verify, mixed steps, chunks) scans its layers too, or runs
# them unrolled over static slices of the stacked weights (a prefill always scans). Scanning: the unrolled
# form was no faster on a v5e (6.94 against 6.72 ms) and compiles ~5x longer. Scans of 2-8 layers per
# iteration (`unroll`) took 12.6-12.9 ms a step there: one layer per iteration.
SCAN_CACHED = True


class StackedLayers(nnx.Module):
    """``count`` decoder layers as one: ``stacked`` is a decoder layer whose every weight has a leading
    [count] axis (layer i's weights at index i)."""

    def __init__(self, stacked: nnx.Module, count: int):
        self.stacked = stacked
        self.count = count

    def __len__(self) -> int:
        return self.count


def is_stacked(model: Any) -> bool:
    return isinstance(model.model.layers, StackedLayers)


def _stacked_sharding(sharding: Any) -> Any:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(None, *sharding.spec))
    return sharding


def _stack(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, jax.ShapeDtypeStruct):  # an abstract model: shapes and shardings only
        sharding = _stacked_sharding(getattr(first, "sharding", None))
        return jax.ShapeDtypeStruct((len(parts), *first.shape), first.dtype, sharding=sharding)
    return jax.block_until_ready(_stacker(_stacked_sharding(first.sharding))(*parts))


@functools.lru_cache(maxsize=64)
def _stacker(sharding: Any) -> Any:
    """One jitted stack per output sharding (a program per leaf shape, not per leaf)."""
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)


@functools.lru_cache(maxsize=64)
def _taker(sharding: Any) -> Any:
    return jax.jit(lambda a, i: a[i], out_shardings=sharding)


def _unstack(x: Any, count: int) -> list[Any]:
    if isinstance(x, jax.ShapeDtypeStruct):
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
        return [jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding) for _ in range(count)]
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    take = _taker(sharding)
    return [take(x, i) for i in range(count)]


def stack_layers(model: Any) -> bool:
    """Stack ``model``'s decoder layers in place (weights [L, ...]); False if they already were. Leaf by
    leaf, each layer's arrays dropped as their stack is made: the extra memory is one leaf's stack."""
    inner = model.model
    if isinstance(inner.layers, StackedLayers):
        return False
    layers = list(inner.layers)
    count = len(layers)
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer) for layer in layers]
    treedef = jax.tree.structure(states[0])
    leaves = [jax.tree.leaves(s) for s in states]
    inner.layers = nnx.List([])  # the model's own references go first, so each leaf can be freed in turn
    del layers, states
    out = []
    for j in range(len(leaves[0])):
        parts = [lv[j] for lv in leaves]
        for lv in leaves:
            lv[j] = None
        out.append(_stack(parts))
        del parts
    inner.layers = StackedLayers(nnx.merge(graphdef, jax.tree.unflatten(treedef, out)), count)
    return True


def unstack_layers(model: Any) -> bool:
    """The inverse of `stack_layers` (for what needs one module per layer: the paged engine, the LoRA
    bank); False if the layers were not stacked."""
    inner = model.model
    stacked = inner.layers
    if not isinstance(stacked, StackedLayers):
        return False
    count = stacked.count
    graphdef, state = nnx.split(stacked.stacked)
    treedef = jax.tree.structure(state)
    leaves = jax.tree.leaves(state)
    inner.layers = nnx.List([])
    del stacked, state
    per_layer: list[list[Any]] = [[] for _ in range(count)]
    for j in range(len(leaves)):
        for i, part in enumerate(_unstack(leaves[j], count)):
            per_layer[i].append(part)
        leaves[j] = None
    inner.layers = nnx.List([nnx.merge(graphdef, jax.tree.unflatten(treedef, ls)) for ls in per_layer])
    return True


def _layer_weights(layers: Any) -> tuple[Any, Any, int]:
    """(graphdef of one layer, the layers' weights: stacked State or one State per layer, count)."""
    if isinstance(layers, StackedLayers):
        graphdef, state = nnx.split(layers.stacked)
        return graphdef, state, layers.count
    return nnx.graphdef(layers[0]), [nnx.state(layer) for layer in layers], len(layers)


def run_layers(layers: Any, x, positions, backend, caches, meta, lora=None) -> tuple[Any, Any]:
    """x through every decoder layer; returns (x, the new caches in the form ``caches`` came):

    * a StackedKV (``NO_CACHE`` for a prefill): each layer gets `LayerKV` (the stack and its index) and
      the result is a StackedKV (a prefill's K/V stacked [L, ...]); with stacked weights, under one scan;
    * one cache per layer (a list or tuple, None entries for a prefill): a list, one per layer.
    """
    graphdef, weights, count = _layer_weights(layers)

    def apply(w, x, cache):
        return nnx.merge(graphdef, w)(x, positions, backend, cache, meta, lora)

    stacked_w = not isinstance(weights, list)
    if isinstance(caches, StackedKV) and stacked_w and (caches.k is None or SCAN_CACHED):
        return _scan(apply, weights, count, x, caches)
    # unrolled: the layer traced once, its equations inlined for each layer: the program is the unrolled
    # stack, as if each were traced (tracing the default model's 30 layers was most of a warm start on
    # CPU: 9.4 -> 3.3 s). Not a call per layer: XLA inlines calls too, but on a TPU that program's decode
    # step ran 3.2-3.9% slower than the unrolled one (1b64, batch 64, A/B on one v5e).
    run = jax.jit(apply, inline=True)

    def weights_of(i: int) -> Any:
        return jax.tree.map(lambda a: a[i], weights) if stacked_w else weights[i]

    if isinstance(caches, StackedKV):
        k, v = caches
        ks, vs = [], []
        for i in range(count):
            x, new = run(weights_of(i), x, None if k is None else LayerKV(k, v, i))
            if k is None:
                ks.append(new[0])
                vs.append(new[1])
            else:
                k, v = new.k, new.v
        return x, (StackedKV(jnp.stack(ks), jnp.stack(vs)) if caches.k is None else StackedKV(k, v))
    new_caches = []
    for i, cache in enumerate(caches):
        x, cache = run(weights_of(i), x, cache)
        new_caches.append(cache)
    return x, new_caches


def _scan(apply, weights, count: int, x, caches: StackedKV) -> tuple[Any, StackedKV]:
    layers = jnp.arange(count, dtype=jnp.int32)
    if caches.k is None:  # prefill: each layer's K/V is the scan's output, stacked [L, ...]

        def body(x, xs):
            w, _ = xs
            x, (k, v) = apply(w, x, None)
            return x, (k, v)

        x, (ks, vs) = jax.lax.scan(body, x, (weights, layers))
        return x, StackedKV(ks, vs)

    def step(carry, xs):  # the stacked cache rides in the carry: each layer's K/V written in place
        x, k, v = carry
        w, i = xs
        x, new = apply(w, x, LayerKV(k, v, i))
        return (x, new.k, new.v), None

    (x, k, v), _ = jax.lax.scan(step, (x, caches.k, caches.v), (weights, layers))
    return x, StackedKV(k, v)
