"""Test-session setup shared by every suite."""

import os

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


import pytest  # noqa: E402 - after the environment above, which must precede any jax import


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: `make test` runs the suite on two workers
def pytest_xdist_make_scheduler(config, log):
    """Whole test files go to a worker, so a module's fixtures (a compiled engine, a started server) are
    built once; all of tests/cluster goes to one, which boots the one cluster they share."""
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/cluster" if path.startswith("tests/cluster/") else path

    return FileScheduling(config, log)
