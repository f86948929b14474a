"""The CRD: a valid apiextensions/v1 object with a structural schema that rejects what it can.

Specs are validated with a JSON-Schema validator on the CRD's ``openAPIV3Schema`` (Draft 4 semantics, as
Kubernetes' OpenAPI v3 subset uses boolean ``exclusiveMinimum``). The patterns, enums, ranges and
defaults must equal those of the operator's own validation and spec modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from kubernetes_validate import utils as kv
from operator_harness import DELETE, issue_example, with_field

from vsurge_operator import crd, engine_options, spec, tpu, validation

CRD = crd.load_crd()
SCHEMA = crd.openapi_schema(CRD)
VALIDATOR = jsonschema.Draft4Validator(SCHEMA)
SPEC = SCHEMA["properties"]["spec"]["properties"]


def im(**spec_fields: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"model": {"source": "default"}}
    s.update(spec_fields)
    return {
        "apiVersion": "vsurge.io/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "m"},
        "spec": s,
    }


def test_crd_is_a_valid_kubernetes_object():
    kv.validate(CRD, kv.latest_version(), strict=True)
    assert CRD["metadata"]["name"] == crd.CRD_NAME
    names = CRD["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "InferenceModel",
        "inferencemodels",
        ["im"],
    )
    assert CRD["spec"]["scope"] == "Namespaced" and CRD["spec"]["group"] == crd.GROUP


def test_subresources_and_printer_columns():
    (version,) = CRD["spec"]["versions"]
    assert version["name"] == crd.VERSION and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Model": ".spec.model.source",
        "Accelerator": ".spec.tpu.accelerator",
        "Topology": ".spec.tpu.topology",
        "Ready": ".status.readyReplicas",
        "Desired": ".status.desiredReplicas",
        "Occupancy": ".status.occupancy",
        "Age": ".metadata.creationTimestamp",
    }


def _nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from _nodes(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    for path, node in _nodes(SCHEMA):
        special = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        assert "type" in node or special, f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        for branch in node.get("anyOf", []):
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"
            assert set(branch) == {"type"}


VALID = {
    "minimal": im(),
    "issue example": im(
        **issue_example(),
        image="reg/vsurge-service:1",
        replicas=1,
        autoscaling={
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 8,
            "metric": "slotOccupancy",
            "target": 0.7,
            "intervalSeconds": 15,
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 300,
        },
        tracing={"endpoint": "http://otel-collector:4317", "samplingRatio": 0.1},
    ),
    "multi-host v5p": im(
        tpu={"accelerator": "tpu-v5p-slice", "topology": "2x2x4"}, engine={"mesh": "dp=2,tp=8"}
    ),
    "hf with overrides": im(
        model={"source": "hf://Qwen/Qwen3-0.6B"},
        resources={"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": 4294967296}},
        env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        nodeSelector={"pool": "a"},
        tolerations=[{"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule"}],
        serviceAccountName="models",
        imagePullPolicy="IfNotPresent",
    ),
    "scale to zero on queue": im(
        model={"source": "pvc://weights/qwen"},
        autoscaling={"enabled": True, "minReplicas": 0, "metric": "prefillQueueSize", "target": 4},
    ),
    "local path": im(model={"source": "/models/llama"}, replicas=0),
    "production pod fields": im(
        scheduling={
            "nodeSelector": {"pool": "serving"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
            ],
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"vsurge.io/model": "m"}},
                            },
                        }
                    ]
                }
            },
            "priorityClassName": "llm-serving",
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                }
            ],
        },
        podTemplate={"metadata": {"labels": {"team": "search"}, "annotations": {"example.com/owner": "a b"}}},
        imagePullSecrets=[{"name": "registry"}],
        drainSeconds=600,
        rollout={"surge": 0, "maxUnavailable": 1},
        compileCache={"size": "20Gi", "storageClassName": "filestore", "accessMode": "ReadWriteMany"},
    ),
    "existing compile cache claim": im(compileCache={"claimName": "jax-cache"}, drainSeconds=0),
    "lora adapters": im(
        model={"source": "pvc://weights/llama", "servedName": "llama"},
        adapters=[
            {"name": "sql-lora", "source": "hf://org/sql-lora"},
            {"name": "team/chat:v2", "source": "pvc://weights/adapters/chat"},
            {"name": "summarize", "source": "s3://bucket/adapters/summarize"},
        ],
        engine={"maxLoras": 4, "maxLoraRank": 16},
    ),
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_specs_pass(name):
    VALIDATOR.validate(VALID[name])
    # ...and the operator agrees (it has a default image configured here).
    assert validation.validate(VALID[name], default_image="img") == []


BASE = VALID["issue example"]
BAD = [
    ("spec", with_field(BASE, "spec", DELETE)),
    ("spec.model", with_field(BASE, "spec.model", DELETE)),
    ("spec.model.source", with_field(BASE, "spec.model.source", DELETE)),
    ("spec.model.source", with_field(BASE, "spec.model.source", "ftp://host/model")),
    ("spec.model.source", with_field(BASE, "spec.model.source", "")),
    ("spec.model.servedName", with_field(BASE, "spec.model.servedName", "bad name")),
    ("spec.engine.driver", with_field(BASE, "spec.engine.driver", "fast")),
    ("spec.engine.maxConcurrentDecodes", with_field(BASE, "spec.engine.maxConcurrentDecodes", 0)),
    ("spec.engine.maxLength", with_field(BASE, "spec.engine.maxLength", 10**9)),
    ("spec.engine.prefillLengths", with_field(BASE, "spec.engine.prefillLengths", [])),
    ("spec.engine.prefillLengths[]", with_field(BASE, "spec.engine.prefillLengths", [8])),
    ("spec.engine.pageSize", with_field(BASE, "spec.engine.pageSize", 100)),
    ("spec.engine.hbmUtilization", with_field(BASE, "spec.engine.hbmUtilization", 0)),
    ("spec.engine.hbmUtilization", with_field(BASE, "spec.engine.hbmUtilization", 1.2)),
    ("spec.engine.dtype", with_field(BASE, "spec.engine.dtype", "int8")),
    ("spec.engine.mesh", with_field(BASE, "spec.engine.mesh", "tensor=8")),
    ("spec.tpu.accelerator", with_field(BASE, "spec.tpu.accelerator", "nvidia-h100")),
    ("spec.tpu.topology", with_field(BASE, "spec.tpu.topology", "2by4")),
    ("spec.tpu.topology", with_field(BASE, "spec.tpu.topology", "0x4")),
    ("spec.tpu.topology", with_field(BASE, "spec.tpu.topology", DELETE)),
    ("spec.image", with_field(BASE, "spec.image", "")),
    ("spec.imagePullPolicy", with_field(BASE, "spec.imagePullPolicy", "Sometimes")),
    ("spec.replicas", with_field(BASE, "spec.replicas", -1)),
    ("spec.replicas", with_field(BASE, "spec.replicas", "2")),
    ("spec.autoscaling.enabled", with_field(BASE, "spec.autoscaling.enabled", "yes")),
    ("spec.autoscaling.minReplicas", with_field(BASE, "spec.autoscaling.minReplicas", -1)),
    ("spec.autoscaling.maxReplicas", with_field(BASE, "spec.autoscaling.maxReplicas", 0)),
    ("spec.autoscaling.metric", with_field(BASE, "spec.autoscaling.metric", "cpu")),
    ("spec.autoscaling.target", with_field(BASE, "spec.autoscaling.target", 0)),
    ("spec.autoscaling.tolerance", with_field(BASE, "spec.autoscaling.tolerance", 0.9)),
    ("spec.autoscaling.intervalSeconds", with_field(BASE, "spec.autoscaling.intervalSeconds", 0)),
    (
        "spec.autoscaling.scaleDownStabilizationSeconds",
        with_field(BASE, "spec.autoscaling.scaleDownStabilizationSeconds", 7200),
    ),
    ("spec.autoscaling.scaleDownPercent", with_field(BASE, "spec.autoscaling.scaleDownPercent", 101)),
    ("spec.tracing.endpoint", with_field(BASE, "spec.tracing.endpoint", "otel-collector:4317")),
    ("spec.tracing.endpoint", with_field(BASE, "spec.tracing.endpoint", DELETE)),
    ("spec.tracing.samplingRatio", with_field(BASE, "spec.tracing.samplingRatio", 1.5)),
    ("spec.resources.limits.cpu", with_field(BASE, "spec.resources", {"limits": {"cpu": "lots"}})),
    ("spec.env[0].name", with_field(BASE, "spec.env", [{"value": "x"}])),
    ("spec.env[0].name", with_field(BASE, "spec.env", [{"name": "1=x"}])),
    ("spec.nodeSelector.pool", with_field(BASE, "spec.nodeSelector", {"pool": 3})),
    (
        "spec.tolerations[0].operator",
        with_field(BASE, "spec.tolerations", [{"key": "k", "operator": "Maybe"}]),
    ),
    ("spec.serviceAccountName", with_field(BASE, "spec.serviceAccountName", "Bad_Name")),
    ("spec.drainSeconds", with_field(BASE, "spec.drainSeconds", -1)),
    ("spec.drainSeconds", with_field(BASE, "spec.drainSeconds", "120")),
    ("spec.rollout.surge", with_field(BASE, "spec.rollout", {"surge": -1})),
    ("spec.rollout.maxUnavailable", with_field(BASE, "spec.rollout", {"maxUnavailable": 101})),
    ("spec.imagePullSecrets[0].name", with_field(BASE, "spec.imagePullSecrets", [{"name": "Bad_Secret"}])),
    ("spec.imagePullSecrets[0].name", with_field(BASE, "spec.imagePullSecrets", [{}])),
    (
        "spec.scheduling.priorityClassName",
        with_field(BASE, "spec.scheduling", {"priorityClassName": "Not A Name"}),
    ),
    (
        "spec.scheduling.tolerations[0].effect",
        with_field(BASE, "spec.scheduling", {"tolerations": [{"key": "k", "effect": "Sometimes"}]}),
    ),
    (
        "spec.scheduling.topologySpreadConstraints[0].whenUnsatisfiable",
        with_field(
            BASE,
            "spec.scheduling",
            {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "z", "whenUnsatisfiable": "Maybe"}]},
        ),
    ),
    (
        "spec.scheduling.topologySpreadConstraints[0].maxSkew",
        with_field(
            BASE,
            "spec.scheduling",
            {
                "topologySpreadConstraints": [
                    {"maxSkew": 0, "topologyKey": "z", "whenUnsatisfiable": "DoNotSchedule"}
                ]
            },
        ),
    ),
    (
        "spec.podTemplate.metadata.labels.team",
        with_field(BASE, "spec.podTemplate", {"metadata": {"labels": {"team": "not a value"}}}),
    ),
    ("spec.adapters[0].name", with_field(BASE, "spec.adapters", [{"name": "a=b", "source": "hf://o/a"}])),
    ("spec.adapters[0].name", with_field(BASE, "spec.adapters", [{"source": "hf://o/a"}])),
    ("spec.adapters[0].source", with_field(BASE, "spec.adapters", [{"name": "a", "source": "default"}])),
    ("spec.adapters[0].source", with_field(BASE, "spec.adapters", [{"name": "a", "source": "ftp://h/a"}])),
    ("spec.adapters[0].source", with_field(BASE, "spec.adapters", [{"name": "a"}])),
    (
        "spec.adapters",
        with_field(BASE, "spec.adapters", [{"name": f"a{i}", "source": "hf://o/a"} for i in range(65)]),
    ),
    ("spec.engine.maxLoras", with_field(BASE, "spec.engine.maxLoras", 0)),
    ("spec.engine.maxLoraRank", with_field(BASE, "spec.engine.maxLoraRank", 4096)),
    ("spec.compileCache.size", with_field(BASE, "spec.compileCache", {"size": "lots"})),
    (
        "spec.compileCache.accessMode",
        with_field(BASE, "spec.compileCache", {"size": "1Gi", "accessMode": "ReadMany"}),
    ),
]


def _error_paths(doc: dict[str, Any]) -> set[str]:
    paths = set()
    for err in VALIDATOR.iter_errors(doc):
        parts = []
        for p in err.absolute_path:
            parts.append(f"[{p}]" if isinstance(p, int) else f".{p}")
        path = "".join(parts).lstrip(".")
        if err.validator == "required":  # name the missing field, not its parent
            missing = err.message.split("'")[1]
            path = f"{path}.{missing}" if path else missing
        paths.add(path)
    return paths


@pytest.mark.parametrize(("field", "doc"), BAD, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD)])
def test_bad_specs_are_rejected_by_the_schema(field, doc):
    paths = _error_paths(doc)
    expected = field.replace("prefillLengths[]", "prefillLengths[0]")
    assert expected in paths, paths
    # Defence in depth: the operator rejects it as well (objects may predate the schema).
    assert validation.validate(doc, default_image="img"), f"validate() accepted {field}"


def test_cross_field_rules_are_left_to_the_operator():
    # The schema cannot see that v5e has no 4x4x4 slice; the operator must catch it.
    doc = with_field(BASE, "spec.tpu.topology", "4x4x4")
    VALIDATOR.validate(doc)
    assert [e.field for e in validation.validate(doc)] == ["spec.tpu.topology"]
    # CEL rules carry the rest to a real API server.
    rules = {r["rule"] for r in SPEC["autoscaling"]["x-kubernetes-validations"]}
    assert "self.minReplicas <= self.maxReplicas" in rules


# Rules the JSON-schema validator cannot run (CEL, on the real API server: tests/cluster) that the operator
# also enforces.
CEL_ONLY = [
    (
        "spec.adapters",
        with_field(
            BASE, "spec.adapters", [{"name": "a", "source": "hf://o/a"}, {"name": "a", "source": "gs://b/a"}]
        ),
    ),
    # an adapter named like the base model (spec.model.servedName, else metadata.name) is unreachable
    ("spec.adapters", with_field(BASE, "spec.adapters", [{"name": "llama-3-8b", "source": "hf://o/a"}])),
    ("spec.rollout", with_field(BASE, "spec.rollout", {"surge": 0, "maxUnavailable": 0})),
    ("spec.compileCache", with_field(BASE, "spec.compileCache", {})),
    ("spec.compileCache", with_field(BASE, "spec.compileCache", {"claimName": "c", "size": "1Gi"})),
    (
        "spec.compileCache",
        with_field(BASE, "spec.compileCache", {"claimName": "c", "accessMode": "ReadWriteOnce"}),
    ),
    (
        "spec.podTemplate.metadata.labels.vsurge.io/model",
        with_field(BASE, "spec.podTemplate", {"metadata": {"labels": {"vsurge.io/model": "other"}}}),
    ),
    (
        "spec.podTemplate.metadata.labels.bad key!",
        with_field(BASE, "spec.podTemplate", {"metadata": {"labels": {"bad key!": "x"}}}),
    ),
]


@pytest.mark.parametrize(("field", "doc"), CEL_ONLY, ids=[f"{i}-{f}" for i, (f, _) in enumerate(CEL_ONLY)])
def test_cel_rules_are_enforced_by_the_operator_too(field, doc):
    assert field in [e.field for e in validation.validate(doc, default_image="img")]


def test_schema_matches_the_operator():
    assert SPEC["model"]["properties"]["source"]["pattern"] == validation.SOURCE_PATTERN
    assert SPEC["model"]["properties"]["servedName"]["pattern"] == validation.SERVED_NAME_PATTERN
    assert SPEC["tpu"]["properties"]["topology"]["pattern"] == validation.TOPOLOGY_PATTERN
    assert SPEC["engine"]["properties"]["mesh"]["pattern"] == validation.MESH_PATTERN
    assert SPEC["tracing"]["properties"]["endpoint"]["pattern"] == validation.TRACING_ENDPOINT_PATTERN
    assert SPEC["env"]["items"]["properties"]["name"]["pattern"] == validation.ENV_NAME_PATTERN
    assert SPEC["serviceAccountName"]["pattern"] == validation.DNS1123_SUBDOMAIN
    for kind in ("requests", "limits"):
        assert (
            SPEC["resources"]["properties"][kind]["additionalProperties"]["pattern"]
            == validation.QUANTITY_PATTERN
        )
    toleration = SPEC["tolerations"]["items"]["properties"]
    assert tuple(toleration["operator"]["enum"]) == validation.TOLERATION_OPERATORS
    assert tuple(toleration["effect"]["enum"]) == validation.TAINT_EFFECTS
    assert set(SPEC["tpu"]["properties"]["accelerator"]["enum"]) == set(tpu.ACCELERATORS)
    assert tuple(SPEC["imagePullPolicy"]["enum"]) == validation.PULL_POLICIES
    assert tuple(SPEC["autoscaling"]["properties"]["metric"]["enum"]) == spec.METRICS
    for key, (lo, hi) in validation.RANGES.items():
        node = SCHEMA
        for part in key.split("."):
            node = node["properties"][part.removesuffix("[]")]
            if part.endswith("[]"):
                node = node["items"]
        assert (node.get("minimum"), node.get("maximum")) == (lo, hi), key


def test_engine_schema_matches_the_operators_table():
    """spec.engine and engine_options.OPTIONS are generated together (from EngineConfig: the drift test is
    tests/service/test_engine_config.py); here, without vsurge, they agree key by key."""
    props = SPEC["engine"]["properties"]
    assert list(props) == [o.key for o in engine_options.OPTIONS]
    for o in engine_options.OPTIONS:
        node = props[o.key]
        bounds = node["items"] if o.kind == "integers" else node
        assert node["type"] == {"integers": "array"}.get(o.kind, o.kind), o.key
        assert tuple(node.get("enum", ())) == o.choices, o.key
        assert (bounds.get("minimum"), bounds.get("maximum")) == (o.minimum, o.maximum), o.key
        assert bounds.get("exclusiveMinimum", False) == o.exclusive_minimum, o.key
        assert "default" not in node, f"{o.key}: unset must mean the server's default"
    rules = {r["fieldPath"]: r for r in SPEC["engine"]["x-kubernetes-validations"] if "fieldPath" in r}
    for o in engine_options.OPTIONS:
        if o.only:
            assert rules[f".{o.key}"]["message"] == f"{o.key} applies to driver {o.only}'s {o.what}"
    assert SPEC["engine"]["properties"]["prefillLengths"]["maxItems"] == validation.PREFILL_LENGTHS_MAX_ITEMS


def test_defaults_match_the_operator():
    defaults = spec.AutoscalingSpec()
    props = SPEC["autoscaling"]["properties"]
    for crd_key, py_key in spec._AUTOSCALING_KEYS.items():
        assert props[crd_key]["default"] == getattr(defaults, py_key), crd_key
    assert SPEC["tracing"]["properties"]["samplingRatio"]["default"] == spec.TracingSpec("x").sampling_ratio
    assert SPEC["drainSeconds"]["default"] == spec.DEFAULT_DRAIN_SECONDS
    rollout = SPEC["rollout"]["properties"]
    assert (rollout["surge"]["default"], rollout["maxUnavailable"]["default"]) == (
        spec.RolloutSpec().surge,
        spec.RolloutSpec().max_unavailable,
    )


def test_pod_field_rules_match_the_operator():
    from vsurge_operator import podspec_validation as pv

    sched = SPEC["scheduling"]["properties"]
    assert sched["priorityClassName"]["pattern"] == pv.DNS1123_SUBDOMAIN
    assert tuple(sched["tolerations"]["items"]["properties"]["effect"]["enum"]) == pv.TAINT_EFFECTS
    assert tuple(sched["tolerations"]["items"]["properties"]["operator"]["enum"]) == pv.TOLERATION_OPERATORS
    spread = sched["topologySpreadConstraints"]["items"]["properties"]
    assert tuple(spread["whenUnsatisfiable"]["enum"]) == pv.WHEN_UNSATISFIABLE
    labels = SPEC["podTemplate"]["properties"]["metadata"]["properties"]["labels"]
    assert labels["additionalProperties"]["pattern"] == pv.LABEL_VALUE
    assert pv.QUALIFIED_NAME in labels["x-kubernetes-validations"][0]["rule"]
    assert all(f"'{k}' in self" in labels["x-kubernetes-validations"][1]["rule"] for k in pv.RESERVED_LABELS)
    assert SPEC["imagePullSecrets"]["items"]["properties"]["name"]["pattern"] == pv.DNS1123_SUBDOMAIN
    cc = SPEC["compileCache"]["properties"]
    assert cc["size"]["pattern"] == pv.QUANTITY_PATTERN
    assert tuple(cc["accessMode"]["enum"]) == pv.ACCESS_MODES
    for key, (lo, hi) in pv.RANGES.items():
        node = SCHEMA
        for part in key.split("."):
            node = node["properties"][part.removesuffix("[]")]
            if part.endswith("[]"):
                node = node["items"]
        assert (node.get("minimum"), node.get("maximum")) == (lo, hi), key


def test_adapter_rules_match_the_operator():
    from vsurge_operator import adapters

    node = SPEC["adapters"]
    item = node["items"]["properties"]
    assert item["name"]["pattern"] == adapters.NAME_PATTERN == validation.SERVED_NAME_PATTERN
    assert item["name"]["maxLength"] == adapters.NAME_MAX_LENGTH
    assert item["source"]["pattern"] == adapters.SOURCE_PATTERN
    assert item["source"]["maxLength"] == adapters.SOURCE_MAX_LENGTH
    assert node["maxItems"] == adapters.MAX_ADAPTERS
    # every model source scheme but "default" (the bundled base model)
    assert validation.SOURCE_PATTERN.replace("default|", "") == adapters.SOURCE_PATTERN
    assert node["x-kubernetes-validations"][0]["rule"] == "self.all(a, self.exists_one(b, b.name == a.name))"


def test_mesh_length_matches_the_operator():
    assert SPEC["engine"]["properties"]["mesh"]["maxLength"] == validation.MESH_MAX_LENGTH
