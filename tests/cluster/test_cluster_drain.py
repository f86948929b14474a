"""Drains that finish: a long streaming generation survives the scale-down of its pod.

The kit has no kubelet, so the test plays the part of one for a single pod, with what the operator put in
the pod spec and nothing else: `vsurge serve` runs as PID 1 of a PID namespace of its own (`unshare`, as in a
container), with the pod's VSURGE_DRAIN_TIMEOUT, on the pod's IP. When the scale-down deletes the pod, the
test runs the pod's preStop command inside that namespace (`nsenter`), then sends SIGTERM to PID 1, and
SIGKILL only if terminationGracePeriodSeconds runs out, as a kubelet does. (Endpoints are not checked: the
API server refuses loopback addresses in an Endpoints object, so the kit's endpoints controller cannot list
a 127.0.0.X pod; in a cluster it drops a pod from its Service as soon as the pod is terminating or unready,
which the readiness answer checked here gives the kubelet's probe.)

The generation is held in flight deterministically: the client stops reading after the first chunk, and the
answer (8 choices x 960 tokens with 20 top logprobs each: 12.5 MB) cannot fit the socket buffers (at most
4 MB of send buffer on Linux, and a receive window that stops growing when nobody reads), so the server's
send waits until the client reads on; the test checks the request is still counted in flight. Needs root (PID namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from clusterkit import (
    IM,
    REPO,
    Kubelet,
    clean_env,
    ensure_node,
    inference_model,
    next_pod_ip,
    start_operator,
    vsurge_command,
    wait_for,
)
from kmock_harness import LoggedProcess
from kubernetes.client.exceptions import ApiException

from vsurge_operator import kube, rollout

pytestmark = pytest.mark.timeout(420)

DRAIN_SECONDS = 60
LONG = {
    "n": 8,
    "max_tokens": 960,
    "logprobs": True,
    "top_logprobs": 20,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a PID namespace (unshare --pid), as a container runtime makes"
    for tool in ("unshare", "nsenter"):
        if not shutil.which(tool):
            return f"{tool} (util-linux) is not installed"
    return None


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


class Container:
    """`vsurge serve` as PID 1 of its own PID namespace (under `unshare --pid --fork`)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.proc = LoggedProcess(
            ["unshare", "--pid", "--fork", "--kill-child", "--", *args], log, env
        ).start()
        assert self.proc.proc is not None
        self.pid1 = wait_for(lambda: (_children(self.proc.proc.pid) or [None])[0], 30, message="PID 1")

    def exec(self, command: list[str]) -> subprocess.CompletedProcess[str]:
        """An exec hook: the command inside the container's PID namespace ("python" is the image's Python)."""
        argv = [sys.executable if command[0] == "python" else command[0], *command[1:]]
        return subprocess.run(
            ["nsenter", f"--target={self.pid1}", "--pid", "--", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def signal(self, sig: int) -> None:
        os.kill(self.pid1, sig)

    def exited(self) -> int | None:
        return self.proc.proc.poll() if self.proc.proc else None


def _ready(url: str) -> int:
    try:
        return httpx.get(f"{url}/readiness", timeout=30).status_code
    except httpx.HTTPError:
        return 0


def _short(url: str) -> httpx.Response:
    body = {"model": "drain", "prompt": "hi", "max_tokens": 2}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_a_long_stream_survives_the_scale_down_of_its_pod(k8s, namespace, tmp_path):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    api = k8s.kube()
    ip = next_pod_ip()
    # The scheduler's part: the kubelet stand-in binds the pod to a Ready Node (the API server deletes an
    # unscheduled pod at once, with no grace period; a bound one waits for its kubelet; and a pod bound to a
    # Node that does not exist is force-deleted by the pod-GC controller about a minute later).
    node = f"node-{namespace}"
    ensure_node(api, node)
    kubelet = Kubelet(api, namespace, ip_for=lambda pod: ip, node=node).start()
    operator = start_operator(k8s.kubeconfig, tmp_path / "operator.log", f"--namespace={namespace}")
    container: Container | None = None
    try:
        api.create(IM, namespace, inference_model("drain", namespace, replicas=1, drainSeconds=DRAIN_SECONDS))
        (pod,) = wait_for(
            lambda: [
                p for p in api.list(kube.POD, namespace, "vsurge.io/model=drain") if p["spec"].get("nodeName")
            ],
            60,
            message="pod bound to the node",
        )
        spec = pod["spec"]
        (c,) = spec["containers"]
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        grace = spec["terminationGracePeriodSeconds"]
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert env["VSURGE_DRAIN_TIMEOUT"] == str(DRAIN_SECONDS)
        assert grace == rollout.PRESTOP_SECONDS + DRAIN_SECONDS + rollout.DRAIN_MARGIN_SECONDS

        sys.path.insert(0, str(REPO / "tests" / "service"))
        from tiny_models import make_checkpoint

        model_dir = tmp_path / "tiny"
        make_checkpoint(model_dir, "llama", seed=0)
        child_env = clean_env(JAX_PLATFORMS="cpu", VSURGE_DRAIN_TIMEOUT=env["VSURGE_DRAIN_TIMEOUT"])
        child_env.pop("XLA_FLAGS", None)
        args = [
            *vsurge_command(),
            "serve",
            f"--model={model_dir}",
            "--served-model-name=drain",
            f"--host={ip}",  # the pod's IP (the pod spec's 0.0.0.0 would take these ports on every IP)
            "--port=11556",
            "--metrics-port=11557",
            "--max-length=1024",
            "--prefill-lengths=16,32",
            "--max-concurrent-decodes=8",
        ]
        container = Container(args, child_env, tmp_path / "serve.log")
        url = f"http://{ip}:11556"
        container.proc.wait_http(f"{url}/readiness", timeout=300)

        # The long stream: read its first chunk, then hold it in flight.
        body = {"model": "drain", "messages": [{"role": "user", "content": "Tell a long story."}], **LONG}
        client = httpx.Client(timeout=httpx.Timeout(30, read=300))
        stream_cm = client.stream("POST", f"{url}/v1/chat/completions", json=body)
        response = stream_cm.__enter__()
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))

        # The scale-down (the router or the autoscaler at zero): the ReplicaSet controller deletes the pod.
        api.patch(IM, namespace, "drain", {"spec": {"replicas": 0}}, subresource="scale")
        deleted = wait_for(
            lambda: (
                (p := api.get(kube.POD, namespace, pod["metadata"]["name"]))
                and p["metadata"].get("deletionTimestamp")
                and p
            ),
            # the operator, the deployment and ReplicaSet controllers in turn (a ceiling, not a wait; the
            # one run that passed 60 s here most likely lost its pod to pod-GC, before the Node existed)
            180,
            message="pod marked for deletion",
        )
        assert deleted["metadata"]["deletionGracePeriodSeconds"] == grace
        t_delete = time.monotonic()

        # preStop: runs to its end before SIGTERM; meanwhile the pod turns unready but still serves.
        hook: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: hook.update(result=container.exec(pre_stop)))
        runner.start()
        wait_for(lambda: _ready(url) == 503, 30, message="readiness 503 after the preStop's signal")
        assert _short(url).status_code == 200  # a request that still lands during the hook is served
        runner.join(60)
        assert hook["result"].returncode == 0, hook["result"].stderr

        # SIGTERM: the drain. New work is refused, the held stream keeps the process alive.
        container.signal(signal.SIGTERM)
        t_term = time.monotonic()
        wait_for(lambda: _short(url).status_code == 503, 30, message="new requests refused while draining")
        metrics = httpx.get(f"http://{ip}:11557/metrics", timeout=10).text
        in_flight = [ln for ln in metrics.splitlines() if ln.startswith("vsurge_http_requests_in_flight ")]
        assert in_flight and float(in_flight[0].split()[1]) >= 1, in_flight  # the stream is still in flight
        assert container.exited() is None

        # The client reads on: every token of every choice arrives, and the stream ends properly.
        chunks = [json.loads(first[6:])]
        done = False
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
        stream_cm.__exit__(None, None, None)
        client.close()
        assert done
        finish = {
            c["index"]: c["finish_reason"] for ch in chunks for c in ch["choices"] if c.get("finish_reason")
        }
        assert finish == {i: "length" for i in range(LONG["n"])}
        usage = next((ch["usage"] for ch in reversed(chunks) if ch.get("usage")), None)
        if usage is not None:
            assert usage["completion_tokens"] == LONG["n"] * LONG["max_tokens"]

        # The drain completes: exit 0, well inside the grace period; the kubelet then removes the pod.
        wait_for(lambda: container.exited() is not None, grace, message="server exited after the drain")
        assert container.exited() == 0, container.proc.log()[-3000:]
        t_exit = time.monotonic()
        assert t_exit - t_delete < grace
        api.request(  # the kubelet's last word: the containers are gone, the pod object goes
            "DELETE",
            f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}",
            {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
        )
        print(
            f"drain: deletion -> SIGTERM {t_term - t_delete:.1f} s (preStop), SIGTERM -> exit "
            f"{t_exit - t_term:.1f} s, grace period {grace} s"
        )
    finally:
        if container is not None and container.exited() is None:
            container.proc.stop()
        operator.stop()
        kubelet.stop()
        try:
            api.request("DELETE", f"/api/v1/nodes/{node}")
        except ApiException as e:
            if e.status != 404:
                raise
