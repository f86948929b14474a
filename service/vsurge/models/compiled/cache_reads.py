"""One read of JAX's persistent compilation cache at a time, in the whole process.

Start-up compiles its programs on parallel threads (`engines/engine_base.compile_jobs`), and with a warm cache
most of them are reads: each deserializes a cached executable. XLA:CPU crashed the process (SIGSEGV) with
two threads inside ``backend.deserialize_executable`` at once (a clean-clone `make test`, 2026-12-06:
both threads of one engine's compile pool in ``compilation_cache.get_executable_and_time``). A read takes
milliseconds against the compile it saves, so reads take turns; compiles, the long part, stay parallel.
Only on CPU (`engine_base.compile_jobs`): a TPU read loads the executable onto the chip, and taking turns
made a second start of the 1B shape read its programs in 57 s instead of 22 s.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["serialize_cache_reads", "one_read_at_a_time"]

_lock = threading.Lock()


def serialize_cache_reads() -> None:
    """Make every persistent-cache read of this process hold one lock (idempotent)."""
    from jax._src import compilation_cache as cache  # JAX reads through this module's attribute

    read = cache.get_executable_and_time
    if getattr(read, "vsurge_serialized", False):
        return

    @functools.wraps(read)
    def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
        with _lock:
            return read(*args, **kwargs)

    one_at_a_time.vsurge_serialized = True  # type: ignore[attr-defined]
    cache.get_executable_and_time = one_at_a_time


@contextlib.contextmanager
def one_read_at_a_time() -> Iterator[None]:
    """Hold the process's read lock, which JAX's cache reads then hold too: for a deserialization of our
    own (the executable store's, executable_store.py)."""
    serialize_cache_reads()
    with _lock:
        yield
