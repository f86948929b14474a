"""Discovery as pure functions: the static file, InferenceModel -> Backend, the table, the wake decision."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from router_helpers import inference_model

from vsurge.router.kube import backend_from_object, group_for
from vsurge.router.static import StaticConfigError, StaticDiscovery, load_static_config, parse_static_config
from vsurge.router.table import Backend, EndpointTable, ModelView, ServiceRef, WakeTarget, normalize_upstream
from vsurge.router.wake import can_become_ready, wake_target

# ------------------------------------------------------------------------------------------ static


def test_static_config_parses_and_normalizes() -> None:
    models = parse_static_config(
        {
            "models": [
                {
                    "name": "llama",
                    "upstreams": [
                        "http://127.0.0.1:8001/",
                        "http://127.0.0.1:8002/v1",
                        "http://127.0.0.1:8001",
                    ],
                },
                {"name": " qwen ", "replicas": "https://qwen.models.svc:11556/prefix/v1/"},
                {"name": "asleep", "upstreams": []},
            ]
        }
    )
    assert [(m.name, m.upstreams) for m in models] == [
        ("llama", ("http://127.0.0.1:8001", "http://127.0.0.1:8002")),
        ("qwen", ("https://qwen.models.svc:11556/prefix",)),
        ("asleep", ()),
    ]
    assert parse_static_config(None) == []
    assert parse_static_config({"models": None}) == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([{"name": "a"}], "top level must be a mapping"),
        ({"modles": []}, "unknown top-level key(s) ['modles']"),
        ({"models": {"a": 1}}, "`models` must be a list"),
        ({"models": ["a"]}, "models[0]: expected a mapping"),
        ({"models": [{"upstreams": []}]}, "models[0].name: a non-empty string"),
        ({"models": [{"name": "a", "upstream": []}]}, "models[0]: unknown key(s) ['upstream']"),
        (
            {"models": [{"name": "a", "upstreams": ["ftp://x"]}]},
            "models[0] (a).upstreams[0]: 'ftp://x' is not",
        ),
        ({"models": [{"name": "a", "upstreams": ["http://x?q=1"]}]}, "must not have a query"),
        (
            {"models": [{"name": "a", "upstreams": [8000]}]},
            "models[0] (a).upstreams[0]: expected a URL string",
        ),
        ({"models": [{"name": "a", "upstreams": {"u": 1}}]}, "models[0] (a).upstreams: expected a list"),
        ({"models": [{"name": "a", "upstreams": [], "replicas": []}]}, "give `upstreams` or `replicas`"),
        ({"models": [{"name": "a"}, {"name": "a"}]}, "models[1] (a): the name is listed twice"),
    ],
)
def test_static_config_errors_name_the_entry(data: object, message: str) -> None:
    with pytest.raises(StaticConfigError) as e:
        parse_static_config(data)
    assert message in str(e.value)


def test_static_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(StaticConfigError, match="missing.yaml: cannot read"):
        load_static_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(StaticConfigError, match="bad.yaml: not valid YAML"):
        load_static_config(bad)
    bad.write_text("models:\n  - name: a\n    upstreams: [nope]\n")
    with pytest.raises(StaticConfigError, match=r"bad.yaml: models\[0\] \(a\).upstreams\[0\]"):
        load_static_config(bad)


def test_static_file_is_reloaded_and_a_broken_edit_keeps_the_models(tmp_path: Path) -> None:
    path = tmp_path / "static.yaml"
    path.write_text("models:\n  - name: a\n    upstreams: [http://127.0.0.1:1]\n")

    async def scenario() -> list[list[str]]:
        table = EndpointTable()
        source = StaticDiscovery(path, reload_seconds=0.02)
        seen = []
        await source.start(table)
        try:
            assert table.synced
            seen.append([v.name for v in table.models()])
            path.write_text("models:\n  - name: b\n    upstreams: [http://127.0.0.1:2]\n")
            for _ in range(200):
                await asyncio.sleep(0.01)
                if table.lookup("b"):
                    break
            seen.append([v.name for v in table.models()])
            path.write_text("models: [broken\n")
            await asyncio.sleep(0.1)
            seen.append([v.name for v in table.models()])
        finally:
            await source.stop()
        return seen

    assert asyncio.run(scenario()) == [["a"], ["b"], ["b"]]


# --------------------------------------------------------------------------------------- kubernetes


def test_inference_model_becomes_a_backend() -> None:
    group = group_for("models")
    obj = inference_model(
        "llama-3",
        replicas=2,
        served="llama",
        ready=2,
        endpoint="http://llama-3.models.svc.cluster.local:11556",
    )
    obj["metadata"]["creationTimestamp"] = "2025-01-02T03:04:05Z"
    b = backend_from_object(obj, group)
    assert b == Backend(
        model="llama",
        upstreams=("http://llama-3.models.svc.cluster.local:11556",),
        key="k8s/models/llama-3",
        group="k8s:models",
        wake=WakeTarget("models", "llama-3"),
        desired_replicas=2,
        created=1735787045,
        service=ServiceRef("models", "llama-3"),  # the operator names the Service after the model
    )
    # Default served name; not ready -> no upstream even with an endpoint; status.desiredReplicas as fallback.
    obj = inference_model("qwen", replicas=None, ready=0, endpoint="http://qwen.models.svc:11556")
    obj["status"]["desiredReplicas"] = 0
    b = backend_from_object(obj, group)
    assert (b.model, b.upstreams, b.desired_replicas) == ("qwen", (), 0)
    assert backend_from_object(inference_model("x", replicas=None), group).desired_replicas is None
    # Being deleted, or nameless: not routable.
    gone = inference_model("x")
    gone["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert backend_from_object(gone, group) is None
    assert backend_from_object({"metadata": {"name": "x"}}, group) is None
    # A bad endpoint is ignored, not fatal.
    assert backend_from_object(inference_model("x", ready=1, endpoint="x:1"), group).upstreams == ()


def test_normalize_upstream() -> None:
    assert normalize_upstream(" http://h:1/v1/ ") == "http://h:1"
    assert normalize_upstream("https://h/base") == "https://h/base"
    for bad in ("h:1", "http://", "tcp://h:1"):
        with pytest.raises(ValueError):
            normalize_upstream(bad)


# ------------------------------------------------------------------------------------------- table


def _b(model: str, key: str, group: str, upstreams: tuple[str, ...] = (), **kw: object) -> Backend:
    return Backend(model, upstreams, key=key, group=group, **kw)  # type: ignore[arg-type]


def test_table_groups_are_independent_and_models_pool_their_upstreams() -> None:
    async def scenario() -> None:
        t = EndpointTable()
        t.expect("static")
        t.expect("k8s:models")
        assert not t.synced
        t.replace_group("static", [_b("m", "static/m", "static", ("http://s:1",))])
        assert not t.synced
        event = t.changed_event()
        t.replace_group(
            "k8s:models",
            [
                _b("m", "k8s/models/m", "k8s:models", ("http://k:1", "http://s:1")),
                _b("n", "k8s/models/n", "k8s:models"),
            ],
        )
        assert t.synced and event.is_set() and not t.changed_event().is_set()
        assert t.lookup("m").upstreams == ("http://k:1", "http://s:1")
        assert [v.name for v in t.models()] == ["m", "n"]
        # A relist of one group drops only that group's missing entries.
        t.replace_group("k8s:models", [])
        assert t.lookup("m").upstreams == ("http://s:1",) and t.lookup("n") is None
        version = t.version
        t.upsert(_b("m", "static/m", "static", ("http://s:1",)))  # no change: no notification
        assert t.version == version
        t.remove("static/m")
        assert t.lookup("m") is None

    asyncio.run(scenario())


def test_wake_decision() -> None:
    asleep = _b("m", "k8s/ns/m", "k8s:ns", wake=WakeTarget("ns", "m"), desired_replicas=0)
    starting = _b("m", "k8s/ns2/m", "k8s:ns2", wake=WakeTarget("ns2", "m"), desired_replicas=1)
    unknown = _b("m", "k8s/ns3/m", "k8s:ns3", wake=WakeTarget("ns3", "m"), desired_replicas=None)
    ready = _b("m", "k8s/ns4/m", "k8s:ns4", ("http://r:1",), wake=WakeTarget("ns4", "m"), desired_replicas=1)
    static = _b("m", "static/m", "static")
    assert wake_target(ModelView("m", (asleep,))) == WakeTarget("ns", "m")
    assert wake_target(ModelView("m", (asleep, static))) == WakeTarget("ns", "m")
    assert wake_target(ModelView("m", (asleep, starting))) is None  # one is on its way: do not patch
    assert wake_target(ModelView("m", (unknown,))) is None
    assert wake_target(ModelView("m", (asleep, ready))) is None
    assert wake_target(ModelView("m", (static,))) is None
    assert can_become_ready(ModelView("m", (asleep,))) and not can_become_ready(ModelView("m", (static,)))
