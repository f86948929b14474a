"""A pod whose `vsurge serve` cannot load its model makes the InferenceModel Degraded/ModelSourceError.

The termination message is the real one: `vsurge serve` runs with the container's environment as the
operator built it, fails on its model source, exits non-zero and writes its termination log; the test then
plays the kubelet, publishing that message in the pod's containerStatuses through KMock.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kmock_harness import wait_for
from operator_harness import condition

from vsurge_operator import kube, manifests

pytestmark = pytest.mark.timeout(180)

IM = "vsurge.io/v1alpha1/inferencemodels"


def _serve_with_pod_env(container: dict, tmp_path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VSURGE_")}
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    env.update(
        {"VSURGE_PORT": "0", "VSURGE_METRICS_PORT": "-1", "VSURGE_TERMINATION_LOG": str(tmp_path / "tlog")}
    )
    env["VSURGE_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run(
        [sys.executable, "-m", "vsurge.cli", "serve"], env=env, capture_output=True, text=True, timeout=120
    )
    return proc.returncode, (tmp_path / "tlog").read_text()


def _pod(name: str, labels: dict, message: str, ready: bool) -> dict:
    status = {
        "name": manifests.CONTAINER_NAME,
        "ready": ready,
        "restartCount": 3,
        "image": "x",
        "imageID": "",
    }
    if ready:
        status["state"] = {"running": {"startedAt": "2026-12-01T00:00:00Z"}}
    else:
        status["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
    status["lastState"] = {"terminated": {"exitCode": 1, "reason": "Error", "message": message}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": manifests.CONTAINER_NAME, "image": "x"}]},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": str(ready)}],
            "containerStatuses": [status],
        },
    }


def test_source_error_in_termination_message_degrades_the_model(
    cluster, namespace, api, create_model, start_operator, tmp_path
):
    start_operator()
    create_model("llama", model={"source": "pvc://weights/llama-3-8b"})
    dep = wait_for(lambda: cluster.obj("apps/v1/deployments", namespace, "llama"), 30, message="deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"

    code, message = _serve_with_pod_env(container, tmp_path)
    assert code == 1
    assert message.startswith("ModelSourceError: /mnt/models/llama-3-8b: no such file or directory"), message

    labels = dict(dep["spec"]["template"]["metadata"]["labels"])
    api.create(kube.POD, namespace, _pod("llama-abc12", labels, message, ready=False))
    api.create(
        kube.POD, namespace, _pod("other-model-pod", {"app": "other"}, "ModelSourceError: not ours", False)
    )

    def degraded():
        obj = cluster.obj(IM, namespace, "llama")
        c = condition(obj, "Degraded")
        return c if c.get("status") == "True" and c.get("reason") == "ModelSourceError" else None

    c = wait_for(degraded, 30, message="Degraded/ModelSourceError")
    assert c["message"] == "pod llama-abc12: /mnt/models/llama-3-8b: no such file or directory"
    events = wait_for(
        lambda: (
            [e for e in cluster.objects("events", namespace) if e.get("reason") == "ModelSourceError"] or None
        ),
        30,
        message="a ModelSourceError event",
    )
    assert "no such file or directory" in events[0]["message"] and events[0]["type"] == "Warning"

    # The pod recovers (the volume was fixed): Degraded clears on the next resync.
    api.patch(
        kube.POD,
        namespace,
        "llama-abc12",
        {"status": _pod("llama-abc12", labels, message, True)["status"]},
        subresource="status",
    )
    wait_for(
        lambda: condition(cluster.obj(IM, namespace, "llama"), "Degraded").get("status") == "False" or None,
        30,
        message="Degraded cleared",
    )
