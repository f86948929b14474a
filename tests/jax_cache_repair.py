"""Keeps the suite's persistent compilation cache writable.

The suite sets a size limit on JAX's cache (tests/conftest.py) for its file lock, which turns on JAX's LRU
eviction: every write first reads the access-time file ("<key>-atime") of every entry. A process that opens
the same folder without the limit (a script or server started outside the suite's environment) writes
entries with no access-time file, and from then on each write of every limited process fails on the missing
file with only a warning ("Error writing persistent compilation cache entry ... -atime"): the cache stops
growing, and every later run of the suite compiles everything cold. Measured: 74 such entries on this
machine had frozen the cache for hours, and CI's log showed the same warning.
"""

from __future__ import annotations

from pathlib import Path

CACHE_SUFFIX = "-cache"  # JAX's names (jax/_src/lru_cache.py)
ATIME_SUFFIX = "-atime"


def atime_of(entry: Path) -> Path:
    """The access-time file JAX keeps beside the cache entry ``entry``."""
    return entry.with_name(entry.name.removesuffix(CACHE_SUFFIX) + ATIME_SUFFIX)


def entries_without_atime(folder: str | Path) -> list[Path]:
    """The cache entries of ``folder`` that JAX's eviction cannot read an access time for."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return [entry for entry in root.glob(f"*{CACHE_SUFFIX}") if not atime_of(entry).exists()]


def repair(folder: str | Path) -> int:
    """Give every entry without an access-time file one (its modification time, JAX's 8-byte little-endian
    nanoseconds), so that writes work again; returns how many were repaired. Idempotent and safe beside a
    running JAX: a write that races it stores the same kind of stamp."""
    repaired = 0
    for entry in entries_without_atime(folder):
        try:
            atime_of(entry).write_bytes(int(entry.stat().st_mtime * 1e9).to_bytes(8, "little"))
            repaired += 1
        except OSError:  # the entry was evicted meanwhile
            continue
    return repaired
