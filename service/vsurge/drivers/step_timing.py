"""Device and host seconds of each engine step, by program kind: what /metrics reports as
``vsurge_step_device_seconds`` and ``vsurge_step_host_seconds`` (server/metrics.py).

Host seconds: the driver thread's Python time for one step, planning it and dispatching its program (the
step thread: plan + dispatch; vDriver's prefill thread: the prefill call), without its waits for work,
for room in a full queue, or for the device (a prefill chain's window on XLA:CPU: dispatch_window.py).

Device seconds: from the dispatch until the step's results are ready, taken where the driver already
waits for them (the detokenizer's read of a step's tokens, the transfer thread's wait for a prefill): no
new sync point. The programs of one engine run in order, so a step's device time starts when it was
dispatched or when the engine's previous step was ready, whichever is later. It is an upper bound: when
the reading thread falls behind, the results were ready before it looked. A step that reads its own
tokens before returning (n-gram speculation, structured output) has that wait in its host time instead.

Kinds, as the engines' programs are named (engines/program_inventory.py): ``prefill`` (vDriver's prefill
call; an oDriver step of prompt chunks with no row decoding, timed ready with its first token), ``decode``
(one decode step), ``decode_block`` (``decode_steps`` steps in one program), ``mixed`` (a step that
prefills prompt chunks beside the decoding rows: vDriver with max_num_batched_tokens, oDriver) and
``verify`` (a speculative verify step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

KINDS = ("prefill", "decode", "decode_block", "mixed", "verify")
# what (device or host), kind, seconds
StepObserver = Callable[[str, str, float], None]


@dataclass(frozen=True, slots=True)
class Dispatched:
    """A step's program kind, when it was dispatched, and the engine whose device runs it."""

    kind: str
    at: float
    engine: int


class StepClock:
    """One driver's step timings, handed to its observers (the server's histograms)."""

    def __init__(self) -> None:
        self.observers: list[StepObserver] = []
        self._lock = threading.Lock()
        self._ready: dict[int, float] = {}  # engine -> when its last step was seen ready

    def dispatched(self, kind: str, engine: Any, host_seconds: float | None = None) -> Dispatched:
        """A step of ``kind`` is out on ``engine``; ``host_seconds``: the Python time it took."""
        if host_seconds is not None:
            self._emit("host", kind, host_seconds)
        return Dispatched(kind, time.perf_counter(), id(engine))

    def ready(self, step: Dispatched | None) -> None:
        """``step``'s results are on the host now (called right after the driver's own wait)."""
        if step is None:
            return
        now = time.perf_counter()
        with self._lock:
            start = max(step.at, self._ready.get(step.engine, 0.0))
            self._ready[step.engine] = now
        self._emit("device", step.kind, now - start)

    def _emit(self, what: str, kind: str, seconds: float) -> None:
        for fn in list(self.observers):
            try:
                fn(what, kind, seconds)
            except Exception:  # an observer's bug must not stall the driver
                log.exception("a step timing observer failed")
