"""EndpointSlices -> the ready pods of each model's Service, and how the table resolves a model's upstreams
(pods once a slice of its Service is known, else the Service URL), aliases included (pure)."""

from __future__ import annotations

from typing import Any

from vsurge.router.slices import slice_group, slice_pods
from vsurge.router.table import Backend, EndpointTable, ServiceRef

REF = ServiceRef("models", "llama")
SERVICE_URL = "http://llama.models.svc.cluster.local:11556"


def _slice(endpoints: list[dict[str, Any]], *, port: int | None = 11556, address_type: str = "IPv4") -> dict:
    return {
        "addressType": address_type,
        "metadata": {
            "name": "llama-abc12",
            "namespace": "models",
            "labels": {"kubernetes.io/service-name": "llama", "vsurge.io/model": "llama"},
        },
        "ports": [{"name": "metrics", "port": 11557}] + ([{"name": "http", "port": port}] if port else []),
        "endpoints": endpoints,
    }


def test_ready_endpoints_become_pod_urls() -> None:
    eps = [
        {"addresses": ["10.0.0.7"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.8", "10.0.0.9"], "conditions": {}},  # unset: the API says read it as ready
        {"addresses": ["10.0.0.10"], "conditions": {"ready": False}},  # unready (preStop announced)
        {"addresses": ["10.0.0.11"], "conditions": {"ready": True, "terminating": True}},
        {"addresses": [], "conditions": {"ready": True}},
        {"addresses": ["not-an-ip"]},
    ]
    assert slice_pods(_slice(eps)) == (REF, ("http://10.0.0.7:11556", "http://10.0.0.8:11556"))
    assert slice_pods(_slice([{"addresses": ["fd00::5"]}], address_type="IPv6")) == (
        REF,
        ("http://[fd00::5]:11556",),
    )
    assert slice_pods(_slice([{"addresses": ["pod.example"]}], address_type="FQDN"))[1] == (
        "http://pod.example:11556",
    )
    assert slice_pods(_slice(eps, port=None)) == (REF, ())  # no `http` port: nothing to send to
    assert slice_pods(_slice(None)) == (REF, ())  # the controller's empty slice
    unnamed = _slice(eps)
    del unnamed["metadata"]["labels"]["kubernetes.io/service-name"]
    assert slice_pods(unnamed) is None
    assert slice_group("models") == "slices:models" and slice_group(None) == "slices:*"


def _table() -> EndpointTable:
    t = EndpointTable()
    t.replace_group(
        "k8s:models",
        [Backend("llama", (SERVICE_URL,), key="k8s/models/llama", group="k8s:models", service=REF)],
    )
    return t


def test_a_model_uses_its_pods_once_a_slice_of_its_service_is_known() -> None:
    t = _table()
    assert t.lookup("llama").upstreams == (SERVICE_URL,)  # slices not listed yet: the Service
    t.replace_slices("slices:models", "models", {})
    assert t.lookup("llama").upstreams == (SERVICE_URL,)  # listed, but no slice of this Service
    t.upsert_slice("slices:models", "models/llama-a", REF, ("http://10.0.0.7:11556",))
    t.upsert_slice("slices:models", "models/llama-b", REF, ("http://10.0.0.8:11556", "http://10.0.0.7:11556"))
    assert t.lookup("llama").upstreams == ("http://10.0.0.7:11556", "http://10.0.0.8:11556")
    version = t.version
    t.upsert_slice("slices:models", "models/llama-a", REF, ("http://10.0.0.7:11556",))  # no change, no event
    assert t.version == version
    t.upsert_slice("slices:models", "models/llama-a", REF, ())
    t.upsert_slice("slices:models", "models/llama-b", REF, ())
    assert t.lookup("llama").upstreams == ()  # every pod unready: not ready (scale from zero waits)
    t.remove_slice("slices:models", "models/llama-b")
    t.upsert_slice("slices:models", "models/llama-a", REF, ("http://10.0.0.9:11556",))
    assert t.lookup("llama").upstreams == ("http://10.0.0.9:11556",)
    # A watch of another namespace says nothing about this Service; a cluster-wide one does.
    other = _table()
    other.replace_slices("slices:elsewhere", "elsewhere", {"x/y": (REF, ("http://1.1.1.1:1",))})
    assert other.lookup("llama").upstreams == (SERVICE_URL,)
    other.replace_slices("slices:*", None, {"models/llama-a": (REF, ("http://10.0.0.7:11556",))})
    assert other.lookup("llama").upstreams == ("http://10.0.0.7:11556",)
    # Forbidden later: back to the Service.
    t.forget_slices("slices:models")
    assert t.lookup("llama").upstreams == (SERVICE_URL,)


def test_an_alias_is_served_by_its_base_models_pods() -> None:
    t = _table()
    t.replace_slices("slices:models", "models", {"models/llama-a": (REF, ("http://10.0.0.7:11556",))})
    assert t.lookup("sql-adapter") is None
    t.set_aliases("lora", {"sql-adapter": "llama", "loop": "loop"})
    view = t.lookup("sql-adapter")
    assert (view.name, view.base, view.upstreams) == ("sql-adapter", "llama", ("http://10.0.0.7:11556",))
    assert t.lookup("loop") is None  # an alias of itself resolves to nothing
    assert [v.name for v in t.models()] == ["llama"]
