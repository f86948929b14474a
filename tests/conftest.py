"""Test-session setup shared by every suite."""

import gc
import os
import sys

# Eight fake CPU devices for the sharding and disaggregation tests; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Engines built by different tests share shapes: a persistent compilation cache compiles each program once,
# shared by the pytest-xdist workers and the servers they start. JAX writes an entry in place, so a reader
# could see half of one: a size limit turns on JAX's file lock around every read and write (jax lru_cache).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "vsurge", "jax-tests")
)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 * 2**30))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

from jax_cache_repair import repair as _repair_cache  # noqa: E402

# An entry written without the size limit would make every later write fail (see jax_cache_repair).
_repair_cache(os.environ["JAX_COMPILATION_CACHE_DIR"])


import pytest  # noqa: E402 - after the environment above, which must precede any jax import
from hypothesis import settings as _hypothesis  # noqa: E402

# Property tests draw a fixed set of examples, so a run's verdict never depends on its seed (a random draw
# once failed one CI run in ten with a real, rare bug: a failing run is a bug to fix, not to retry).
# HYPOTHESIS_PROFILE=explore draws fresh examples each run: the way to look for the next one.
_hypothesis.register_profile("ci", derandomize=True, database=None)
_hypothesis.register_profile("explore", derandomize=False)
_hypothesis.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _unconfigured_attention():
    """Each test file starts with no attention path configured. An engine's `pallas_sharded.configure`
    sets the process's path and mesh (one engine a process in service); a file that built a tp=2 oEngine
    left its mesh to whichever file ran next on that worker, and a test passing ``mesh=None`` to the
    kernel then got tp=2 (found when the file order changed, tests/file_seconds.py)."""

    def reset() -> None:
        ps = sys.modules.get("vsurge.models.pallas_sharded")
        if ps is not None:
            ps.reset()

    reset()
    yield
    reset()


# A worker releases a finished file's programs only once it holds this many memory mappings (a quarter of
# the kernel's vm.max_map_count, 65,530: one file of engine tests was seen adding 34,600) or this much memory
RELEASE_AT_MAPS = 16_000
RELEASE_AT_BYTES = 4 * 2**30


def _held() -> tuple[int, int]:
    """(memory mappings, resident bytes) of this process; (0, 0) where /proc is not there."""
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = sum(1 for _ in f)
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return 0, 0
    return maps, pages * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Free the programs a test file compiled once a worker holds too many. Every XLA:CPU executable holds
    dozens of memory mappings and engines keep theirs alive through reference cycles and JAX's caches: one
    file of engine tests reached 34,600 mappings, and a worker that runs many such files crossed the
    kernel's vm.max_map_count (65,530), where LLVM cannot map the next program and aborts the process. A
    live session-scoped engine recompiles what it next runs from the persistent cache.

    Releasing costs a full collection and JAX's cache clear (0.5-3.5 s a file, measured): below the
    thresholds the file's garbage is left to Python's own collections. What survives a release is mostly
    what lives all session (imports, session fixtures), so it is frozen out of the collections until the
    next release, which first unfreezes it: anything frozen that has become garbage since (a test's
    arguments pytest still held) is found there, not kept for good."""
    yield
    maps, resident = _held()
    if maps and maps < RELEASE_AT_MAPS and resident < RELEASE_AT_BYTES:
        return
    gc.unfreeze()
    gc.collect()
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
        gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Modules and collected tests live until the session ends: Python's collections need not walk them
    (~530,000 objects, 0.4 s a full collection, in a worker that imported jax, flax and transformers)."""
    gc.collect()
    gc.freeze()


# `make test` runs the suite on pytest-xdist workers, whole files per worker (tests/xdist_files.py)
from xdist_files import pytest_xdist_make_scheduler  # noqa: E402, F401 - a hook pytest finds here


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of tests/slow_list.py slow (before -m deselects); a stale name there fails."""
    from slow_list import SLOW, stale

    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
    gone = stale(SLOW, {item.nodeid for item in items})
    if gone:
        raise pytest.UsageError("tests/slow_list.py names tests that were not collected: " + ", ".join(gone))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test whose kit is missing under CI=true fails here, before its fixtures start anything."""
    from needs_kit import fail_marked

    fail_marked(item)


def pytest_configure(config: pytest.Config) -> None:
    import file_seconds
    from needs_kit import MARKER

    config.addinivalue_line(
        "markers", f"{MARKER}: the test's kit is missing under CI=true (tests/needs_kit.py)"
    )

    # its own plugin: a second collection hook, after -m has deselected (this one runs before)
    config.pluginmanager.register(file_seconds, "file_seconds")
