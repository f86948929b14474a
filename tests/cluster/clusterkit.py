"""Helpers of the cluster suite: what a kubelet would do, the operator and `vsurge serve` as processes.

No kubelet runs in the kit: pods the controller-manager creates stay Pending. ``Kubelet`` plays its part
through the API, as a kubelet does: it gives each new pod of a selector an IP on 127.0.0.0/8 and reports it
Running and Ready (status subresource). ``serve`` starts a real `vsurge serve` bound to such an IP on the
model ports the operator puts in the pod spec, so the operator's scraper reaches it at podIP:11557.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kmock_harness import LoggedProcess, clean_env, vsurge_command  # noqa: F401 - re-exported
from kmock_harness import wait_for as _wait_for
from kubernetes.client.exceptions import ApiException
from operator_harness import OperatorProcess
from patience import ceiling

from vsurge_operator import kube

REPO = Path(__file__).resolve().parents[2]
KIT = Path(os.environ.get("K8SKIT_HOME") or REPO.parent / "shared" / "k8s")  # the kit: ../shared/k8s
IM = kube.INFERENCE_MODEL
NAMESPACE = kube.Resource("v1", "namespaces", "Namespace")
REPLICA_SET = kube.Resource("apps/v1", "replicasets", "ReplicaSet")
EVENT = kube.Resource("v1", "events", "Event")

# Pod IPs 127.0.0.X: a random block per session so that two sessions on one machine do not collide.
_ip_lock = threading.Lock()
_next_ip = [20 + (os.getpid() % 20) * 10]


def next_pod_ip() -> str:
    with _ip_lock:
        n = _next_ip[0]
        _next_ip[0] = n + 1 if n < 249 else 20
        return f"127.0.0.{n}"


def wait_for(
    predicate: Callable[[], Any], timeout: float = 20, interval: float = 0.1, message: str = ""
) -> Any:
    """kmock_harness.wait_for with the real server's pace (longer timeout, slower polling)."""
    return _wait_for(predicate, timeout, interval, message)


def inference_model(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"source": "default"}}
    body.update(spec)
    return {
        "apiVersion": "vsurge.io/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return {}


def selector(model: str) -> str:
    return f"app.kubernetes.io/name=vsurge-server,vsurge.io/model={model}"


def pods(api: kube.Kube, namespace: str, model: str) -> list[dict[str, Any]]:
    return [
        p
        for p in api.list(kube.POD, namespace, selector(model))
        if not p["metadata"].get("deletionTimestamp")
    ]


def events(api: kube.Kube, namespace: str, reason: str | None = None) -> list[dict[str, Any]]:
    items = api.list(EVENT, namespace)
    return [e for e in items if reason is None or e.get("reason") == reason]


def ready_status(ip: str) -> dict[str, Any]:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "hostIP": "127.0.0.1",
            "startTime": now,
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
                {"type": "Ready", "status": "True", "lastTransitionTime": now},
            ],
        }
    }


class Kubelet:
    """Marks every new pod of ``namespace`` Running + Ready with its own 127.0.0.X IP (a thread)."""

    def __init__(
        self,
        api: kube.Kube,
        namespace: str,
        on_pod: Callable[[str, str], None] | None = None,
        ip_for: Callable[[dict[str, Any]], str | None] | None = None,
        node: str | None = None,
    ):
        """``ip_for(pod)`` may pick a pod's IP (e.g. where a `vsurge serve` listens); ``on_pod(name, ip)``
        is told of each new pod. ``node``: bind each pod to this Node first, as the scheduler would (the
        EndpointSlice controller lists only pods on a Node that exists; see ``ensure_node``)."""
        self.api, self.namespace, self.on_pod, self.ip_for = api, namespace, on_pod, ip_for
        self.node = node
        self.ips: dict[str, str] = {}  # pod name -> IP
        self.errors: list[BaseException] = []
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cluster-kubelet", daemon=True)

    def start(self) -> Kubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # never started (a test failed before): nothing to join
            self._thread.join(10)

    def _loop(self) -> None:
        beat = 0.0
        while not self._stop.wait(0.2):
            if self.paused.is_set():
                continue
            try:
                if self.node and time.monotonic() - beat > 10:
                    node_heartbeat(self.api, self.node)
                    beat = time.monotonic()
                self.sync()
            except Exception as e:  # kept for the test; the loop goes on
                self.errors.append(e)

    def sync(self) -> None:
        for pod in self.api.list(kube.POD, self.namespace):
            name = pod["metadata"]["name"]
            if pod["metadata"].get("deletionTimestamp") or (pod.get("status") or {}).get("podIP"):
                continue
            ip = self.ips.get(name) or (self.ip_for and self.ip_for(pod)) or next_pod_ip()
            if self.on_pod is not None and name not in self.ips:
                self.on_pod(name, ip)
            self.ips[name] = ip
            try:
                if self.node and not pod["spec"].get("nodeName"):
                    self.api.request(
                        "POST",
                        f"/api/v1/namespaces/{self.namespace}/pods/{name}/binding",
                        {
                            "apiVersion": "v1",
                            "kind": "Binding",
                            "metadata": {"name": name},
                            "target": {"kind": "Node", "name": self.node},
                        },
                    )
                self.api.patch(kube.POD, self.namespace, name, ready_status(ip), subresource="status")
            except ApiException as e:
                if e.status != 404:
                    raise


def start_operator(
    kubeconfig: Path, log_path: Path, *args: str, env: dict[str, str] | None = None, standalone: bool = True
) -> OperatorProcess:
    """``python -m vsurge_operator`` against the cluster, with short intervals for tests.

    ``standalone=False`` leaves peering to kopf's auto-detection, as the chart runs it."""
    defaults = [
        "--resync-seconds=2",
        "--retry-delay-seconds=1",
        "--default-image=ghcr.io/vsurge-stack/vsurge-service:test",
    ]
    proc = OperatorProcess(kubeconfig, log_path, [*defaults, *args], env=env)
    if not standalone:
        proc.args = [a for a in proc.args if a != "--standalone"]
    return proc.start()


def serve(model_dir: Path, ip: str, log_path: Path, served_name: str, *flags: str) -> LoggedProcess:
    """A real `vsurge serve` on ip:11556 (API) and ip:11557 (/metrics), the pod ports of the operator."""
    env = clean_env(JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, not the suite's eight fake ones
    args = [
        *vsurge_command(),
        "serve",
        f"--model={model_dir}",
        f"--served-model-name={served_name}",
        f"--host={ip}",
        "--port=11556",
        "--metrics-port=11557",
        *flags,
    ]
    return LoggedProcess(args, log_path, env).start()


def kubectl(kubeconfig: Path, *args: str) -> str | None:
    """kubectl when it is installed (None otherwise): the tests then make the same call with the client."""
    import shutil

    if not shutil.which("kubectl"):
        return None
    p = subprocess.run(
        ["kubectl", f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, (p.args, p.stdout, p.stderr)
    return p.stdout


def dump(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=False)


# ------------------------------------------------------------------------------------------- the chart

HELM_KIND_ORDER = [  # Helm's install order (pkg/releaseutil/kind_sorter.go), the kinds the chart renders
    "Namespace",
    "NetworkPolicy",
    "ResourceQuota",
    "LimitRange",
    "PodSecurityPolicy",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Secret",
    "SecretList",
    "ConfigMap",
    "StorageClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleList",
    "ClusterRoleBinding",
    "ClusterRoleBindingList",
    "Role",
    "RoleList",
    "RoleBinding",
    "RoleBindingList",
    "Service",
    "DaemonSet",
    "Pod",
    "ReplicationController",
    "ReplicaSet",
    "Deployment",
    "HorizontalPodAutoscaler",
    "StatefulSet",
    "Job",
    "CronJob",
    "IngressClass",
    "Ingress",
    "APIService",
]


def helm_order(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Objects in the order `helm install` creates them (unknown kinds, e.g. custom resources, last)."""
    rank = {k: i for i, k in enumerate(HELM_KIND_ORDER)}
    return sorted(objects, key=lambda o: rank.get(o["kind"], len(rank)))


def render_chart(values: dict[str, Any] | None, namespace: str) -> Any:
    """The chart rendered by Helm's own engine (tests/helm/chartkit.py)."""
    import helm_python

    sys.path.insert(0, str(REPO / "tests" / "helm"))
    from chartkit import CHART_DIR, render

    chart = helm_python.Chart.load(CHART_DIR)
    try:
        return render(chart, values, namespace)
    finally:
        chart.close()


def server_side_apply(api_client: Any, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
    """`kubectl apply --server-side [--dry-run=server]` of one object, the resource found by discovery."""
    from kubernetes.dynamic import DynamicClient

    dyn = DynamicClient(api_client)
    res = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    kwargs: dict[str, Any] = {"field_manager": "vsurge-tests", "force_conflicts": True}
    if dry_run:
        kwargs["dry_run"] = "All"
    ns = obj["metadata"].get("namespace") if res.namespaced else None
    return dyn.server_side_apply(
        res, body=obj, name=obj["metadata"]["name"], namespace=ns, **kwargs
    ).to_dict()


def service_account_token(api: kube.Kube, namespace: str, name: str, timeout: float = 30) -> str:
    """The token of a ServiceAccount: 1.20's controller-manager writes it into a Secret of its own."""
    import base64

    deadline = time.monotonic() + ceiling(timeout)
    while time.monotonic() < deadline:
        sa = api.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
        for ref in sa.get("secrets") or []:
            secret = api.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{ref['name']}")
            token = (secret.get("data") or {}).get("token")
            if token:
                return base64.b64decode(token).decode()
        time.sleep(0.2)
    raise AssertionError(f"no token for ServiceAccount {namespace}/{name}")


def ensure_node(api: kube.Kube, name: str) -> None:
    """A Node object, Ready (the test's `Kubelet` keeps its heartbeat): what the EndpointSlice controller needs
    to list a bound pod, and what keeps the pod-GC controller from force-deleting the pods bound to it (a pod
    on a Node that does not exist is an orphan, deleted ~40-60 s after binding)."""
    try:
        api.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    except ApiException as e:
        if e.status != 409:
            raise
    node_heartbeat(api, name)


def node_heartbeat(api: kube.Kube, name: str) -> None:
    """Report the Node Ready now, as a kubelet does every 10 s: without it the node-lifecycle controller marks
    the node unreachable after its grace period, taints it NoExecute and evicts its pods 300 s later."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    api.request(
        "PATCH",
        f"/api/v1/nodes/{name}/status",
        {"status": {"conditions": [ready]}},
        content_type="application/merge-patch+json",
    )


def ensure_namespace(api: kube.Kube, name: str) -> None:
    """Create a namespace unless it is there already (`helm install --create-namespace`)."""
    try:
        api.request(
            "POST",
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
        )
    except ApiException as e:
        if e.status != 409:
            raise
