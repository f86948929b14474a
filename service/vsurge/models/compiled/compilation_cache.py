"""JAX's persistent compilation cache for `vsurge serve` (leader and workers alike), its entries signed.

JAX reads an entry back without pickle (jax/_src/compilation_cache.py: decompress, split off the compile
time, ``backend.deserialize_executable``), but what it loads is a compiled program the process then runs,
and jax.experimental.serialize_executable says of the same load: "Even loading such an executable may
run arbitrary code on your machine". The cache dir can be a volume other pods write to (the operator's
compile-cache claim), so with ``VSURGE_CACHE_HMAC_KEY`` set (the operator sets it on every pod of a
model) `sign_jax_cache` wraps JAX's cache object: every entry is written signed and read back only if its
HMAC-SHA256 (cache_signing.py, the executable store's key) matches, checked before JAX sees a byte.
An entry that fails is refused with a warning and JAX compiles and rewrites it. Without the variable the
cache is JAX's own format: a dir only its user can write gains nothing from a key kept by that same user,
and a process that signs and one that does not would each refuse the other's entries (the test suite's
shared cache, a script beside a server).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from . import cache_signing

log = logging.getLogger(__name__)
_install_lock = threading.Lock()


def enable_compilation_cache() -> None:
    """Keep compiled programs on disk (next to the model cache): a restart skips most of the compile."""
    if os.environ.get(cache_signing.ENV):
        sign_jax_cache()  # a cache dir the user chose is signed too
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return  # the user chose one
    import jax

    from vsurge.models.default_model import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax"))
    # every program: a second start is only as fast as the slowest program it must still compile, and
    # the many sub-second ones add up (a TPU start compiles ~20 programs)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class SignedCache:
    """JAX's cache object (`CacheInterface`: get/put of bytes by key) with every value signed."""

    def __init__(self, base: Any, directory: str | None):
        self._base, self._directory = base, directory
        self._refused: set[str] = set()  # keys whose entry was refused: the next put replaces it

    def _key(self) -> bytes:
        return cache_signing.cache_key(shared_dir=self._directory)

    def get(self, key: str) -> bytes | None:
        data = self._base.get(key)
        if data is None:
            return None
        value = cache_signing.verified(self._key(), f"jax/{key}", data)
        if value is None:
            log.warning(
                "JAX cache entry %s refused: its signature does not match this host's key (tampered, written "
                "with another %s or unsigned); not loaded, compiling it",
                key,
                cache_signing.ENV,
            )
            self._refused.add(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        data = cache_signing.sign(self._key(), f"jax/{key}", value)
        if key in self._refused and hasattr(self._base, "path"):
            self._refused.discard(key)
            self._replace(Path(self._base.path), key, data)
            return
        self._base.put(key, data)

    def _replace(self, directory: Path, key: str, data: bytes) -> None:
        """Write over a refused entry (JAX's file cache never overwrites one): whole, then renamed, so a
        reader in another process sees the old entry or the new one, never half of one."""
        path = directory / f"{key}-cache"  # jax/_src/lru_cache.py's layout
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
            if getattr(self._base, "eviction_enabled", False):  # its LRU reads an access time per entry
                (directory / f"{key}-atime").write_bytes(time.time_ns().to_bytes(8, "little"))
        except OSError as e:
            log.warning("JAX cache entry %s not rewritten (%s)", key, e)
            tmp.unlink(missing_ok=True)

    def __getattr__(self, name: str) -> Any:  # _path, clear, ...: the base's
        return getattr(self._base, name)


def sign_jax_cache() -> None:
    """Sign every entry this process writes to JAX's persistent cache, refuse unsigned ones (idempotent).
    JAX looks its cache object up through ``compilation_cache._get_cache`` on each read and write."""
    from jax._src import compilation_cache as cc

    with _install_lock:
        get_cache = cc._get_cache
        if getattr(get_cache, "vsurge_signed", False):
            return
        wrapped: dict[int, SignedCache] = {}  # JAX's cache object -> its signed view (reset_cache: a new one)

        def signed_get_cache(backend: Any) -> Any:
            base = get_cache(backend)
            if base is None:
                return None
            view = wrapped.get(id(base))
            if view is None or view._base is not base:
                import jax

                view = wrapped[id(base)] = SignedCache(base, jax.config.jax_compilation_cache_dir)
            return view

        signed_get_cache.vsurge_signed = True  # type: ignore[attr-defined]
        cc._get_cache = signed_get_cache
