"""A model's own API key (spec.apiKeySecret, router/upstream_keys.py) and the prefix index forgetting pods
that left (policies.ForgetGonePods).

The key: KMock serves the InferenceModel and its Secret; the router reads the Secret by name and sends
`Authorization: Bearer <the model's key>` to the pods, on its own port (in place of the client's header, or
of a tenant's key) and from its endpoint picker (the header set in the ext_proc answer). The pods are
FakeUpstreams that record the headers they got.
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import yaml
from kmock_harness import free_port
from router_helpers import inference_model, load_report, wait_for
from test_router_extproc import Proxy

from vsurge.router.prefix import request_hashes

MODEL_KEY = "sk-model-llama-0123456789abcdef"
TENANT_KEY = "sk-tenant-0123456789abcdef"


def _secret(name: str, key: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": "models"},
        "data": {"api-key": base64.b64encode(key.encode()).decode()},
    }


def test_the_router_sends_the_models_own_key(cluster, upstreams, start_router, tmp_path: Path) -> None:
    from vsurge_operator import kube

    pod = upstreams("a")
    api = cluster.client()
    api.create(kube.SECRET, "models", _secret("llama-key", MODEL_KEY))
    im = inference_model("llama", ready=1, endpoint=pod.url)
    im["spec"]["apiKeySecret"] = {"name": "llama-key"}
    api.create(kube.INFERENCE_MODEL, "models", im)
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"tenants": [{"name": "t", "keys": [TENANT_KEY]}]}))
    port = free_port()
    router = start_router(
        api_client=cluster.api_client(), kubernetes=True, api_keys_file=str(keys), ext_proc_port=port
    )
    headers = {"Authorization": f"Bearer {TENANT_KEY}"}
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}

    def answered() -> bool:
        r = httpx.post(f"{router.url}/v1/chat/completions", json=body, headers=headers, timeout=10)
        return (
            r.status_code == 200 and pod.requests[-1]["headers"].get("authorization") == f"Bearer {MODEL_KEY}"
        )

    # the Secret is read once the model is known; until then the pod gets no key at all (never the tenant's)
    wait_for(answered, timeout=15, what="the model's key sent to the pod")
    assert all(r["headers"].get("authorization") in (None, f"Bearer {MODEL_KEY}") for r in pod.requests)

    # the endpoint picker puts the same key on the request it routes
    proxy = Proxy(port)
    try:
        picked = proxy.pick(body, headers={"authorization": f"Bearer {TENANT_KEY}"})
    finally:
        proxy.close()
    assert picked["status"] == 200
    assert picked["headers"]["authorization"] == f"Bearer {MODEL_KEY}"
    assert picked["endpoints"][0] == pod.url.split("://", 1)[1]


def test_prefix_index_forgets_a_pod_when_its_endpoint_goes(upstreams, start_router, tmp_path: Path) -> None:
    pods = [upstreams(f"p{i}", load=load_report(driver="odriver", model="alpha")) for i in range(2)]
    config = tmp_path / "static.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": "alpha", "upstreams": [p.url for p in pods]}]}))
    router = start_router(
        static_config=str(config), kubernetes=False, static_reload_seconds=0.1, load_poll_seconds=0.05
    )
    picker = router.app.state.router.forwarder.picker
    body = {
        "model": "alpha",
        "messages": [{"role": "system", "content": "Be brief. " * 200}, {"role": "user", "content": "hi"}],
    }
    hashes = request_hashes("/v1/chat/completions", body, "alpha", 256)

    def indexed() -> set[str]:
        return {p for h in hashes for p in picker.index("alpha").get(h)}

    wait_for(lambda: picker.policy_for("alpha", [p.url for p in pods]) == "prefix", what="odriver reports")
    for _ in range(3):
        assert httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=10).status_code == 200
    (holder,) = indexed()
    # the pod that holds the prompt leaves (its endpoint goes from the model's list)
    config.write_text(
        yaml.safe_dump({"models": [{"name": "alpha", "upstreams": [p.url for p in pods if p.url != holder]}]})
    )
    wait_for(lambda: holder not in indexed(), timeout=10, what="the index forgets the pod")
    assert indexed() == set()


def test_the_endpoint_picker_wakes_a_model_at_zero(cluster, start_router) -> None:
    """Scale from zero in gateway mode: no ready pod is an immediate 503 with Retry-After (the proxy does
    not hold the request), and the model's scale goes to 1 (once), so the client's retry finds a pod."""
    from vsurge_operator import kube

    api = cluster.client()
    api.create(kube.INFERENCE_MODEL, "models", inference_model("sleepy", replicas=0))
    port = free_port()
    router = start_router(api_client=cluster.api_client(), kubernetes=True, ext_proc_port=port)
    wait_for(lambda: httpx.get(f"{router.url}/readiness", timeout=30).status_code == 200, what="router ready")
    proxy = Proxy(port)
    try:
        for _ in range(3):
            answer = proxy.pick({"model": "sleepy", "messages": [{"role": "user", "content": "hi"}]})
            assert answer["status"] == 503 and answer["body"]["error"]["code"] == "no_upstreams"
    finally:
        proxy.close()
    im = "vsurge.io/v1alpha1/inferencemodels"
    wait_for(lambda: (cluster.obj(im, "models", "sleepy") or {})["spec"].get("replicas") == 1, what="woken")
    patches = cluster.requests(method="PATCH", plural="inferencemodels", subresource="scale")
    assert len(patches) == 1
