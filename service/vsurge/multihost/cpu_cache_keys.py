"""Multi-process groups on CPU: one persistent-cache key per group-wide program, the same in every process.

JAX keys a compiled program by its module, its compile options and its devices' topology fingerprint, and
only process 0 of a group writes the cache (the others are meant to read what it wrote). On a TPU slice
every host sees one topology. XLA:CPU fingerprints each process's own view of it, so on CPU every process
had its own key for the same program: the leader wrote entries no worker ever found, and every worker
compiled every program at every start (a 4-process test group: three workers' compiles beside the
leader's reads, 60 s to ready instead of 6 s for one process of the same configuration). A program that
spans processes is keyed here by its global devices instead (id, owning process, kind), which every
process sees alike; its executable is the same SPMD program in each of them. Programs on one process's
own devices keep JAX's key.
"""

from __future__ import annotations

import hashlib
from typing import Any

_SHARED = False


def share_cpu_cache_keys() -> None:
    """Key group-wide CPU programs by their global devices (idempotent; TPU and one-process keys unchanged)."""
    global _SHARED
    if _SHARED:
        return
    import jax
    from jax._src import cache_key

    fingerprint = getattr(cache_key, "_hash_accelerator_config", None)
    if fingerprint is None:
        raise RuntimeError(
            f"jax {jax.__version__}: cannot share compiled programs across a CPU group's processes; "
            "run multi-process groups on TPU or with jax 0.10"
        )

    def global_devices(hash_obj: Any, devices: Any) -> None:
        flat = list(devices.flat)
        if not group_wide_on_cpu(flat):
            return fingerprint(hash_obj, devices)
        hash_obj.update(devices_key(flat))

    cache_key._hash_accelerator_config = global_devices
    _SHARED = True


def group_wide_on_cpu(devices: list[Any]) -> bool:
    """A CPU program whose devices belong to more than one process."""
    return bool(devices) and devices[0].platform == "cpu" and len({d.process_index for d in devices}) > 1


def devices_key(devices: list[Any]) -> bytes:
    """The same bytes in every process of the group: each device's global id, owning process and kind."""
    text = ";".join(f"{d.id}:{d.process_index}:{d.device_kind}" for d in devices)
    return hashlib.sha256(text.encode()).digest()
