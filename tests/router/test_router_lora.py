"""LoRA adapters in the router: routed by name to the model whose pods serve them, pods that have the
adapter preferred within the load bound, and listed by /v1/models.

The pods are FakeUpstreams on loopback that speak the server's adapter contract (`GET /v1/models` lists each
adapter with `parent` = the base; `vllm:lora_requests_info` on /metrics), a stand-in for
`vsurge serve --lora` until the server's adapter support is on this branch.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import httpx
import pytest
import yaml
from router_helpers import inference_model, metric_value, wait_for

from vsurge.router import kube, static
from vsurge.router.lora import (
    PodAdapters,
    adapter_candidates,
    metrics_urls,
    parse_lora_info,
    parse_models,
)
from vsurge.router.table import EndpointTable

FAST = {"load_poll_seconds": 0.05, "lora_poll_seconds": 0.05}


# ---------------------------------------------------------------------------------------------- pure


def test_parse_lora_info_takes_the_newest_sample() -> None:
    text = (
        "# HELP vllm:lora_requests_info LoRA adapters\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="8",running_lora_adapters="old",waiting_lora_adapters=""} 1.0e9\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="x"} 1.7e9\n'
        'vllm:num_requests_waiting{model_name="llama"} 3.0\n'
    )
    assert parse_lora_info(text) == (frozenset({"sql", "chat"}), frozenset({"x"}), 4)
    assert parse_lora_info('vllm:num_requests_waiting{model_name="m"} 1\n') is None
    assert parse_lora_info("") is None
    empty = 'vllm:lora_requests_info{max_lora="8",running_lora_adapters="",waiting_lora_adapters=""} 5\n'
    assert parse_lora_info(empty) == (frozenset(), frozenset(), 8)


def test_parse_models_keeps_model_objects_with_a_parent() -> None:
    body = {
        "object": "list",
        "data": [
            {"id": "llama", "object": "model"},
            {"id": "sql", "object": "model", "parent": "llama", "root": "hf://o/sql"},
            {"id": 1, "parent": "llama"},
            "junk",
        ],
    }
    assert parse_models(body) == {"sql": "llama"}
    assert parse_models({"object": "list", "data": []}) == {}
    assert parse_models({"detail": "Not Found"}) is None


def test_metrics_urls() -> None:
    assert metrics_urls("http://10.0.0.7:11556") == [
        "http://10.0.0.7:11556/metrics",
        "http://10.0.0.7:11557/metrics",
    ]
    assert metrics_urls("http://[fd00::1]:8000") == [
        "http://[fd00::1]:8000/metrics",
        "http://[fd00::1]:8001/metrics",
    ]
    assert metrics_urls("http://llama.models.svc") == ["http://llama.models.svc/metrics"]


def _pods(**reports: PodAdapters) -> dict[str, PodAdapters]:
    return dict(reports)


def test_adapter_candidates_prefers_in_use_then_listed_with_room() -> None:
    pods = _pods(
        a=PodAdapters(0, frozenset({"sql"}), running=frozenset({"sql"}), max_lora=2),
        b=PodAdapters(0, frozenset({"sql"}), max_lora=2),
        c=PodAdapters(0, frozenset({"sql"}), running=frozenset({"x", "y"}), max_lora=2),  # no free slot
        d=PodAdapters(0, frozenset()),
    )
    idle = {"a": 0, "b": 0, "c": 0, "d": 0}
    assert adapter_candidates("sql", ["a", "b", "c", "d"], pods, idle, 0.25) == (["a"], "in_use")
    assert adapter_candidates("sql", ["b", "c", "d"], pods, idle, 0.25) == (["b"], "listed")
    assert adapter_candidates("sql", ["c", "d"], pods, idle, 0.25) == (["c"], "listed")
    assert adapter_candidates("sql", ["d"], pods, idle, 0.25) == (["d"], "any")
    # a waiting request counts as in use too
    waiting = _pods(b=PodAdapters(0, frozenset({"sql"}), waiting=frozenset({"sql"})), a=pods["b"])
    assert adapter_candidates("sql", ["a", "b"], waiting, {"a": 0, "b": 0}, 0.25) == (["b"], "in_use")


def test_adapter_candidates_never_exceed_the_load_bound() -> None:
    pods = _pods(
        a=PodAdapters(0, frozenset({"sql"}), running=frozenset({"sql"})),
        b=PodAdapters(0, frozenset({"sql"})),
        c=PodAdapters(0, frozenset()),
    )
    # a holds 5 of 6 requests: bound ceil(1.25 * 7 / 3) = 3, so a is over it and b (listed) takes the request.
    assert adapter_candidates("sql", ["a", "b", "c"], pods, {"a": 5, "b": 1, "c": 0}, 0.25) == (
        ["b"],
        "listed",
    )
    # Both holders over the bound: every candidate, the policy picks (the bounded-load fallback).
    assert adapter_candidates("sql", ["a", "b", "c"], pods, {"a": 5, "b": 5, "c": 0}, 0.25) == (
        ["a", "b", "c"],
        "any",
    )


# ---------------------------------------------------------------------------------------------- sources


def test_inference_model_adapters_become_aliases_of_its_served_name() -> None:
    obj = inference_model("llama-a", served="llama")
    obj["spec"]["adapters"] = [
        {"name": "sql", "source": "hf://o/sql"},
        {"name": "llama", "source": "hf://o/x"},  # its own served name: not an alias
    ]
    assert kube.aliases_from_object(obj) == {"sql": "llama"}
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert kube.aliases_from_object(obj) == {}
    merged = kube.merge_aliases({"k8s/b/m2": {"sql": "other"}, "k8s/a/m1": {"sql": "llama", "chat": "llama"}})
    assert merged == {"sql": "llama", "chat": "llama"}  # the first key wins a name two models claim


def test_static_adapters_parse_and_are_checked() -> None:
    models = static.parse_static_config(
        {"models": [{"name": "llama", "upstreams": ["http://10.0.0.7:11556"], "adapters": ["sql", "chat"]}]}
    )
    assert static.aliases_of(models) == {"sql": "llama", "chat": "llama"}
    bad = [
        ({"models": [{"name": "m", "upstreams": [], "adapters": "sql"}]}, "expected a list of adapter names"),
        (
            {"models": [{"name": "m", "upstreams": [], "adapters": ["m2"]}, {"name": "m2"}]},
            "a model has that name",
        ),
        (
            {"models": [{"name": "m", "adapters": ["a"]}, {"name": "n", "adapters": ["a"]}]},
            "listed by m and n",
        ),
    ]
    for doc, message in bad:
        with pytest.raises(static.StaticConfigError, match=message):
            static.parse_static_config(doc)


def test_table_lists_adapters_of_known_models_only() -> None:
    from vsurge.router.table import Backend

    t = EndpointTable()
    t.replace_group(
        "static", [Backend("llama", ("http://10.0.0.7:11556",), key="static/llama", group="static")]
    )
    t.set_aliases("static", {"sql": "llama", "orphan": "nobody"})
    assert [(v.name, v.base) for v in t.adapters()] == [("sql", "llama")]
    assert [v.name for v in t.models()] == ["llama"]


# ---------------------------------------------------------------------------------------------- e2e


def _start(start_router, tmp_path, models: list[dict[str, Any]], **config: Any):
    path = tmp_path / "static-lora.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return start_router(static_config=str(path), kubernetes=False, routing="least-load", **{**FAST, **config})


def _adapter_polls(router, at_least: int) -> None:
    # The poller has no counter of its own: wait until /v1/models shows what the pods listed.
    def listed() -> bool:
        ids = {m["id"] for m in httpx.get(f"{router.url}/v1/models", timeout=30).json()["data"]}
        return len(ids) >= at_least

    wait_for(listed, what=f"{at_least} models and adapters listed")


def _served_by(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"].removeprefix("hello from ")


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def test_requests_for_an_adapter_go_to_the_pod_that_runs_it(upstreams, start_router, tmp_path) -> None:
    hot = upstreams("hot", adapters=["sql", "chat"], lora_info=(["sql"], [], 4))
    warm = upstreams("warm", adapters=["sql", "chat"], lora_info=([], [], 4))
    bare = upstreams("bare", adapters=[], lora_info=([], [], 4))
    router = _start(
        start_router,
        tmp_path,
        [{"name": "alpha", "upstreams": [hot.url, warm.url, bare.url], "adapters": ["sql", "chat"]}],
    )
    # The pods' adapters are read (the gauge too): "chat" is listed by hot and warm, in use on neither.
    _adapter_polls(router, 3)
    with httpx.Client(base_url=router.url, timeout=10) as http:
        wait_for(
            lambda: _served_by(http.post("/v1/chat/completions", json=_chat("sql"))) == "hot", what="in use"
        )
        got = Counter(_served_by(http.post("/v1/chat/completions", json=_chat("sql"))) for _ in range(6))
        assert got == {"hot": 6}
        # "chat" is in no pod's bank: the pods that list it share it, the bare pod gets none.
        got = Counter(_served_by(http.post("/v1/chat/completions", json=_chat("chat"))) for _ in range(6))
        assert set(got) <= {"hot", "warm"} and sum(got.values()) == 6
        # The request keeps the adapter's name as its model, for the pod to pick the adapter.
        assert hot.requests[-1]["body"]["model"] in ("sql", "chat")
        # The base model itself is routed as always (every pod).
        got = Counter(_served_by(http.post("/v1/chat/completions", json=_chat("alpha"))) for _ in range(9))
        assert set(got) == {"hot", "warm", "bare"}
        unknown = http.post("/v1/chat/completions", json=_chat("nope"))
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    text = router.metrics()
    assert metric_value(text, "vsurge_router_adapter_picks_total", model="sql", how="in_use") >= 6
    assert metric_value(text, "vsurge_router_adapter_picks_total", model="chat", how="listed") == 6
    assert metric_value(text, "vsurge_router_adapter_picks_total", model="alpha", how="any") == 0
    # Requests are counted per adapter (the model label takes the adapter's name), apart from the base.
    assert metric_value(text, "vsurge_router_requests_total", model="chat", code="200") == 6
    assert metric_value(text, "vsurge_router_requests_total", model="alpha", code="200") == 9


def test_adapter_affinity_yields_to_the_load_bound(upstreams, start_router, tmp_path) -> None:
    gate = threading.Event()
    gate.set()  # open while the router learns where the adapter runs
    hot = upstreams("hot", adapters=["sql"], lora_info=(["sql"], [], 4), gate=gate)
    cold = upstreams("cold", adapters=["sql"], lora_info=([], [], 4))
    router = _start(start_router, tmp_path, [{"name": "alpha", "upstreams": [hot.url, cold.url]}])
    _adapter_polls(router, 2)  # alpha, and sql found on the pods (the file names no adapter)
    with httpx.Client(base_url=router.url, timeout=10) as http:
        wait_for(
            lambda: _served_by(http.post("/v1/chat/completions", json=_chat("sql"))) == "hot", what="in use"
        )
    gate.clear()
    done: list[str] = []
    threads: list[threading.Thread] = []

    def send() -> None:
        with httpx.Client(base_url=router.url, timeout=20) as http:
            done.append(_served_by(http.post("/v1/chat/completions", json=_chat("sql"))))

    try:
        # One at a time: each is either held open on hot (its gate is shut) or answered by cold.
        for n in range(1, 5):
            threads.append(threading.Thread(target=send, daemon=True))
            threads[-1].start()
            wait_for(lambda n=n: hot.open + len(done) == n, what=f"request {n} placed")
        # Two pods, eps 0.25: hot may hold ceil(1.25 * 3 / 2) = 2; the third and fourth go to cold.
        assert (hot.open, done) == (2, ["cold", "cold"])
    finally:
        gate.set()
        for t in threads:
            t.join(10)
    assert sorted(done) == ["cold", "cold", "hot", "hot"]
    text = router.metrics()
    assert metric_value(text, "vsurge_router_adapter_picks_total", model="sql", how="listed") == 2


def test_router_models_lists_adapters_with_their_parent(upstreams, start_router, tmp_path) -> None:
    pod = upstreams("pod", adapters=["runtime-one"], lora_info=([], [], 8))
    router = _start(start_router, tmp_path, [{"name": "alpha", "upstreams": [pod.url], "adapters": ["sql"]}])
    _adapter_polls(router, 3)
    cards = {m["id"]: m for m in httpx.get(f"{router.url}/v1/models", timeout=30).json()["data"]}
    assert "parent" not in cards["alpha"]
    # From the file, and one only the pod lists (loaded at run time): both routable, both with the parent.
    assert cards["sql"]["parent"] == "alpha" and cards["runtime-one"]["parent"] == "alpha"
    assert cards["sql"]["ready"] is True
    one = httpx.get(f"{router.url}/v1/models/runtime-one", timeout=30).json()
    assert (one["id"], one["parent"]) == ("runtime-one", "alpha")
    r = httpx.post(f"{router.url}/v1/chat/completions", json=_chat("runtime-one"), timeout=10)
    assert _served_by(r) == "pod" and pod.requests[-1]["body"]["model"] == "runtime-one"
    # The pod unloads it: it leaves the list and requests for it are refused by the router.
    pod.adapters = []
    wait_for(
        lambda: (
            httpx.post(f"{router.url}/v1/chat/completions", json=_chat("runtime-one"), timeout=30).status_code
            == 404
        ),
        what="runtime-one gone",
    )


def test_a_request_for_an_adapter_wakes_its_model_at_zero() -> None:
    import asyncio

    from test_router_wake import TARGET, FakeScaler, _backend

    from vsurge.router.wake import Waker

    async def scenario() -> tuple[list, tuple[str, ...]]:
        table = EndpointTable()
        table.upsert(_backend())  # model "m", 0 replicas
        table.set_aliases("k8s:models", {"sql": "m"})  # its spec.adapters
        scaler = FakeScaler()
        held = asyncio.create_task(Waker(table, scaler, timeout_s=5).upstreams_for("sql"))
        await asyncio.sleep(0.05)
        table.upsert(_backend(("http://r:1",), desired=1))
        return scaler.calls, await held

    calls, upstreams = asyncio.run(scenario())
    assert calls == [(TARGET, 1)] and upstreams == ("http://r:1",)


def test_inference_model_adapters_are_routed_through_the_watch(cluster, upstreams, start_router) -> None:
    from vsurge_operator import kube as operator_kube

    im = operator_kube.INFERENCE_MODEL
    pod = upstreams("pod")  # lists no adapter itself: the names come from spec.adapters
    api = cluster.client()
    obj = inference_model("llama", served="llama-chat", ready=1, endpoint=pod.url)
    obj["spec"]["adapters"] = [{"name": "sql", "source": "hf://o/sql"}]
    api.create(im, "models", obj)
    router = start_router(api_client=cluster.api_client(), kubernetes=True, **FAST)

    def ids() -> dict[str, str | None]:
        return {
            m["id"]: m.get("parent") for m in httpx.get(f"{router.url}/v1/models", timeout=30).json()["data"]
        }

    wait_for(lambda: ids() == {"llama-chat": None, "sql": "llama-chat"}, what="sql listed from the list")
    r = httpx.post(f"{router.url}/v1/completions", json={"model": "sql", "prompt": "x"}, timeout=10)
    assert r.json() == {"upstream": "pod", "path": "/v1/completions", "model": "sql"}
    # Edited (a watch event): the new adapter is routable, the removed one is not.
    api.patch(im, "models", "llama", {"spec": {"adapters": [{"name": "chat", "source": "hf://o/chat"}]}})
    wait_for(lambda: ids() == {"llama-chat": None, "chat": "llama-chat"}, what="chat replaces sql")
    gone = httpx.post(f"{router.url}/v1/completions", json={"model": "sql", "prompt": "x"}, timeout=10)
    assert gone.status_code == 404
    api.delete(im, "models", "llama")
    wait_for(lambda: ids() == {}, what="model and adapters gone")
