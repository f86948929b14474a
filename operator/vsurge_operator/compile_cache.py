"""spec.compileCache: the JAX compile cache on a PersistentVolumeClaim, so a new pod skips the compile.

`vsurge serve` keeps compiled programs in ``$VSURGE_CACHE_DIR/jax``; the claim is mounted right there,
inside the cache volume, so the model download (big, refetchable) can stay on an emptyDir while the
compiled programs (small, minutes of work) survive the pod. The claim is either the user's
(``claimName``, ReadWriteMany to share it between replicas) or one the operator creates and owns
(``<model>-compile-cache``), deleted with the model.

The access mode of the operator's claim decides its shape: ``ReadWriteMany`` is one claim shared by
every pod (the storage class must offer it, or the pods stay Pending); ``ReadWriteOnce`` /
``ReadWriteOncePod`` (the operator's default when the spec sets none, ``OperatorConfig``
.compile_cache_access_mode) is a claim per pod: a generic ephemeral volume from the same template, made
with the pod and deleted with it, so it keeps the compiled programs across the container's restarts
(a crash, an OOM kill) on any storage class, but a new pod compiles once more.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vsurge_operator.spec import ModelSpec

SHARED = "ReadWriteMany"

VOLUME = "compile-cache"
SUFFIX = "-compile-cache"


def claim_name(model: ModelSpec) -> str | None:
    cc = model.compile_cache
    if cc is None:
        return None
    return cc.claim_name or f"{model.name}{SUFFIX}"


def with_default(model: ModelSpec, access_mode: str) -> ModelSpec:
    """The model with the operator's access mode where its spec.compileCache (a size) sets none."""
    cc = model.compile_cache
    if cc is None or cc.claim_name or cc.access_mode:
        return model
    return dataclasses.replace(model, compile_cache=dataclasses.replace(cc, access_mode=access_mode))


def per_pod(model: ModelSpec) -> bool:
    """A claim per pod (an ephemeral volume): the operator's claim, not ReadWriteMany."""
    cc = model.compile_cache
    return cc is not None and not cc.claim_name and cc.size is not None and (cc.access_mode or "") != SHARED


def _claim_spec(model: ModelSpec) -> dict[str, Any]:
    cc = model.compile_cache
    assert cc is not None
    spec: dict[str, Any] = {
        "accessModes": [cc.access_mode or "ReadWriteOnce"],
        "resources": {"requests": {"storage": cc.size}},
    }
    if cc.storage_class_name:
        spec["storageClassName"] = cc.storage_class_name
    return spec


def volume(model: ModelSpec) -> dict[str, Any] | None:
    if per_pod(model):
        return {"name": VOLUME, "ephemeral": {"volumeClaimTemplate": {"spec": _claim_spec(model)}}}
    name = claim_name(model)
    return None if name is None else {"name": VOLUME, "persistentVolumeClaim": {"claimName": name}}


def mount(cache_dir: str) -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": f"{cache_dir}/jax"}


def claim(model: ModelSpec, metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The shared claim the operator creates, or None when the spec names an existing one, each pod has
    its own (per_pod), or there is no cache."""
    cc = model.compile_cache
    if cc is None or cc.claim_name or cc.size is None or per_pod(model):
        return None
    spec = _claim_spec(model)
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {**metadata, "name": f"{model.name}{SUFFIX}"},
        "spec": spec,
    }
