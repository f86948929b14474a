"""How many of one chain's programs wait on the device's queue at once: all of them, except on XLA:CPU.

vEngine's prefill and the chunked prefill each dispatch a chain of small programs (an embedding, one
program per decoder layer, a final norm: layered_prefill.py, layered_chunk.py). On a TPU the whole chain is
queued at once, so the device runs it back to back. XLA:CPU runs queued programs side by side and lets a
device hold at most 32 in flight: the 33rd dispatch blocks its thread until one finishes. A whole chain
queued at once filled that queue, and every dispatch after it, the decode step's among them, waited for
the prefill's layers to run (serve's defaults under random-24 on 2 cores: a layer dispatch of 30-200 ms
from the 20th on, and the decode step held back as long: ITL p99 846 ms, 234 ms with the window, one
sitting). On CPU a chain therefore keeps only ``CPU_WINDOW`` of its programs queued, waiting for the
oldest before it adds one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import jax

from ..models.target import target_backend

__all__ = ["CPU_WINDOW", "DispatchWindow"]

# two keep the next layer queued while one runs; XLA:CPU dispatches in microseconds
CPU_WINDOW = 2


class DispatchWindow:
    """``add(x)`` after each program of a chain: it first waits while ``size`` programs of the chain are
    still queued (None: never waits). ``for_backend()``: ``CPU_WINDOW`` on XLA:CPU, else None."""

    def __init__(self, size: int | None):
        self.size = size
        self._queued: deque[Any] = deque()
        self._lock = threading.Lock()  # the driver's prefill thread and a caller's own prefill (seed API)
        self.waited = 0.0  # seconds spent waiting for the device, all calls (not host time: step_timing.py)

    @classmethod
    def for_backend(cls) -> DispatchWindow:
        return cls(CPU_WINDOW if target_backend() == "cpu" else None)

    @property
    def active(self) -> bool:
        return self.size is not None

    def wait(self, out: Any) -> None:
        """Wait until ``out`` is ready (the time counted in ``waited``)."""
        started = time.perf_counter()
        jax.block_until_ready(out)
        with self._lock:
            self.waited += time.perf_counter() - started

    def add(self, out: Any) -> None:
        """``out``: the output of the program just dispatched (any pytree of arrays)."""
        if self.size is None:
            return
        with self._lock:
            started = time.perf_counter()
            while len(self._queued) >= self.size:
                jax.block_until_ready(self._queued.popleft())
            self._queued.append(out)
            self.waited += time.perf_counter() - started
