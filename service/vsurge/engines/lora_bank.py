"""Writing adapters into the engines' LoRA bank (the model parameters `models/lora.py` attaches).

A slot is written in place of its old value: one small jitted update per bank leaf, whose output keeps the
leaf's sharding, so every program that reads the bank sees the same shapes and shardings and never
compiles again. The update programs themselves are compiled with the engine (`warm`), by writing the empty
adapter into slot 0, which is what it already holds.

The new arrays are set into each weight tree an engine hands its programs (the model's, and vEngine's
bfloat16 copy, which shares the bank's values but not its Variables). A program dispatched meanwhile may
see some layers' old values: harmless, because a slot is written only while no request uses it.

The drivers name adapters to the bank by a key: ``stage(key, rank, parts)`` keeps an adapter's host
weights under the key, ``load(slot, key)`` writes them into a slot, ``unstage(key)`` forgets them. Every
engine has its own bank (``EngineBase.lora_bank``), reached by path, so a multi-host group's leader sends
these calls down its step lane like any other engine call (vsurge/multihost/engine_proxy.py): each process
keeps the adapter's host copy the leader sent once, and fills its own devices' shards of a slot from it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..models.lora import ATTENTION_TARGETS, TARGETS, bank_shape
from ..models.peft_adapter import LoraAdapter
from .host_arrays import put_host

# An adapter's weights as a list the step lane carries (its dicts take no tuple keys):
# (layer, module, A [in, r], B [r, out]) per adapted projection.
Parts = list[tuple[int, str, np.ndarray, np.ndarray]]


def adapter_parts(adapter: LoraAdapter, most_bytes: int = 256 << 20) -> list[Parts]:
    """The adapter's weights in pieces of at most ``most_bytes`` (one projection's pair may be more):
    each piece is one ``stage`` call, one step-lane frame on a multi-host group (frames stop at 1 GiB)."""
    pieces: list[Parts] = [[]]
    size = 0
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        n = a.nbytes + b.nbytes
        if pieces[-1] and size + n > most_bytes:
            pieces.append([])
            size = 0
        pieces[-1].append((layer, module, a, b))
        size += n
    return pieces


def _slot_sharding(leaf: jax.Array) -> Any:
    """Where one slot's value goes: the leaf's sharding without the slot axis (None: one device). Each
    process then fills only its own devices' shards from its host copy (host_arrays.put_host)."""
    sharding = leaf.sharding
    if not isinstance(sharding, NamedSharding):
        return None
    return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))


def _update(bank: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(bank, value.astype(bank.dtype), slot, 0)


def _leaf(tree: Any, layer: int, module: str, name: str) -> Any:
    block = "self_attn" if module in ATTENTION_TARGETS else "mlp"
    return tree["model"]["layers"][layer][block][module][name]


class LoraBank:
    """The bank of one or more engines (the same slots on each: a driver's prefill and decode engines)."""

    def __init__(self, engines: Sequence[Any]):
        shapes = {bank_shape(e.model) for e in engines}
        if len(shapes) != 1 or None in shapes:
            raise ValueError("every engine of a LoRA driver needs the same adapter bank")
        self.slots, self.rank = shapes.pop()
        self.num_layers = engines[0].model_config.num_layers
        self.trees = [t for e in engines for t in e.lora_trees()]
        self._programs: dict[Any, Any] = {}  # by the leaf's sharding: out_shardings must name it
        self._lock = threading.Lock()  # one writer at a time: two loads must not interleave a slot
        self.staged: dict[str, LoraAdapter] = {}  # key -> host weights (stage / load / unstage)

    def stage(self, key: str, rank: int, parts: Parts) -> None:
        """Keep an adapter's host weights under ``key`` for later ``load``s (``parts``: some of
        adapter_parts; a large adapter is staged in several calls, each adding its parts)."""
        adapter = self.staged.setdefault(key, LoraAdapter(key, int(rank)))
        for layer, module, a, b in parts:
            adapter.weights[(int(layer), str(module))] = (np.asarray(a), np.asarray(b))

    def unstage(self, key: str) -> None:
        self.staged.pop(key, None)

    def load(self, slot: int, key: str | None) -> None:
        """Write the adapter staged under ``key`` (None: the empty one) into bank slot ``slot``."""
        if key is not None and key not in self.staged:
            raise KeyError(f"no LoRA adapter staged as {key!r}")
        self.write(slot, None if key is None else self.staged[key])

    def _program(self, leaf: jax.Array) -> Any:
        key = (leaf.shape, leaf.dtype, leaf.sharding)
        fn = self._programs.get(key)
        if fn is None:
            fn = self._programs[key] = jax.jit(_update, out_shardings=leaf.sharding)
        return fn

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put ``adapter`` (None: the empty one, zeros) into bank slot ``slot`` of every tree."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"bank slot {slot} out of range 0..{self.slots - 1}")
        with self._lock:
            for layer in range(self.num_layers):
                for module in TARGETS:
                    for i, name in enumerate(("lora_a", "lora_b")):
                        self._write_leaf(slot, layer, module, name, i, adapter)
            jax.block_until_ready([_leaf(t, 0, TARGETS[0], "lora_a")[...] for t in self.trees])

    def _write_leaf(self, slot: int, layer: int, module: str, name: str, i: int, adapter) -> None:
        first = _leaf(self.trees[0], layer, module, name)
        shape = first[...].shape[1:]
        value = np.zeros(shape, np.float32)
        got = None if adapter is None else adapter.weights.get((layer, module))
        if got is not None:
            w = got[i]  # A [in, r] (pads columns to the bank's rank) or B [r, out] (pads rows)
            value[: w.shape[0], : w.shape[1]] = w
        done: dict[int, jax.Array] = {}
        for tree in self.trees:
            var = _leaf(tree, layer, module, name)
            old = var[...]
            if id(old) not in done:  # trees that share one array share its update
                where = _slot_sharding(old)
                placed = value if where is None else put_host(value, where)
                done[id(old)] = self._program(old)(old, np.int32(slot), placed)
            var.set_value(done[id(old)])

    def warm(self) -> None:
        """Compile the update programs (slot 0 gets the empty adapter it already holds)."""
        self.write(0, None)
