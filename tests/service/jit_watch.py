"""Catch XLA compilations: every shape must be compiled in compile(), none on a live request."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import jax


class _Compiles(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Compiling" in record.getMessage():
            self.seen.append(record.getMessage()[:160])


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """Yields the list of programs compiled inside the block, by any thread (the setting is global:
    `jax.log_compiles()` would only cover the calling thread, not the driver's)."""
    handler, log = _Compiles(), logging.getLogger("jax")
    log.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        yield handler.seen
    finally:
        jax.config.update("jax_log_compiles", False)
        log.removeHandler(handler)
