"""The router against KMock as the Kubernetes API: discovery by watch, and scale from zero.

The tests play the operator (and kubectl) through the API: they create InferenceModels, and after the
router sets `spec.replicas` to 1 through the scale subresource they report a ready replica in the status,
with `status.endpoint` pointing at a fake upstream on loopback.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
from kmock_harness import Fault, LoggedProcess, free_port
from patience import ceiling
from router_helpers import clean_env, inference_model, metric_value, vsurge_command, wait_for

IM = "vsurge.io/v1alpha1/inferencemodels"


def _chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def _resource():
    from vsurge_operator import kube

    return kube.INFERENCE_MODEL


def _model_ids(url: str) -> dict[str, bool]:
    return {m["id"]: m["ready"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}


def test_discovery_follows_inference_models_in_every_namespace(cluster, upstreams, start_router) -> None:
    a, b = upstreams("a"), upstreams("b")
    api = cluster.client()
    api.create(_resource(), "models", inference_model("llama", served="llama-chat", ready=1, endpoint=a.url))
    router = start_router(api_client=cluster.api_client(), kubernetes=True)
    wait_for(lambda: httpx.get(f"{router.url}/readiness", timeout=30).status_code == 200, what="router ready")
    assert _model_ids(router.url) == {"llama-chat": True}
    r = httpx.post(f"{router.url}/v1/chat/completions", json=_chat("llama-chat"), timeout=10)
    assert r.json()["choices"][0]["message"]["content"] == "hello from a"

    # Seen through the watch: a new model elsewhere, then its replica becoming ready.
    api.create(_resource(), "other", inference_model("qwen", namespace="other", replicas=1))
    wait_for(lambda: _model_ids(router.url).get("qwen") is False, what="qwen listed, not ready")
    api.patch(
        _resource(),
        "other",
        "qwen",
        {"status": {"readyReplicas": 1, "endpoint": f"{b.url}/"}},
        subresource="status",
    )
    wait_for(lambda: _model_ids(router.url).get("qwen"), what="qwen ready")
    r = httpx.post(f"{router.url}/v1/completions", json={"model": "qwen", "prompt": "x"}, timeout=10)
    assert r.json() == {"upstream": "b", "path": "/v1/completions", "model": "qwen"}

    api.delete(_resource(), "models", "llama")
    wait_for(lambda: "llama-chat" not in _model_ids(router.url), what="llama gone")
    r = httpx.post(f"{router.url}/v1/chat/completions", json=_chat("llama-chat"), timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert metric_value(router.metrics(), "vsurge_router_model_upstreams", model="qwen") == 1


def test_scale_from_zero_wakes_the_model_and_answers(cluster, upstreams, tmp_path: Path) -> None:
    """`vsurge route --namespace models` with a kubeconfig, as the chart runs it, and the openai client."""
    a = upstreams("a")
    api = cluster.client()
    api.create(_resource(), "models", inference_model("sleepy", replicas=0))
    port = free_port()
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    router = LoggedProcess(
        [
            *vsurge_command(),
            "route",
            "--host=127.0.0.1",
            f"--port={port}",
            "--namespace=models",
            "--wake-timeout-seconds=60",
        ],
        tmp_path / "router.log",
        clean_env(KUBECONFIG=str(kubeconfig)),
    ).start()
    try:
        router.wait_http(f"http://127.0.0.1:{port}/readiness", timeout=30)
        assert _model_ids(f"http://127.0.0.1:{port}") == {"sleepy": False}
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
        )
        answers: list[str] = []

        def ask() -> None:
            out = client.chat.completions.create(model="sleepy", messages=[{"role": "user", "content": "hi"}])
            answers.append(out.choices[0].message.content or "")

        started = time.monotonic()
        callers = [threading.Thread(target=ask) for _ in range(2)]
        for t in callers:
            t.start()
        # The router wakes the model through the scale subresource...
        wait_for(
            lambda: (cluster.obj(IM, "models", "sleepy") or {}).get("spec", {}).get("replicas") == 1,
            timeout=15,
            what="spec.replicas = 1",
        )
        patches = cluster.requests(method="PATCH", plural="inferencemodels", subresource="scale")
        assert len(patches) == 1  # two held requests, one patch
        assert patches[0].headers["Content-Type"] == "application/merge-patch+json"
        assert patches[0].data["spec"] == {"replicas": 1}
        # ...and holds both requests while no replica is ready.
        time.sleep(0.5)
        assert all(t.is_alive() for t in callers) and answers == []
        # The "operator" reports a ready replica; the router sees it through its watch and forwards.
        api.patch(
            _resource(),
            "models",
            "sleepy",
            {"status": {"readyReplicas": 1, "endpoint": a.url}},
            subresource="status",
        )
        for t in callers:
            t.join(30)
        assert answers == ["hello from a", "hello from a"]
        assert time.monotonic() - started >= 0.5
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        assert metric_value(text, "vsurge_router_wakeups_total", model="sleepy", outcome="ready") == 2
        assert metric_value(text, "vsurge_router_scale_patches_total", model="sleepy", outcome="ok") == 1
        assert metric_value(text, "vsurge_router_requests_total", model="sleepy", code="200") == 2
    except BaseException:
        print(f"----- router log -----\n{router.log()}")
        raise
    finally:
        router.stop()


def test_scale_from_zero_times_out_with_503_and_retry_after(cluster, start_router) -> None:
    api = cluster.client()
    api.create(_resource(), "models", inference_model("sleepy", replicas=0))
    router = start_router(
        api_client=cluster.api_client(),
        kubernetes=True,
        namespaces=("models",),
        wake_timeout_seconds=1.0,
        retry_after_seconds=3,
    )
    wait_for(lambda: httpx.get(f"{router.url}/readiness", timeout=30).status_code == 200, what="router ready")
    started = time.monotonic()
    r = httpx.post(f"{router.url}/v1/chat/completions", json=_chat("sleepy"), timeout=ceiling(10))
    elapsed = time.monotonic() - started
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "model_wake_timeout" and "after 1s" in r.json()["error"]["message"]
    assert 0.9 <= elapsed < ceiling(5)
    assert cluster.obj(IM, "models", "sleepy")["spec"]["replicas"] == 1  # it was woken, just not in time
    # The openai client sees the same answer as an InternalServerError.
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=10)
    try:
        client.chat.completions.create(model="sleepy", messages=[{"role": "user", "content": "hi"}])
    except openai.InternalServerError as e:
        assert e.status_code == 503
    else:
        raise AssertionError("expected a 503")
    assert (
        metric_value(router.metrics(), "vsurge_router_wakeups_total", model="sleepy", outcome="timeout") == 2
    )


def test_a_refused_scale_patch_fails_fast(cluster, start_router) -> None:
    api = cluster.client()
    api.create(_resource(), "models", inference_model("sleepy", replicas=0))
    cluster.emulator.faults.append(Fault("PATCH", "inferencemodels", 403, times=1, subresource="scale"))
    router = start_router(
        api_client=cluster.api_client(), kubernetes=True, namespaces=("models",), wake_timeout_seconds=600
    )
    wait_for(lambda: httpx.get(f"{router.url}/readiness", timeout=30).status_code == 200, what="router ready")
    started = time.monotonic()
    r = httpx.post(f"{router.url}/v1/chat/completions", json=_chat("sleepy"), timeout=ceiling(10))
    # at once, not at the 600 s wake timeout
    assert r.status_code == 503 and time.monotonic() - started < ceiling(5)
    assert r.json()["error"]["code"] == "model_wake_failed" and "403" in r.json()["error"]["message"]
    assert cluster.obj(IM, "models", "sleepy")["spec"]["replicas"] == 0
