"""LoRA adapters (spec.adapters) on a real API server: the example manifest is stored, CEL refuses duplicate
names, and the operator puts the adapters in the pods' `vsurge serve` flags and reports them in status.

The pod's server is a stand-in at the pod's IP on the model port (11556) answering `GET /v1/models` with
the adapters as model objects whose `parent` is the base, which is the contract of `vsurge serve --lora`
(tests/server/test_server_lora.py holds the real server to it); the kit runs no pods of its own.
"""

from __future__ import annotations

import copy
import http.server
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from clusterkit import IM, Kubelet, inference_model, next_pod_ip, start_operator, wait_for
from kubernetes.client.exceptions import ApiException

from vsurge_operator import kube, validation

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inferencemodel-lora.yaml"
DEPLOYMENT = kube.Resource("apps/v1", "deployments", "Deployment")


def _refusal(api: Any, namespace: str, doc: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(ApiException) as e:
        api.create(IM, namespace, doc)
    assert e.value.status == 422, e.value.body
    return json.loads(e.value.body)


def test_example_is_stored_and_cel_refuses_duplicate_adapter_names(k8s, namespace):
    api = k8s.kube()
    example = yaml.safe_load(EXAMPLE.read_text())
    assert validation.validate(example, default_image="img") == []  # the operator agrees with the server
    stored = api.create(IM, namespace, copy.deepcopy(example))
    assert [a["name"] for a in stored["spec"]["adapters"]] == ["sql", "support-bot", "summarize"]
    assert stored["spec"]["engine"]["maxLoras"] == 4

    dup = copy.deepcopy(example)
    dup["metadata"]["name"] = "dup"
    dup["spec"]["adapters"].append({"name": "sql", "source": "gs://b/other-sql"})
    status = _refusal(api, namespace, dup)
    assert "adapter names must be unique" in status["message"]
    assert any(c.get("field") == "spec.adapters" for c in status["details"]["causes"]), status

    shadow = copy.deepcopy(example)
    shadow["metadata"]["name"] = "shadow"
    shadow["spec"]["adapters"][0]["name"] = "llama-3-8b"  # the served name
    assert "differ from the model's served name" in _refusal(api, namespace, shadow)["message"]

    bad_source = copy.deepcopy(example)
    bad_source["metadata"]["name"] = "bad-source"
    bad_source["spec"]["adapters"][0]["source"] = "default"
    assert "spec.adapters[0].source" in _refusal(api, namespace, bad_source)["message"]


class _Models(http.server.BaseHTTPRequestHandler):
    """The pod: `GET /v1/models` as `vsurge serve --lora NAME=SOURCE` lists the base and its adapters."""

    served = "base"
    adapters: dict[str, str] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        if self.path != "/v1/models":
            self.send_error(404)
            return
        data = [{"id": self.served, "object": "model"}]
        data += [
            {"id": n, "object": "model", "parent": self.served, "root": s} for n, s in self.adapters.items()
        ]
        payload = json.dumps({"object": "list", "data": data}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


def _args(api: Any, namespace: str, name: str) -> list[str] | None:
    dep = api.get(DEPLOYMENT, namespace, name)
    return dep["spec"]["template"]["spec"]["containers"][0].get("args") if dep else None


def test_operator_passes_adapters_to_pods_and_reports_them(k8s, namespace, tmp_path):
    api = k8s.kube()
    ip = next_pod_ip()
    # Like the pod's server: the adapters it was started with (the operator's flags, read back below).
    handler = type("Pod", (_Models,), {"served": "base", "adapters": {}})
    server = http.server.ThreadingHTTPServer((ip, 11556), handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    kubelet = Kubelet(api, namespace, ip_for=lambda pod: ip).start()
    op = start_operator(
        k8s.kubeconfig,
        tmp_path / "operator.log",
        f"--namespace={namespace}",
        env={"VSURGE_OPERATOR_ADAPTER_STATUS_SECONDS": "0.5"},
    )
    try:
        adapters = [
            {"name": "sql", "source": "hf://org/sql-lora"},
            {"name": "chat", "source": "pvc://loras/chat"},
        ]
        api.create(
            IM,
            namespace,
            inference_model(
                "lora", namespace, model={"source": "default", "servedName": "base"}, adapters=adapters
            ),
        )
        args = wait_for(
            lambda: _args(api, namespace, "lora"), 30, message="the Deployment with adapter flags"
        )
        assert args == ["--lora", "sql=hf://org/sql-lora", "--lora", "chat=/mnt/adapters/loras/chat"]
        volumes = api.get(DEPLOYMENT, namespace, "lora")["spec"]["template"]["spec"]["volumes"]
        assert {
            "name": "adapters-0",
            "persistentVolumeClaim": {"claimName": "loras", "readOnly": True},
        } in volumes

        # The pod serves what its flags say; the status follows what the pod lists.
        handler.adapters = dict(a.split("=", 1) for a in args[1::2])

        def adapters_status():
            return ((api.get(IM, namespace, "lora") or {}).get("status") or {}).get("adapters")

        expected = [
            {"name": "sql", "loaded": True, "pods": 1, "inSpec": True},
            {"name": "chat", "loaded": True, "pods": 1, "inSpec": True},
        ]
        wait_for(lambda: adapters_status() == expected, 60, message=f"status.adapters == {expected}")

        # A new adapter in the spec changes the pod template (a rollout); until the pod serves it, the
        # status says so. One loaded at run time outside the spec shows as inSpec false.
        patched = [*adapters, {"name": "summarize", "source": "s3://bucket/summarize"}]
        api.patch(IM, namespace, "lora", {"spec": {"adapters": patched}})
        wait_for(
            lambda: (a := _args(api, namespace, "lora")) and "summarize=s3://bucket/summarize" in a,
            30,
            message="the new adapter in the pod template",
        )
        handler.adapters = {**handler.adapters, "runtime": "/tmp/runtime"}
        wait_for(
            lambda: (
                adapters_status()
                == [
                    *expected,
                    {"name": "summarize", "loaded": False, "pods": 0, "inSpec": True},
                    {"name": "runtime", "loaded": True, "pods": 1, "inSpec": False},
                ]
            ),
            60,
            message="status.adapters with summarize not loaded and runtime outside the spec",
        )
    finally:
        op.stop()
        kubelet.stop()
        server.shutdown()
        server.server_close()
