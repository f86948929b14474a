"""The step lane of a multi-host model: its secret, who may reach it, and what its failures say.

A multi-host model's processes form one JAX group and replay the leader's engine calls over the step lane
(``vsurge serve``'s :8477, next to JAX's coordinator on :8476). For each such InferenceModel the operator

* creates ``<model>-lane``, a Secret owned by the model holding 48 random bytes (``lane.key``), once: it is
  never rewritten, so every process of every group reads the same secret. The leader and the workers mount
  it read-only and ``VSURGE_LANE_SECRET_FILE`` names the file; every lane connection proves it holds it.
  Rotation is a new group: delete the Secret, the operator makes a new one, and the pod templates'
  ``vsurge.io/lane-secret`` annotation (a digest of it) changes, so the LeaderWorkerSet rolls every group;
* renders ``<model>-lane``, a NetworkPolicy over the model's pods: the model's own pods may reach each
  other on any port (the lane, the coordinator, and whatever the accelerator runtime uses between hosts);
  any other peer only the ``http`` and ``metrics`` ports. A CNI without NetworkPolicy support ignores it;
  the lane's authentication still holds there;
* reads why a group failed from its pods' termination messages (``GroupFailedError: worker 2 (pod
  m-0-2) sent nothing for 5.0s ...``, written by the process that noticed) for the model's status.

Everything here is a pure builder except ``ensure_secret`` and ``remove``, which take the API.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from vsurge_operator import apply, kube, labels, podsecurity
from vsurge_operator.spec import HTTP_PORT, METRICS_PORT, ModelSpec

SECRET_KEY = "lane.key"
SECRET_DIR = "/var/run/secrets/vsurge/lane"
SECRET_ENV = "VSURGE_LANE_SECRET_FILE"
VOLUME = "lane-secret"
ROTATION_ANNOTATION = "vsurge.io/lane-secret"
SECRET_BYTES = 48
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_FAILED = "GroupFailed"
_FAILURE_PREFIX = "GroupFailedError: "


def name(model: ModelSpec) -> str:
    return f"{model.name}-lane"


def _metadata(model: ModelSpec) -> dict[str, Any]:
    return labels.owned_metadata(model, name(model))


def secret(model: ModelSpec, data: bytes | None = None) -> dict[str, Any]:
    """The lane Secret, with fresh random bytes unless ``data`` is given."""
    raw = data if data is not None else base64.b64encode(secrets.token_bytes(SECRET_BYTES))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(model),
        "type": "Opaque",
        "data": {SECRET_KEY: base64.b64encode(raw).decode()},
    }


def version(live_secret: Mapping[str, Any]) -> str:
    """A digest of the Secret's contents: the pods' annotation, so a new secret rolls the groups."""
    data = ((live_secret.get("data") or {}).get(SECRET_KEY) or "").encode()
    return hashlib.sha256(data).hexdigest()[:16]


def ensure_secret(api: kube.Kube, model: ModelSpec) -> str:
    """Create the model's lane Secret if it is missing (never rewrite one: the running groups use it);
    returns its version. OwnershipConflict when a Secret of that name belongs to someone else."""
    live = api.get(kube.SECRET, model.namespace, name(model))
    if live is None:
        live = api.create(kube.SECRET, model.namespace, secret(model))
    elif not apply.controlled_by(live, model.uid):
        raise apply.OwnershipConflict("Secret", name(model))
    return version(live)


def network_policy(model: ModelSpec, *, open_ports: bool = True) -> dict[str, Any]:
    """Ingress to the model's pods: from its own pods on any port, and (``open_ports``) from anyone on http
    and metrics; without it, the model's own policy (access.py) says who reaches those."""
    pods = {**labels.selector_labels(model), LWS_NAME_LABEL: model.name}
    open_rule = [
        {"ports": [{"protocol": "TCP", "port": HTTP_PORT}, {"protocol": "TCP", "port": METRICS_PORT}]}
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(model),
        "spec": {
            "podSelector": {"matchLabels": labels.selector_labels(model)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": pods}}]},
                *(open_rule if open_ports else []),
            ],
        },
    }


def mount(template: dict[str, Any], model: ModelSpec, secret_version: str | None) -> None:
    """Give a group pod template the lane secret: a read-only volume, the variable naming the file, and
    the annotation that rolls the groups when the secret changes."""
    spec = template["spec"]
    spec["volumes"].append(
        {
            "name": VOLUME,
            "secret": {
                "secretName": name(model),
                "defaultMode": 0o440,
                "items": [{"key": SECRET_KEY, "path": SECRET_KEY}],
            },
        }
    )
    # the image runs as gid 10001: the secret's files must be that group's to be readable at 0440
    spec.setdefault("securityContext", {}).setdefault("fsGroup", podsecurity.IMAGE_GID)
    c = spec["containers"][0]
    c["volumeMounts"].append({"name": VOLUME, "mountPath": SECRET_DIR, "readOnly": True})
    if not any(e["name"] == SECRET_ENV for e in c["env"]):
        c["env"].append({"name": SECRET_ENV, "value": f"{SECRET_DIR}/{SECRET_KEY}"})
    if secret_version:
        template["metadata"].setdefault("annotations", {})[ROTATION_ANNOTATION] = secret_version


def remove(api: kube.Kube, model: ModelSpec) -> list[str]:
    """The NetworkPolicy of a model that is no longer multi-host (if it controls it). Its Secret stays,
    unused, until the model is deleted (the operator never deletes secrets: its RBAC has no such verb)."""
    if apply.remove_if_controlled(api, kube.NETWORK_POLICY, model.namespace, name(model), model.uid):
        return [kube.NETWORK_POLICY.kind]
    return []


def _failures(pod: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(finishedAt, ``pod <name>: <why>``) of each group failure the pod's containers reported."""
    pod_name = (pod.get("metadata") or {}).get("name", "")
    found = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (cs.get("state") or {}, cs.get("lastState") or {}):
            term = state.get("terminated") or {}
            message = str(term.get("message") or "").strip()
            if message.startswith(_FAILURE_PREFIX):
                why = message[len(_FAILURE_PREFIX) :]
                found.append((str(term.get("finishedAt") or ""), f"pod {pod_name}: {why}"))
    return found


def group_failure(pods: Sequence[Mapping[str, Any]] | None) -> str | None:
    """``pod <name>: <why>`` of the last group failure a pod of the model reported, else None."""
    found = [f for pod in pods or [] for f in _failures(pod)]
    return max(found)[1][:1024] if found else None


def record_failure(api: kube.Kube, pod: Mapping[str, Any], now: str) -> tuple[dict[str, Any], str] | None:
    """A pod of a model just reported a group failure (the operator sees every pod event): put it in the
    model's ``status.lastGroupFailure`` at once, before the LeaderWorkerSet recreates the group and the
    pod's message goes with it. Returns (the model, the message) when something new was recorded."""
    found = _failures(pod)
    meta = pod.get("metadata") or {}
    model = (meta.get("labels") or {}).get(labels.LABEL_MODEL)
    if not found or not model:
        return None
    message = max(found)[1][:1024]
    namespace = meta.get("namespace", "default")
    im = api.get(kube.INFERENCE_MODEL, namespace, model)
    if im is None or ((im.get("status") or {}).get("lastGroupFailure") or {}).get("message") == message:
        return None
    patch = {"status": {"lastGroupFailure": {"message": message, "observedAt": now}}}
    api.patch(kube.INFERENCE_MODEL, namespace, model, patch, subresource="status")
    return im, message
