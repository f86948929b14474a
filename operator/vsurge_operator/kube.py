"""A thin, dict-in/dict-out layer over the official ``kubernetes`` client.

The typed API classes of the client validate bodies against generated models; the operator works with
plain dicts (the same ones its pure builders produce), so it uses the client's ``ApiClient`` for
configuration, authentication and HTTP, and speaks REST paths itself. Writes are JSON merge patches,
never PUTs. Synchronous by design: kopf runs sync handlers in a thread pool.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from vsurge_operator import __version__, crd

logger = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = f"vsurge-operator/{__version__}"

# Statuses worth retrying: conflicts, throttling, timeouts and server-side failures.
RETRIABLE_STATUSES = frozenset({0, 408, 409, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Resource:
    api_version: str
    plural: str
    kind: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


DEPLOYMENT = Resource("apps/v1", "deployments", "Deployment")
LEADER_WORKER_SET = Resource("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "LeaderWorkerSet")
SERVICE = Resource("v1", "services", "Service")
PDB = Resource("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget")
POD = Resource("v1", "pods", "Pod")
PVC = Resource("v1", "persistentvolumeclaims", "PersistentVolumeClaim")
INFERENCE_MODEL = Resource(crd.API_VERSION, crd.PLURAL, crd.KIND)
# a multi-host model's step lane (lane.py): its secret and who may reach it
SECRET = Resource("v1", "secrets", "Secret")
NETWORK_POLICY = Resource("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy")
# spec.gateway (gateway.py): the Gateway API Inference Extension's pool of the model's pods
INFERENCE_POOL = Resource("inference.networking.k8s.io/v1", "inferencepools", "InferencePool")

BY_KIND = {
    r.kind: r
    for r in (
        DEPLOYMENT,
        LEADER_WORKER_SET,
        SERVICE,
        PDB,
        POD,
        PVC,
        INFERENCE_MODEL,
        SECRET,
        NETWORK_POLICY,
        INFERENCE_POOL,
    )
}


def resource_of(obj: dict[str, Any]) -> Resource:
    return BY_KIND[obj["kind"]]


def is_retriable(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and (exc.status or 0) in RETRIABLE_STATUSES


def load_config() -> None:
    """Log in like kubectl does: the pod's service account in a cluster, else the standard kubeconfig
    (``$KUBECONFIG`` or ``~/.kube/config``)."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


class Kube:
    """REST calls with plain dicts. Missing objects read as ``None``; other errors raise ``ApiException``."""

    def __init__(self, api_client: kubernetes.client.ApiClient | None = None, timeout: float = 30.0) -> None:
        if api_client is None:
            api_client = kubernetes.client.ApiClient(kubernetes.client.Configuration.get_default_copy())
            api_client.user_agent = USER_AGENT
        self.api = api_client
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        method, url, headers, body, _post = self.api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()) or None,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(
            method, url, header_params=headers, body=body, _request_timeout=self.timeout
        )
        raw = response.read()
        text = raw.decode("utf-8", "replace") if raw else ""
        if not 200 <= response.status < 300:
            raise ApiException(status=response.status, reason=response.reason, body=text)
        return json.loads(text) if text else {}

    def get(self, res: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", res.path(namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, res: Resource, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        return list(self.request("GET", res.path(namespace), query=query).get("items") or [])

    def create(self, res: Resource, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", res.path(namespace), body)

    def patch(
        self, res: Resource, namespace: str, name: str, patch: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        return self.request("PATCH", res.path(namespace, name, subresource), patch, content_type=MERGE_PATCH)

    def delete(self, res: Resource, namespace: str, name: str) -> bool:
        # Foreground would block on the pods; background lets the garbage collector remove them.
        try:
            self.request("DELETE", res.path(namespace, name), {"propagationPolicy": "Background"})
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True
