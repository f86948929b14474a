"""XLA flags of the suite's own JAX processes (pytest's and the servers and groups it starts).

The suite compiles its XLA:CPU programs without LLVM's optimizations: compiling is most of the suite's CPU
time on 2 cores, a tiny model runs no slower (its matmuls are library calls either way), and float
semantics do not change (no fast-math at any level). Measured: two engine test files with the compile cache
off, 164 -> 114 s. What `vsurge serve` and the benchmarks compile keeps XLA's defaults.
"""

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process with ``devices`` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}"
