"""Device arrays named across the lane: result leaf ``i`` of call ``n`` is ``Handle(n, i)`` on every process.

Every process ran call ``n`` with the same inputs, so leaf ``i`` of its result is the same global array
everywhere. The leader remembers which of its arrays came from which call (by identity, through weak
references); when one is garbage-collected its handle is dropped on the workers with the next message.
An array the leader's driver made itself (oDriver's page table) has no handle: it travels by value, with
its sharding (``HostValue``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .wire import Handle, HostValue


def result_arrays(result: Any) -> list[tuple[int, jax.Array]]:
    """The device arrays of a call's result with their leaf index."""
    return [(i, x) for i, x in enumerate(jax.tree_util.tree_leaves(result)) if isinstance(x, jax.Array)]


class LeaderHandles:
    """The leader's map from its live arrays to their handles, and the handles of those it dropped."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[list, weakref.ref]] = {}  # id(array) -> ([handle], weakref)
        self._dead: list[list] = []  # handle cells of collected arrays, dropped with the next message
        self._lock = threading.RLock()  # a weakref callback may run inside a locked block (GC)

    def ref(self, arr: jax.Array) -> Handle | HostValue:
        """How ``arr`` crosses the lane: its handle, or its host value and PartitionSpec."""
        entry = self._known.get(id(arr))
        if entry is not None and entry[1]() is arr:
            return entry[0][0]
        sharding = arr.sharding
        spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else None
        return HostValue(np.asarray(arr), spec)

    def take_dead(self) -> list[tuple[int, int]]:
        """The handles of arrays collected since the last call, as (call, leaf) pairs."""
        with self._lock:
            dead, self._dead = self._dead, []
        return [tuple(cell[0]) for cell in dead]

    def register(self, n: int, result: Any) -> None:
        """The device arrays of call ``n``'s result get their handles."""
        for i, arr in result_arrays(result):
            entry = self._known.get(id(arr))
            if entry is not None and entry[1]() is arr:
                with self._lock:
                    self._dead.append([entry[0][0]])  # known under an older handle: that one goes
                entry[0][0] = Handle(n, i)
                continue
            cell = [Handle(n, i)]
            key = id(arr)

            def collected(_ref: Any, cell: list = cell, key: int = key) -> None:
                with self._lock:
                    self._dead.append(cell)
                entry = self._known.get(key)
                if entry is not None and entry[0] is cell:
                    del self._known[key]

            self._known[key] = (cell, weakref.ref(arr, collected))


class Retirement:
    """The device work of the last few calls, waited for once it is ``window`` calls old.

    With async dispatch (TPU) a call returns before its programs ran, so a wedged device would leave the
    replay loop free-running and its beats cheerful. Waiting for the results of call n - window inside
    call n makes a wedge show where the lane looks for it: in a call that does not end (the leader's
    watchdog, from each process's stamps). The window keeps dispatch that far ahead of the device; on
    CPU every call has ended already, so this never waits."""

    def __init__(self, window: int = 4):
        self.window = window
        self._pending: list[list[jax.Array]] = []

    def push(self, result: Any) -> None:
        self._pending.append([x for _, x in result_arrays(result)])
        while len(self._pending) > self.window:
            # arrays a later call took over (donated) are that call's to finish
            live = [x for x in self._pending.pop(0) if not x.is_deleted()]
            if live:
                jax.block_until_ready(live)
