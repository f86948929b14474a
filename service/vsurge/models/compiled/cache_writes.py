"""No entry in JAX's persistent cache for a program the executable store keeps.

Each program a cold start compiles was serialized, compressed and written twice: into JAX's cache by the
compiling thread, then into the executable store (vsurge/models/compiled/executable_store.py), which is what a warm start
reads. Inside `skipping_jax_cache_writes` the calling thread's compiles write nothing to JAX's cache, so
each executable is serialized once, on the store's writer thread, off the start's critical path (a v5e,
the 1B shape: 345 MB of executables). A start whose store key changed (the vsurge code, say) compiles
those programs again instead of reading JAX's entries for them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["skipping_jax_cache_writes"]

_local = threading.local()
_patch_lock = threading.Lock()


def _install() -> None:
    from jax._src import compilation_cache as cache  # the compiler writes through this module's attribute

    with _patch_lock:
        put = cache.put_executable_and_time
        if getattr(put, "vsurge_skippable", False):
            return

        @functools.wraps(put)
        def put_unless_skipped(*args: Any, **kwargs: Any) -> Any:
            if getattr(_local, "skip", False):
                return None
            return put(*args, **kwargs)

        put_unless_skipped.vsurge_skippable = True  # type: ignore[attr-defined]
        cache.put_executable_and_time = put_unless_skipped


@contextlib.contextmanager
def skipping_jax_cache_writes(skip: bool = True) -> Iterator[None]:
    """The calling thread's compiles inside the block write no JAX cache entry (when ``skip``)."""
    if not skip:
        yield
        return
    _install()
    before = getattr(_local, "skip", False)
    _local.skip = True
    try:
        yield
    finally:
        _local.skip = before
