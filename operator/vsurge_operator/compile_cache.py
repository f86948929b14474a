"""spec.compileCache: the JAX compile cache on a PersistentVolumeClaim, so a new pod skips the compile.

`vsurge serve` keeps compiled programs in ``$VSURGE_CACHE_DIR/jax``; the claim is mounted right there,
inside the cache volume, so the model download (big, refetchable) can stay on an emptyDir while the
compiled programs (small, minutes of work) survive the pod. The claim is either the user's
(``claimName``, ReadWriteMany to share it between replicas) or one the operator creates and owns
(``<model>-compile-cache``), deleted with the model.
"""

from __future__ import annotations

from typing import Any

from vsurge_operator.spec import ModelSpec

VOLUME = "compile-cache"
SUFFIX = "-compile-cache"


def claim_name(model: ModelSpec) -> str | None:
    cc = model.compile_cache
    if cc is None:
        return None
    return cc.claim_name or f"{model.name}{SUFFIX}"


def volume(model: ModelSpec) -> dict[str, Any] | None:
    name = claim_name(model)
    return None if name is None else {"name": VOLUME, "persistentVolumeClaim": {"claimName": name}}


def mount(cache_dir: str) -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": f"{cache_dir}/jax"}


def claim(model: ModelSpec, metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The claim the operator creates, or None when the spec names an existing one (or no cache)."""
    cc = model.compile_cache
    if cc is None or cc.claim_name or cc.size is None:
        return None
    spec: dict[str, Any] = {
        "accessModes": [cc.access_mode],
        "resources": {"requests": {"storage": cc.size}},
    }
    if cc.storage_class_name:
        spec["storageClassName"] = cc.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {**metadata, "name": f"{model.name}{SUFFIX}"},
        "spec": spec,
    }
