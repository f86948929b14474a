"""The LoRA adapters a driver serves: names, their weights on the host, and their bank slots.

- `add(name, source)`: resolve the source (any model source: a path, hf://, gs://, s3://, pvc://), read and
  check the PEFT adapter against the base (models/peft_adapter.py) and keep it on the host. It takes a bank
  slot only when a request needs it.
- `enter(req)` when a request for an adapter is submitted, `pin(req)` when the driver is about to prefill
  it (a bank slot, written first if the adapter is not resident, evicting the least recently used unpinned
  adapter: slot_table.py), `leave(req)` when the request ends (pipeline: once per request).
- `remove(name)`: new requests no longer find the adapter; it is forgotten, and its slot emptied, once the
  requests that entered before have ended.

One lock guards the bookkeeping; `pin` holds it while it writes the bank, so no two loads interleave and no
request sees a half-written slot.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engines.lora_bank import LoraBank, adapter_parts
from ..models.peft_adapter import LoraAdapter, read_adapter
from .lora_slots import SlotTable


class UnknownAdapterError(KeyError):
    """A request or an unload names an adapter that is not (or no longer) served."""


@dataclass
class _Entry:
    source: str
    weights: LoraAdapter
    identity: str  # name#generation: a reloaded name is another adapter (prefix-cache keys differ)
    requests: int = 0  # entered and not yet left
    unloading: bool = False


class LoraAdapters:
    def __init__(self, engines: Sequence[Any]):
        # one engine: its own bank (on a multi-host leader, the one the step lane reaches on every process)
        self.bank = engines[0].lora_bank if len(engines) == 1 else LoraBank(engines)
        self.model_config = engines[0].model_config
        self.table = SlotTable(self.bank.slots)
        self._entries: dict[str, _Entry] = {}
        self._entered: dict[str, str] = {}  # request id -> adapter name, from enter to leave
        self._pinned: dict[str, str] = {}  # request id -> adapter name, from pin to leave
        self._generation = itertools.count(1)
        self._cond = threading.Condition()
        self.loads = 0  # bank writes of an adapter (tests and the benchmark read it)

    @property
    def max_loras(self) -> int:
        return self.bank.slots

    # ------------------------------------------------------------------ the served names
    def add(self, name: str, source: str, resolve: Callable[[str], str] | None = None) -> None:
        """Serve adapter ``name`` from ``source``; ValueError (models' AdapterError or a source error)
        when it cannot be read or does not fit the base, or when the name is taken."""
        if resolve is None:
            from ..models.sources import resolve
        with self._cond:
            if name in self._entries:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
        weights = read_adapter(
            resolve(source), self.model_config, self.bank.rank
        )  # off the lock: may download
        with self._cond:
            identity = f"{name}#{next(self._generation)}"
        # The bank keeps the host weights under the identity, to write them into a slot whenever a request
        # needs it. On a multi-host group each stage call goes down the step lane: the leader read the
        # adapter, every worker gets its weights from the leader, once, rather than reading the source
        # itself. So every process writes the leader's weights bit for bit (a source read twice may
        # differ: an hf:// name without a revision, an object rewritten in between), workers need neither
        # the source nor its credentials, an adapter loaded at run time crosses the same way, and an
        # eviction's reload is written from each process's own copy with no lane traffic.
        try:
            for piece in adapter_parts(weights):
                self.bank.stage(identity, weights.rank, piece)
        except BaseException:
            with contextlib.suppress(Exception):  # a failed group refuses this too: its error is raised
                self.bank.unstage(identity)
            raise
        with self._cond:
            if name in self._entries:
                self.bank.unstage(identity)
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            self._entries[name] = _Entry(source, weights, identity)

    def remove(self, name: str) -> None:
        """Stop serving ``name``; its slot is freed once every request that entered before has ended."""
        with self._cond:
            entry = self._entries.get(name)
            if entry is None or entry.unloading:
                raise UnknownAdapterError(name)
            entry.unloading = True
            self._forget_if_done(name)

    def names(self) -> list[str]:
        """The adapters requests may name (not those being unloaded), in the order they were added."""
        with self._cond:
            return [n for n, e in self._entries.items() if not e.unloading]

    def source(self, name: str) -> str:
        return self._entries[name].source

    def identity(self, name: str) -> str:
        return self._entries[name].identity

    # ------------------------------------------------------------------ requests
    def enter(self, req: Any) -> None:
        """A request for ``req.adapter`` is submitted: UnknownAdapterError if it is not served."""
        with self._cond:
            entry = self._entries.get(req.adapter)
            if entry is None or entry.unloading:
                raise UnknownAdapterError(req.adapter)
            entry.requests += 1
            self._entered[req.id] = req.adapter

    def pin(self, req: Any, wait: bool, live: Callable[[], bool] = lambda: True) -> int | None:
        """The bank slot of ``req``'s adapter, pinned until the request leaves (again the same slot for a
        request pinned before). None when every slot is pinned by other adapters and ``wait`` is False,
        or when ``live()`` turns False while waiting, or when the request has already ended."""
        with self._cond:
            while True:
                if req.id not in self._entered:  # ended (cancelled) before it got here: leave() ran
                    return None
                name = self._pinned.get(req.id)
                if name is not None:
                    return self.table.resident[name]
                grant = self.table.pin(req.adapter)
                if grant is not None:
                    break
                if not wait or not live():
                    return None
                self._cond.wait(0.1)
            if grant.load:
                self.bank.load(grant.slot, self._entries[req.adapter].identity)
                self.loads += 1
            self._pinned[req.id] = req.adapter
            return grant.slot

    def leave(self, req: Any) -> None:
        """``req`` ended: unpin its slot and count it out of its adapter (again: nothing)."""
        with self._cond:
            name = self._entered.pop(req.id, None)
            if name is None:
                return
            if self._pinned.pop(req.id, None) is not None:
                self.table.unpin(name)
            entry = self._entries.get(name)
            if entry is not None:
                entry.requests -= 1
                self._forget_if_done(name)
            self._cond.notify_all()

    def _forget_if_done(self, name: str) -> None:
        entry = self._entries[name]
        if entry.unloading and entry.requests == 0:
            del self._entries[name]
            slot = self.table.drop(name)
            if slot is not None:
                self.bank.load(slot, None)  # nothing of it stays on the device
            self.bank.unstage(entry.identity)

    # ------------------------------------------------------------------ figures
    def running(self) -> list[str]:
        """Adapters of requests that hold a slot (vLLM's running_lora_adapters)."""
        with self._cond:
            return self.table.running()

    def waiting(self) -> list[str]:
        """Adapters of requests submitted that hold no slot yet (waiting_lora_adapters)."""
        with self._cond:
            return sorted({n for r, n in self._entered.items() if r not in self._pinned})

    def resident(self) -> dict[str, int]:
        with self._cond:
            return dict(self.table.resident)

    def wait_idle(self, timeout: float) -> bool:
        """True once no request holds or waits for an adapter (tests)."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._entered:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True


# ---------------------------------------------------------------------------------- what drivers call


def adapters_for(engines: Sequence[Any]) -> LoraAdapters | None:
    """The adapters of a driver over ``engines``: None unless they were built with a bank (enable_lora)."""
    if not all(e.engine_config.enable_lora for e in engines):
        return None
    return LoraAdapters(engines)


def submit_request(lora: LoraAdapters | None, req: Any, submit: Callable[[], None]) -> None:
    """Submit ``req`` (``submit()`` queues it): a request for an adapter counts in first, and out again
    if the queue refuses it; UnknownAdapterError for an adapter this driver does not serve."""
    if getattr(req, "adapter", None) is None:  # not a request at all: the driver's submit says what it wants
        submit()
        return
    if lora is None:
        raise UnknownAdapterError(req.adapter)
    lora.enter(req)
    try:
        submit()
    except BaseException:
        lora.leave(req)
        raise


def pin_request(lora: LoraAdapters | None, req: Any, wait: bool, live: Callable[[], bool]) -> bool:
    """Give ``req`` its adapter's bank slot (``req.adapter_slot``) before its prefill; False when it has
    none yet (every slot pinned, and not ``wait``), the driver stops, or the request already ended."""
    if req.adapter is None or lora is None:
        return True
    slot = lora.pin(req, wait, live)
    if slot is None:
        return False
    req.adapter_slot = slot
    return True


def lora_figures(lora: LoraAdapters | None) -> dict[str, Any]:
    """DriverMetrics' LoRA fields (none without a bank)."""
    if lora is None:
        return {}
    return {"max_loras": lora.max_loras, "running_loras": lora.running(), "waiting_loras": lora.waiting()}


def left(lora: LoraAdapters | None) -> Callable[[Any], None]:
    """The pipeline's end hook: a request for an adapter releases it."""

    def hook(req: Any) -> None:
        if req.adapter is not None and lora is not None:
            lora.leave(req)

    return hook
