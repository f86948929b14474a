"""Which XLA programs a stretch of start-up compiled, from any thread: what `compile_engine` reports.

Start-up compiles the expensive programs in a parallel pool; anything compiled after the pool (when
warm-up first runs a program whose signature the pool missed) compiles one program at a time and adds
its whole compile time to the start. The engine's ``compile_report`` names those, so a benchmark on the
chip and a test on CPU can both see them. The listener is jax.monitoring's compile event (every backend
compile, a persistent-cache hit included), registered once per process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax

__all__ = ["compiled_during"]

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_watchers: dict[int, list[tuple[str, float]]] = {}  # by id: two watches' lists may be equal, not the same
_registered = False


def _listen(event: str, seconds: float, **kw: Any) -> None:
    if event != _EVENT:
        return
    with _lock:
        for seen in _watchers.values():
            seen.append((str(kw.get("fun_name", "?")), float(seconds)))


@contextlib.contextmanager
def compiled_during() -> Iterator[list[tuple[str, float]]]:
    """Yields a list that fills with (program name, compile seconds) for every compile in the block."""
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_listen)
            _registered = True
        seen: list[tuple[str, float]] = []
        _watchers[id(seen)] = seen
    try:
        yield seen
    finally:
        with _lock:
            del _watchers[id(seen)]
