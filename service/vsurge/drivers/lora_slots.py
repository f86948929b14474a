"""Which adapter holds which bank slot: pinning by running requests and least-recently-used eviction.

Pure bookkeeping on the host, no locks and no device (lora_adapters.py holds the lock and writes the bank).
A request pins its adapter's slot from admission to its end; only an unpinned slot may be given to another
adapter, the least recently used first. With every slot pinned a request waits for one to be released.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Grant:
    """What `SlotTable.pin` decided: the slot, and the adapter whose weights must be written there first
    (None: the slot already holds this adapter); ``evicted`` the adapter that lost the slot, if any."""

    slot: int
    load: bool
    evicted: str | None = None


class SlotTable:
    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"a slot table needs at least one slot, got {slots}")
        self.slots = slots
        self.resident: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self.pins: Counter[str] = Counter()

    def free_slots(self) -> list[int]:
        used = set(self.resident.values())
        return [s for s in range(self.slots) if s not in used]

    def pin(self, name: str) -> Grant | None:
        """A slot for adapter ``name``, pinned once more; None when every slot is pinned by others."""
        if name in self.resident:
            self.resident.move_to_end(name)
            self.pins[name] += 1
            return Grant(self.resident[name], False)
        free = self.free_slots()
        evicted = None
        if free:
            slot = free[0]
        else:
            evicted = next((n for n in self.resident if self.pins[n] == 0), None)
            if evicted is None:
                return None
            slot = self.resident.pop(evicted)
        self.resident[name] = slot
        self.pins[name] += 1
        return Grant(slot, True, evicted)

    def unpin(self, name: str) -> None:
        if self.pins[name] <= 0:
            raise ValueError(f"adapter {name!r} is not pinned")
        self.pins[name] -= 1
        if not self.pins[name]:
            del self.pins[name]

    def drop(self, name: str) -> int | None:
        """Forget adapter ``name`` (it must be unpinned); returns the slot it held, now free."""
        if self.pins[name]:
            raise ValueError(f"adapter {name!r} is still pinned by {self.pins[name]} request(s)")
        return self.resident.pop(name, None)

    def running(self) -> list[str]:
        """Adapters pinned by at least one request, in the order they were last used."""
        return [n for n in self.resident if self.pins[n] > 0]
