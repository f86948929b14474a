"""The router's discovery against the real list + watch API of InferenceModels.

`vsurge route --watch-timeout-seconds=1`: the server ends every watch after a second (kube-apiserver's
timeoutSeconds, counted by its own apiserver_request_total), the router relists and watches again from the
list's resourceVersion. Models are created, made ready, changed and deleted all the while, across many
of those ends; the router's /v1/models must equal the truth every time, and requests reach the model's
upstream (the router suite's FakeUpstream on loopback: this test is about discovery, the autoscaler test
serves a real `vsurge serve`). The test plays the operator: it writes status.readyReplicas and
status.endpoint through the status subresource.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx
from clusterkit import IM, clean_env, inference_model, vsurge_command, wait_for
from kmock_harness import LoggedProcess, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from router_helpers import FakeUpstream, ThreadedServer  # noqa: E402


def _completed_watches(k8s) -> int:
    """Namespaced WATCH requests of inferencemodels the CRD server (0.36, which serves them) has completed."""
    import kubernetes

    ext = kubernetes.config.new_client_from_config(config_file=k8s.env["K8SKIT_EXT_KUBECONFIG"])
    text = (
        ext.call_api("GET", ext.configuration.host + "/metrics", header_params={"Accept": "text/plain"})
        .read()
        .decode()
    )
    total = 0
    for line in text.splitlines():
        ours = line.startswith("apiserver_request_total{") and 'resource="inferencemodels"' in line
        if ours and 'verb="WATCH"' in line and 'scope="namespace"' in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def _models(url: str) -> dict[str, bool] | None:
    try:
        return {m["id"]: m.get("ready") for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def _ask(url: str, model: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello"}, timeout=20)
    assert r.status_code == 200, r.text
    return r.json()


def test_discovery_survives_watches_the_server_ends(k8s, namespace, tmp_path):
    api = k8s.kube()
    upstream = FakeUpstream("first")
    upstream.server = ThreadedServer(upstream.app()).start()

    def ready(name: str, endpoint: str) -> None:
        api.patch(
            IM, namespace, name, {"status": {"readyReplicas": 1, "endpoint": endpoint}}, subresource="status"
        )

    api.create(
        IM,
        namespace,
        inference_model("first", namespace, model={"source": "default", "servedName": "first-model"}),
    )
    ready("first", upstream.url)
    port = free_port()
    router = LoggedProcess(
        [
            *vsurge_command(),
            "route",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--namespace={namespace}",
            "--watch-timeout-seconds=1",
            "--log-level=info",
        ],
        tmp_path / "router.log",
        clean_env(KUBECONFIG=str(k8s.kubeconfig)),
    ).start()
    url = f"http://127.0.0.1:{port}"
    try:
        router.wait_http(f"{url}/readiness", timeout=60)
        wait_for(lambda: _models(url) == {"first-model": True}, 20, message="listed at start")
        assert _ask(url, "first-model")["upstream"] == "first"

        watches_before = _completed_watches(k8s)
        truth = {"first": ["first-model", True]}  # InferenceModel -> [served name, ready]
        started = time.monotonic()
        # Changes spread over ~7 watch lifetimes: some land mid-watch, some while the router relists.
        for i in range(14):
            name = f"m{i}"
            api.create(
                IM,
                namespace,
                inference_model(name, namespace, model={"source": "default", "servedName": f"served-{i}"}),
            )
            truth[name] = [f"served-{i}", False]
            if i % 3 == 1:
                ready(name, f"http://127.0.0.{100 + i}:11556")
                truth[name][1] = True
            if i % 4 == 3:
                api.delete(IM, namespace, f"m{i - 2}")
                truth.pop(f"m{i - 2}")
            if i % 5 == 4:
                api.patch(IM, namespace, name, {"spec": {"model": {"servedName": f"renamed-{i}"}}})
                truth[name][0] = f"renamed-{i}"
            time.sleep(0.5)
        expected = {served: ready_ for served, ready_ in truth.values()}
        wait_for(lambda: _models(url) == expected, 20, message=f"router's models == {expected}")
        elapsed = time.monotonic() - started
        # The server ended the router's watches (completed WATCH requests, by the server's own count).
        ended = _completed_watches(k8s) - watches_before
        assert ended >= int(elapsed) // 2, (ended, elapsed)
        # Still right after a few more server-side ends, and still routing to the real server.
        time.sleep(2.5)
        assert _models(url) == expected
        assert _ask(url, "first-model")["upstream"] == "first"
        assert len(upstream.requests) == 2
        assert router.proc.poll() is None
        assert not re.search(r"Traceback|ERROR", router.log()), router.log()[-3000:]
    finally:
        router.stop()
        upstream.server.stop()
