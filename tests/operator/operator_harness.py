"""Operator-suite harness: the real operator process, a fake kubelet with real /metrics servers, spec helpers.

KMock on loopback (and its gap fixes), free ports, ``wait_for`` and the logged child process are shared with
the router suite: tests/kmock_harness.py.
"""

from __future__ import annotations

import copy
import http.server
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kmock_harness import REPO, LoggedProcess, free_port
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from vsurge_operator import kube

# ------------------------------------------------------------------------------------------ operator


class OperatorProcess(LoggedProcess):
    """``python -m vsurge_operator`` in a subprocess, logged to a file, stopped with SIGTERM."""

    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        args: list[str],
        *,
        kopf_run: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.health_port = free_port()
        child_env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("KUBERNETES_", "OTEL_", "VSURGE_OPERATOR_"))
        }
        child_env["KUBECONFIG"] = str(kubeconfig)
        paths = [str(REPO / "operator"), str(REPO / "service"), child_env.get("PYTHONPATH", "")]
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        child_env.update(env or {})
        # `kopf run -m vsurge_operator.kopf_app` instead of `python -m vsurge_operator`
        entry = ["kopf", "run", "-m", "vsurge_operator.kopf_app"] if kopf_run else ["vsurge_operator"]
        cmd = [
            sys.executable,
            "-m",
            *entry,
            "--standalone",
            "--verbose",
            f"--liveness=http://127.0.0.1:{self.health_port}/healthz",
            *args,
        ]
        super().__init__(cmd, log_path, child_env)

    def start(self) -> OperatorProcess:
        super().start()
        self.wait_http(f"http://127.0.0.1:{self.health_port}/healthz", timeout=30)
        return self


# ------------------------------------------------------------------------------------------- kubelet


@dataclass
class MetricsBoard:
    """What every fake pod reports; the test moves these numbers."""

    occupancy: float = 0.0
    queue: float = 0.0
    silent: set[str] = field(default_factory=set)  # pod names that report nothing
    # the labels of vsurge_engine_info (what the pod's engine runs), as vsurge serve exports them
    engine: dict[str, str] = field(
        default_factory=lambda: {
            "driver": "vdriver",
            "attention": "dense (flat rows)",
            "decode_steps": "4",
            "backend": "tpu",
        }
    )


class _MetricsCollector:
    def __init__(self, board: MetricsBoard, model: str, pod: str) -> None:
        self.board, self.model, self.pod = board, model, pod

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.pod in self.board.silent:
            return
        occ = GaugeMetricFamily("vsurge_slot_occupancy", "Fraction of decode slots in use", labels=["model"])
        occ.add_metric([self.model], self.board.occupancy)
        queue = GaugeMetricFamily(
            "vsurge_prefill_queue_size", "Requests waiting for prefill", labels=["model"]
        )
        queue.add_metric([self.model], self.board.queue)
        names = sorted(self.board.engine)
        info = GaugeMetricFamily("vsurge_engine_info", "What the engine runs", labels=["model", *names])
        info.add_metric([self.model, *(self.board.engine[n] for n in names)], 1)
        yield occ
        yield queue
        yield info


class PodMetricsServer:
    """A real HTTP server on loopback exposing one pod's /metrics in the Prometheus text format."""

    def __init__(self, board: MetricsBoard, model: str, pod: str) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_MetricsCollector(board, model, pod))

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                payload = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeKubelet:
    """Plays the Deployment controller and the kubelet for one namespace.

    Every ``tick`` seconds it makes each Deployment's pod count match ``spec.replicas`` (pods are created
    through the API, each backed by a real metrics server whose port is the pod's ``metrics`` port), and
    reports the counts in the Deployment's status, all through the API like the real controllers.
    """

    def __init__(self, api: kube.Kube, namespace: str, board: MetricsBoard, tick: float = 0.1) -> None:
        self.api, self.namespace, self.board, self.tick = api, namespace, board, tick
        self.servers: dict[str, PodMetricsServer] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self.errors: list[BaseException] = []

    def start(self) -> FakeKubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for server in self.servers.values():
            server.close()
        self.servers.clear()

    def _loop(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                self.sync()
            except Exception as e:  # kept for the test to inspect; the loop must go on
                self.errors.append(e)

    def sync(self) -> None:
        for dep in self.api.list(kube.DEPLOYMENT, self.namespace):
            name = dep["metadata"]["name"]
            want = int(dep.get("spec", {}).get("replicas") or 0)
            template = dep["spec"]["template"]
            model = next(
                (
                    e["value"]
                    for e in template["spec"]["containers"][0].get("env", [])
                    if e["name"] == "VSURGE_SERVED_MODEL_NAME"
                ),
                name,
            )
            mine = sorted(p for p in self.servers if p.startswith(f"{name}-pod-"))
            for i in range(len(mine), want):
                self._add_pod(dep, f"{name}-pod-{i}", template, model)
            for pod in mine[want:]:
                self.api.delete(kube.POD, self.namespace, pod)
                self.servers.pop(pod).close()
            count = len([p for p in self.servers if p.startswith(f"{name}-pod-")])
            self.api.patch(
                kube.DEPLOYMENT,
                self.namespace,
                name,
                {
                    "status": {
                        "observedGeneration": dep["metadata"].get("generation", 1),
                        "replicas": count,
                        "readyReplicas": count,
                        "updatedReplicas": count,
                        "availableReplicas": count,
                    }
                },
                subresource="status",
            )

    def _add_pod(self, dep: dict[str, Any], pod: str, template: dict[str, Any], model: str) -> None:
        server = PodMetricsServer(self.board, model, pod)
        self.servers[pod] = server
        container = template["spec"]["containers"][0]
        self.api.create(
            kube.POD,
            self.namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod,
                    "namespace": self.namespace,
                    "labels": dict(template["metadata"]["labels"]),
                },
                "spec": {
                    "containers": [
                        {
                            "name": container["name"],
                            "image": container["image"],
                            "ports": [
                                {"name": "http", "containerPort": 11556},
                                {"name": "metrics", "containerPort": server.port},
                            ],
                        }
                    ]
                },
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            },
        )


# ------------------------------------------------------------------------------------------- helpers


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return {}


def inference_model(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    body_spec: dict[str, Any] = {
        "model": {"source": "default"},
        "image": "ghcr.io/vsurge-stack/vsurge-service:test",
    }
    body_spec.update(spec)
    return {
        "apiVersion": "vsurge.io/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body_spec,
    }


# The example InferenceModel of the issue that specified it: Llama 3 8B on one v5e 2x4 slice. The CRD and
# validation tests hold it valid, the end-to-end test checks the workload the operator builds from it.
_ISSUE_EXAMPLE: dict[str, Any] = {
    "model": {"source": "gs://bucket/llama-3-8b", "servedName": "llama-3-8b"},
    "engine": {
        "driver": "odriver",
        "maxConcurrentDecodes": 64,
        "maxLength": 4096,
        "prefillLengths": [256, 1024, 4096],
        "pageSize": 128,
        "hbmUtilization": 0.85,
        "dtype": "bfloat16",
    },
    "tpu": {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"},
}


def issue_example() -> dict[str, Any]:
    """The spec fields ``model``, ``engine`` and ``tpu`` of the issue's example (a fresh copy each call)."""
    return copy.deepcopy(_ISSUE_EXAMPLE)


DELETE = object()  # with_field's value that removes the field


def with_field(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``doc`` with the dotted ``path`` set to ``value`` (removed for ``DELETE``)."""
    doc = copy.deepcopy(doc)
    *parents, leaf = path.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return doc
