"""The backend the programs being built are for: this process's, or the TPU being lowered for.

Every choice the engine makes by backend (the dense KV reader, the sampler's top-k, row and prefill
buckets, decode blocks, int8 scale groups, the default dtype, the paged attention kernel) asks
`target_backend` instead of ``jax.default_backend()``. They are the same thing except inside
`tpu_lowering.targeting` (an abstract mesh whose `AbstractDevice` is a TPU): there a CPU machine builds,
traces and exports exactly the programs a TPU would compile, which is how CI proves them (tests/service/
test_tpu_export.py). One setting, the abstract mesh in context, so nothing can be half switched.
"""

from __future__ import annotations

import jax

__all__ = ["target_backend", "target_device_kind"]


def _abstract_device():
    return jax.sharding.get_abstract_mesh().abstract_device


def target_backend() -> str:
    """``"tpu"`` (etc.) while lowering for that platform (`tpu_lowering.targeting`), else this process's
    default backend."""
    abstract = _abstract_device()
    if abstract is not None and abstract.platform:
        return abstract.platform
    return jax.default_backend()


def target_device_kind() -> str | None:
    """The TPU programs are built for: the one being lowered for, else this process's TPU; None off TPU."""
    abstract = _abstract_device()
    if abstract is not None and abstract.platform == "tpu":
        return abstract.device_kind
    if jax.default_backend() == "tpu":
        return jax.devices()[0].device_kind
    return None
