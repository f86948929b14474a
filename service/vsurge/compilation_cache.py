"""JAX's persistent compilation cache for `vsurge serve` (leader and workers alike)."""

from __future__ import annotations

import os


def enable_compilation_cache() -> None:
    """Keep compiled programs on disk (next to the model cache): a restart skips most of the compile."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return  # the user chose one
    import jax

    from vsurge.models.default_model import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax"))
    # every program: a second start is only as fast as the slowest program it must still compile, and
    # the many sub-second ones add up (a TPU start compiles ~20 programs)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
