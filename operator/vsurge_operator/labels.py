"""Who an object belongs to: the labels, selectors and owner reference every object of a model carries.

Its own module because both the workload builders (manifests.py) and the step lane's objects (lane.py)
stamp them, and manifests.py builds on the lane: keeping these here lets neither import the other's user.
"""

from __future__ import annotations

from typing import Any

from vsurge_operator import crd
from vsurge_operator.spec import HTTP_PORT, ModelSpec

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"

LABEL_MODEL = "vsurge.io/model"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
MANAGER = "vsurge-operator"
APP_NAME = "vsurge-server"
# The label llm-d's endpoint picker reads to choose a pod's metric names (llm-d.ai/engine-type, and the
# Gateway API Inference Extension's older key): `vsurge serve` exports vLLM's (vllm:num_requests_waiting...).
ENGINE_TYPE_LABELS = {"llm-d.ai/engine-type": "vllm", "inference.networking.k8s.io/engine-type": "vllm"}


def selector_labels(model: ModelSpec) -> dict[str, str]:
    """Stable labels that select the model's pods (a Deployment's selector is immutable)."""
    return {LABEL_NAME: APP_NAME, LABEL_MODEL: model.name}


def labels(model: ModelSpec) -> dict[str, str]:
    return {
        **selector_labels(model),
        LABEL_INSTANCE: model.name,
        LABEL_COMPONENT: "server",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_PART_OF: "vsurge",
    }


def selector_string(model: ModelSpec) -> str:
    """The pod selector in ``key=value,...`` form, published as ``.status.selector`` for the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(model).items()))


def serving_selector(model: ModelSpec) -> dict[str, str]:
    """Pods that answer HTTP: every pod of a Deployment, only the leaders of a LeaderWorkerSet."""
    sel = selector_labels(model)
    if model.multi_host:
        sel[LWS_WORKER_INDEX_LABEL] = "0"
    return sel


def endpoint(model: ModelSpec) -> str:
    """In-cluster URL of the model's Service, read by the router from ``.status.endpoint``."""
    return f"http://{model.name}.{model.namespace}.svc.cluster.local:{HTTP_PORT}"


def owner_reference(model: ModelSpec) -> dict[str, Any]:
    return {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "name": model.name,
        "uid": model.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_metadata(
    model: ModelSpec, name: str | None = None, extra_labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """Metadata of an object the model owns: its name (the model's unless given), namespace, labels (plus
    ``extra_labels``) and the owner reference that makes Kubernetes delete it with the model."""
    return {
        "name": model.name if name is None else name,
        "namespace": model.namespace,
        "labels": {**labels(model), **(extra_labels or {})},
        "ownerReferences": [owner_reference(model)],
    }
