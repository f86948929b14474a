"""The suite's compilation cache stays writable after a process without the size limit wrote to it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from jax_cache_repair import CACHE_SUFFIX, entries_without_atime, repair

# One fresh interpreter per write: JAX sets its cache up once per process, from the environment.
WRITE = textwrap.dedent(
    """
    import warnings, jax, jax.numpy as jnp
    warnings.simplefilter("error")  # JAX reports a failed cache write only as a warning
    jax.jit(lambda x: jnp.sin(x) * {k})(jnp.ones(3)).block_until_ready()
    """
)


def _write(folder, k: int, limited: bool) -> subprocess.CompletedProcess:
    env = {
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(folder),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    if limited:
        env["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(2**30)
    return subprocess.run(
        [sys.executable, "-c", WRITE.format(k=k)], env=env, capture_output=True, text=True, timeout=120
    )


def _entries(folder) -> int:
    return len(list(folder.glob(f"*{CACHE_SUFFIX}")))


def test_a_write_without_the_limit_stops_the_cache_until_repaired(tmp_path):
    unlimited = _write(tmp_path, 2, limited=False)
    assert unlimited.returncode == 0, unlimited.stderr
    orphans = entries_without_atime(tmp_path)
    assert orphans and len(orphans) == _entries(tmp_path)

    broken = _write(tmp_path, 3, limited=True)  # what JAX does: the write fails, with a warning
    assert broken.returncode != 0 and "-atime" in broken.stderr, broken.stderr
    assert _entries(tmp_path) == len(orphans)

    left = entries_without_atime(tmp_path)  # a cache hit stamps its entry: the broken write's jit is left
    assert left and repair(tmp_path) == len(left)
    assert entries_without_atime(tmp_path) == [] and all(o.exists() for o in orphans)
    fixed = _write(tmp_path, 3, limited=True)
    assert fixed.returncode == 0, fixed.stderr
    assert _entries(tmp_path) > len(orphans) and entries_without_atime(tmp_path) == []
    assert repair(tmp_path) == 0  # idempotent


def test_the_suites_cache_has_no_entry_without_an_access_time():
    import os

    assert entries_without_atime(os.environ["JAX_COMPILATION_CACHE_DIR"]) == []
