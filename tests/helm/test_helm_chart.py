"""The Helm chart helm/vsurge, rendered by Helm's own Go engine (helm-python-sdk), checked object by object.

Built-in kinds are validated against the Kubernetes 1.30 OpenAPI schemas (kubernetes-validate, strict: unknown
fields fail). Kinds defined by CRDs are checked against their CRD: InferenceModel against the chart's own CRD
(when the operator's engineer has written it), the monitoring kinds against the fields of their upstream CRDs
that the chart uses (those CRDs are not in this repository).
"""

from __future__ import annotations

import base64
import copy
import re
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from chartkit import CHART_DIR, CRD_PATH, DEFAULT_VALUES, RELEASE, SCENARIOS, Rendered, load_values, render
from dockerkit import DOCKERFILES, final_user

K8S_VERSION = "1.30.0"
CHART_META = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())

# Kinds that no Kubernetes OpenAPI schema describes, and how each is checked instead.
CRD_KINDS = {
    ("vsurge.io/v1alpha1", "InferenceModel"): "the chart's CRD (test_models_valid_against_crd)",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "Prometheus Operator fields (test_monitors_valid)",
    ("monitoring.googleapis.com/v1", "PodMonitoring"): "Managed Prometheus fields (test_monitors_valid)",
    (
        "monitoring.googleapis.com/v1",
        "ClusterPodMonitoring",
    ): "Managed Prometheus fields (test_monitors_valid)",
    ("kopf.dev/v1", "ClusterKopfPeering"): "the chart's kopf peering CRDs (test_helm_operator_ha)",
    ("kopf.dev/v1", "KopfPeering"): "the chart's kopf peering CRDs (test_helm_operator_ha)",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "PromQL parsed, names checked (test_helm_monitoring)",
    (
        "inference.networking.k8s.io/v1",
        "InferencePool",
    ): "the extension's released CRD (test_gateway_objects)",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "Gateway API's released CRD (test_gateway_objects)",
}

# The exact set of objects each scenario renders: (kind, namespace or None for cluster-scoped, name).
# What a cluster-wide release in vsurge-system renders whatever its options, the operator's ServiceAccount aside:
_CLUSTER_WIDE: set[tuple[str, str | None, str]] = {
    ("ServiceAccount", "vsurge-system", "vsurge-router"),
    ("ClusterRole", None, "vsurge-operator"),
    ("ClusterRole", None, "vsurge-router"),
    ("ClusterRole", None, "vsurge-inferencemodels-edit"),
    ("ClusterRole", None, "vsurge-inferencemodels-view"),
    ("ClusterRoleBinding", None, "vsurge-operator"),
    ("ClusterRoleBinding", None, "vsurge-router"),
    ("Deployment", "vsurge-system", "vsurge-operator"),
    ("Deployment", "vsurge-system", "vsurge-router"),
    ("Service", "vsurge-system", "vsurge-router"),
    ("PodDisruptionBudget", "vsurge-system", "vsurge-router"),
    # Two operator replicas (one active, kopf peering) and a PDB that keeps one.
    ("ClusterKopfPeering", None, "vsurge-operator"),
    ("PodDisruptionBudget", "vsurge-system", "vsurge-operator"),
    # the operator's /metrics, scraped on every replica
    ("Service", "vsurge-system", "vsurge-operator-metrics"),
    # Secrets only in Roles (secretNamespaces, default the release namespace), never cluster-wide
    ("Role", "vsurge-system", "vsurge-operator-secrets"),
    ("RoleBinding", "vsurge-system", "vsurge-operator-secrets"),
    ("Role", "vsurge-system", "vsurge-router-secrets"),
    ("RoleBinding", "vsurge-system", "vsurge-router-secrets"),
}
_LLMD = {
    (kind, ns, f"{model}-epp")
    for ns, model in (("vsurge-system", "smollm2"), ("team-b", "qwen"))
    for kind in ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Deployment", "Service")
}
INVENTORY: dict[str, set[tuple[str, str | None, str]]] = {
    "defaults": _CLUSTER_WIDE | {("ServiceAccount", "vsurge-system", "vsurge-operator")},
    "gateway": _CLUSTER_WIDE
    | {
        ("ServiceAccount", "vsurge-system", "vsurge-operator"),
        ("Secret", "vsurge-system", "vsurge-router-api-keys"),
        ("InferenceModel", "vsurge-system", "smollm2"),
        # the pools are the operator's (one per InferenceModel); the chart routes to them and runs the picker
        ("HTTPRoute", "vsurge-system", "smollm2"),
        ("HTTPRoute", "team-b", "qwen"),
        ("Service", "vsurge-system", "vsurge-epp"),
    },
    "gateway-llmd": _CLUSTER_WIDE
    | _LLMD
    | {
        ("ServiceAccount", "vsurge-system", "vsurge-operator"),
        ("InferenceModel", "vsurge-system", "smollm2"),
        ("HTTPRoute", "vsurge-system", "smollm2"),
        ("HTTPRoute", "team-b", "qwen"),
    },
    "all-options": _CLUSTER_WIDE
    | {
        ("ServiceAccount", "vsurge-system", "vsurge-operator-sa"),
        ("ConfigMap", "vsurge-system", "vsurge-router"),
        ("Ingress", "vsurge-system", "vsurge-router"),
        ("ServiceMonitor", "vsurge-system", "vsurge-router"),
        ("ServiceMonitor", "vsurge-system", "vsurge-models"),
        ("PodMonitoring", "vsurge-system", "vsurge-router"),
        ("ClusterPodMonitoring", None, "vsurge-models"),
        ("InferenceModel", "vsurge-system", "smollm2"),
        ("InferenceModel", "vsurge-system", "llama-3-8b"),
        ("ConfigMap", "vsurge-system", "vsurge-dashboards"),
        ("PrometheusRule", "vsurge-system", "vsurge"),
        ("ServiceMonitor", "vsurge-system", "vsurge-operator"),
        ("PodMonitoring", "vsurge-system", "vsurge-operator"),
    },
    "namespaced": {
        ("ServiceAccount", "team-a", "vsurge-operator"),
        ("ServiceAccount", "team-a", "vsurge-router"),
        ("ClusterRole", None, "vsurge-operator"),
        ("ClusterRole", None, "vsurge-inferencemodels-edit"),
        ("ClusterRole", None, "vsurge-inferencemodels-view"),
        ("ClusterRoleBinding", None, "vsurge-operator"),
        ("Role", "team-a", "vsurge-operator"),
        ("Role", "team-b", "vsurge-operator"),
        ("RoleBinding", "team-a", "vsurge-operator"),
        ("RoleBinding", "team-b", "vsurge-operator"),
        ("Role", "team-a", "vsurge-router"),
        ("Role", "team-b", "vsurge-router"),
        ("RoleBinding", "team-a", "vsurge-router"),
        ("RoleBinding", "team-b", "vsurge-router"),
        ("KopfPeering", "team-a", "vsurge-operator"),
        ("KopfPeering", "team-b", "vsurge-operator"),
        ("PodDisruptionBudget", "team-a", "vsurge-operator"),
        ("Deployment", "team-a", "vsurge-operator"),
        ("Deployment", "team-a", "vsurge-router"),
        ("Service", "team-a", "vsurge-router"),
        ("PodDisruptionBudget", "team-a", "vsurge-router"),
        ("ServiceMonitor", "team-a", "vsurge-router"),
        ("ServiceMonitor", "team-a", "vsurge-models"),
        ("PodMonitoring", "team-a", "vsurge-router"),
        ("PodMonitoring", "team-a", "vsurge-models"),
        ("PodMonitoring", "team-b", "vsurge-models"),
        ("InferenceModel", "team-a", "smollm2"),
        ("Service", "team-a", "vsurge-operator-metrics"),
        ("ServiceMonitor", "team-a", "vsurge-operator"),
        ("PodMonitoring", "team-a", "vsurge-operator"),
        *(
            (kind, ns, f"vsurge-{who}-secrets")
            for ns in ("team-a", "team-b")
            for who in ("operator", "router")
            for kind in ("Role", "RoleBinding")
        ),
    },
}

CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ClusterPodMonitoring",
    "ClusterKopfPeering",
    "Namespace",
}


def _pod_specs(r: Rendered) -> list[tuple[str, dict[str, Any]]]:
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in r.of_kind("Deployment")]


def _container(r: Rendered, deployment: str) -> dict[str, Any]:
    (container,) = r.get("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return container


# ---------------------------------------------------------------------------------------------- inventory


def test_inventory(rendered: Rendered) -> None:
    got = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in rendered.objects}
    assert len(got) == len(rendered.objects), "two rendered objects share kind, namespace and name"
    assert got == INVENTORY[rendered.name]


def test_namespaced_objects_carry_their_namespace(rendered: Rendered) -> None:
    for obj in rendered.objects:
        ns = obj["metadata"].get("namespace")
        if obj["kind"] in CLUSTER_SCOPED:
            assert ns is None, f"cluster-scoped {obj['kind']} {obj['metadata']['name']} has a namespace"
        else:
            assert ns, (
                f"{obj['kind']} {obj['metadata']['name']} has no namespace (kubectl apply would misplace it)"
            )


# ------------------------------------------------------------------------------------ Kubernetes schemas


def test_builtin_objects_valid_against_kubernetes_1_30(rendered: Rendered) -> None:
    validated = 0
    for obj in rendered.objects:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue  # checked against their CRDs below
        try:
            version = kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(
                f"{obj['apiVersion']} {obj['kind']} is neither a Kubernetes 1.30 kind nor a known CRD kind"
            )
        except jsonschema.ValidationError as err:  # kubernetes-validate raises jsonschema's own error
            path = ".".join(str(p) for p in err.path)
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {path}: {err.message}")
        assert version == "1.30"
        validated += 1
    assert validated >= 8


def test_the_validator_rejects_a_broken_object(renders: dict[str, Rendered]) -> None:
    """Control: kubernetes-validate really checks (an unknown field and a wrong type are caught)."""
    deployment = copy.deepcopy(renders["defaults"].get("Deployment", "vsurge-router"))
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["template"]["spec"]["containers"][0]["securityContexts"] = {}
    with pytest.raises(jsonschema.ValidationError, match="securityContexts"):
        kubernetes_validate.validate(unknown, K8S_VERSION, strict=True)
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="'two'"):
        kubernetes_validate.validate(wrong_type, K8S_VERSION, strict=True)


def test_crd_is_the_chart_crd(chart: helm_python.Chart, crd: dict[str, Any]) -> None:
    names = [c["filename"] for c in chart.crds]
    assert any(n.endswith(CRD_PATH.name) for n in names), f"Helm does not see the CRD under crds/: {names}"
    assert kubernetes_validate.validate(crd, K8S_VERSION, strict=True) == "1.30"
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "inferencemodels.vsurge.io"
    assert spec["group"] == "vsurge.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceModel" and spec["names"]["plural"] == "inferencemodels"
    (version,) = [v for v in spec["versions"] if v["name"] == "v1alpha1"]
    assert version["served"] and version["storage"]
    # The RBAC rules grant inferencemodels/status and inferencemodels/scale: both must exist.
    assert "status" in version["subresources"] and "scale" in version["subresources"]


def _crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def _pruned(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths of ``value`` the structural ``schema`` does not declare (what the API server would prune)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out = []
        for key, child in value.items():
            if path == "" and key in ("apiVersion", "kind", "metadata"):
                continue
            if key in props:
                out += _pruned(child, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += _pruned(child, extra, f"{path}.{key}")
            else:
                out.append(f"{path}.{key}")
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [p for i, item in enumerate(value) for p in _pruned(item, schema["items"], f"{path}[{i}]")]
    return []


def test_models_valid_against_crd(renders: dict[str, Rendered], crd: dict[str, Any]) -> None:
    schema = _crd_schema(crd)
    # A CRD's openAPIV3Schema is OpenAPI 3.0's dialect: boolean exclusiveMinimum/exclusiveMaximum, as in draft 4.
    validator = jsonschema.Draft4Validator(schema)
    models = renders["all-options"].of_kind("InferenceModel") + renders["namespaced"].of_kind(
        "InferenceModel"
    )
    assert len(models) == 3
    for model in models:
        errors = sorted(validator.iter_errors(model), key=lambda e: list(e.path))
        assert not errors, f"{model['metadata']['name']}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors
        )
    # The API server silently prunes fields its structural schema does not declare: none may be lost.
    for model in models:
        assert _pruned(model, schema) == [], f"{model['metadata']['name']}: fields the API server would drop"
    assert _pruned({"spec": {"modle": {}}}, schema) == [".spec.modle"]
    # Control: the CRD schema does reject something.
    broken = copy.deepcopy(models[0])
    broken["spec"] = "not an object"
    assert list(validator.iter_errors(broken))


GATEWAY_CRDS = CHART_DIR.parents[1] / "tests" / "fixtures" / "gateway-crds"


def _released_crd_schema(filename: str) -> dict[str, Any]:
    crd = yaml.safe_load((GATEWAY_CRDS / filename).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def test_gateway_objects(renders: dict[str, Rendered]) -> None:
    """router.mode gateway: each HTTPRoute is valid against Gateway API's released CRD (v1.6.1 standard
    channel; vendored in tests/fixtures, applied to the real API server by tests/cluster), loses no field
    to pruning and routes to the InferencePool the operator renders for the model (valid against the
    extension's released v1.6.0 CRD, its selector the operator's serving pods), whose endpoint picker is
    the router's own Service here, on the router pods' ext_proc port."""
    from vsurge_operator import gateway as opgateway
    from vsurge_operator import spec as opspec
    from vsurge_operator.config import OperatorConfig
    from vsurge_operator.reconcile import Reconciler

    r = renders["gateway"]
    pool_schema = _released_crd_schema("inferencepools.inference.networking.k8s.io.yaml")
    route_schema = _released_crd_schema("httproutes.gateway.networking.k8s.io.yaml")
    routes = r.of_kind("HTTPRoute")
    assert len(routes) == 2 and not r.of_kind("InferencePool")  # the pools are the operator's
    # the operator's settings, from the environment the chart gives it
    env = {e["name"]: e.get("value") for e in _container(r, "vsurge-operator")["env"] if "value" in e}
    config = OperatorConfig.from_env(env)
    assert config.inference_pool and config.endpoint_picker == "vsurge-epp"
    _, defaults = Reconciler(None, config).surroundings()  # type: ignore[arg-type]
    served = {"smollm2": "smollm2", "qwen": "qwen-2.5-7b"}
    for route in routes:
        name, ns = route["metadata"]["name"], route["metadata"]["namespace"]
        errors = list(jsonschema.Draft4Validator(route_schema).iter_errors(route))
        assert not errors, f"HTTPRoute {name}: {[e.message for e in errors]}"
        assert _pruned(route, route_schema) == [], f"HTTPRoute {name}: fields the server drops"
        (rule,) = route["spec"]["rules"]
        assert rule["backendRefs"] == [
            {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name}
        ]
        assert rule["matches"][0]["headers"] == [
            {"type": "Exact", "name": "X-Gateway-Model-Name", "value": served[name]}
        ]
        assert route["spec"]["parentRefs"] == [{"name": "inference-gateway", "sectionName": "http"}]
        body = {
            "metadata": {"name": name, "namespace": ns, "uid": "u"},
            "spec": {"model": {"source": "default"}},
        }
        pool = opgateway.inference_pool(opspec.parse(body, default_image="img"), defaults)
        assert pool is not None
        errors = list(jsonschema.Draft4Validator(pool_schema).iter_errors(pool))
        assert not errors and _pruned(pool, pool_schema) == [], f"InferencePool {name}: {errors}"
        assert pool["spec"]["endpointPickerRef"] == {
            "name": "vsurge-epp",
            "port": {"number": 9002},
            "failureMode": "FailOpen",
        }
    picker = r.get("Service", "vsurge-epp")
    assert (
        picker["spec"]["ports"][0]["targetPort"] == "ext-proc" and picker["spec"]["ports"][0]["port"] == 9002
    )
    router_ports = {p["name"]: p["containerPort"] for p in _container(r, "vsurge-router")["ports"]}
    assert router_ports["ext-proc"] == 9002
    router_labels = r.get("Deployment", "vsurge-router")["spec"]["template"]["metadata"]["labels"]
    assert picker["spec"]["selector"].items() <= router_labels.items()
    # Control: the released schemas do reject something.
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"number": 0}]
    assert list(jsonschema.Draft4Validator(pool_schema).iter_errors(broken))
    # The other scenarios route nothing through a Gateway.
    assert not any(renders[n].of_kind("HTTPRoute") for n in ("defaults", "all-options", "namespaced"))


def test_llmd_endpoint_picker(renders: dict[str, Rendered]) -> None:
    """endpointPicker.type llm-d: llm-d's inference scheduler per listed model, named as the operator's
    pools name it (`<model>-epp`), configured for `vsurge serve`: its pool, the pods' metrics port (11557,
    not the pool's 11556), llm-d's scorers (queue, KV use, prefix, LoRA); the pods carry the engine-type
    label it reads. Its image cannot run here: the objects are validated (Kubernetes schemas, and on the
    real API server by tests/cluster)."""
    from vsurge_operator import gateway as opgateway
    from vsurge_operator import manifests
    from vsurge_operator import spec as opspec
    from vsurge_operator.config import OperatorConfig
    from vsurge_operator.reconcile import Reconciler

    r = renders["gateway-llmd"]
    env = {e["name"]: e.get("value") for e in _container(r, "vsurge-operator")["env"] if "value" in e}
    _, defaults = Reconciler(None, OperatorConfig.from_env(env)).surroundings()  # type: ignore[arg-type]
    for model, ns in (("smollm2", "vsurge-system"), ("qwen", "team-b")):
        body = {
            "metadata": {"name": model, "namespace": ns, "uid": "u"},
            "spec": {"model": {"source": "default"}},
        }
        m = opspec.parse(body, default_image="img")
        pool = opgateway.inference_pool(m, defaults)
        assert pool is not None and pool["spec"]["endpointPickerRef"]["name"] == f"{model}-epp"
        deployment = r.get("Deployment", f"{model}-epp", namespace=ns)
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        assert c["image"] == "ghcr.io/llm-d/llm-d-inference-scheduler:v0.7.1"
        assert f"--pool-name={model}" in c["args"] and f"--pool-namespace={ns}" in c["args"]
        assert "--model-server-metrics-port=11557" in c["args"]
        config = yaml.safe_load(r.get("ConfigMap", f"{model}-epp", namespace=ns)["data"]["epp.yaml"])
        assert config["kind"] == "EndpointPickerConfig"
        types = {p["type"] for p in config["plugins"]}
        assert {
            "queue-scorer",
            "kv-cache-utilization-scorer",
            "prefix-cache-scorer",
            "lora-affinity-scorer",
        } <= types
        service = r.get("Service", f"{model}-epp", namespace=ns)
        assert service["spec"]["ports"][0]["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"]
        assert (
            service["spec"]["selector"].items()
            <= deployment["spec"]["template"]["metadata"]["labels"].items()
        )
        labels = manifests.pod_template(m)["metadata"]["labels"]
        assert labels["llm-d.ai/engine-type"] == "vllm"
        role = r.get("Role", f"{model}-epp", namespace=ns)
        assert {"pods", "inferencepools"} <= {res for rule in role["rules"] for res in rule["resources"]}
    # no router picker port when llm-d picks
    assert "--ext-proc-port=9002" not in _container(r, "vsurge-router")["args"]


# Fields of the upstream CRDs that the chart sets (Prometheus Operator ServiceMonitor, and Google Cloud Managed
# Service for Prometheus PodMonitoring / ClusterPodMonitoring), with their types and required keys.
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"type": "string"},
                    "values": {"type": "array"},
                },
            },
        },
    },
}
_META = {"type": "object", "required": ["name"]}


def _monitor_schema(
    port: dict[str, Any], spec: dict[str, Any] | None = None, endpoint: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A monitor kind: metadata, a selector, endpoints by ``port`` with path and interval; plus the kind's
    own ``spec`` and ``endpoint`` fields."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "additionalProperties": False,
                "properties": {
                    "selector": _SELECTOR,
                    **(spec or {}),
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["port"],
                            "additionalProperties": False,
                            "properties": {
                                "port": port,
                                "path": {"type": "string"},
                                "interval": _DURATION,
                                **(endpoint or {}),
                            },
                        },
                    },
                },
            },
        },
    }


SERVICE_MONITOR = _monitor_schema(
    {"type": "string"},
    spec={
        "namespaceSelector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "any": {"type": "boolean"},
                "matchNames": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
    endpoint={"scrapeTimeout": _DURATION},
)
POD_MONITORING = _monitor_schema({"type": ["string", "integer"]})
MONITOR_SCHEMAS = {
    "ServiceMonitor": SERVICE_MONITOR,
    "PodMonitoring": POD_MONITORING,
    "ClusterPodMonitoring": POD_MONITORING,
}


def test_monitors_valid(rendered: Rendered) -> None:
    monitors = [o for o in rendered.objects if o["kind"] in MONITOR_SCHEMAS]
    if rendered.name in ("defaults", "gateway", "gateway-llmd"):  # no monitoring asked for
        assert monitors == []
        return
    assert monitors
    for monitor in monitors:
        jsonschema.validate(monitor, MONITOR_SCHEMAS[monitor["kind"]])
        kubernetes_validate.validate(  # the metadata, at least, is a Kubernetes ObjectMeta
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": monitor["metadata"]},
            K8S_VERSION,
            strict=True,
        )


def test_monitors_point_at_real_ports(renders: dict[str, Rendered]) -> None:
    for name in ("all-options", "namespaced"):
        r = renders[name]
        service = r.get("Service", "vsurge-router")
        port_names = {p["name"] for p in service["spec"]["ports"]}
        sm = r.get("ServiceMonitor", "vsurge-router")
        assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= port_names
        pod_labels = r.get("Deployment", "vsurge-router")["spec"]["template"]["metadata"]["labels"]
        pm = r.get("PodMonitoring", "vsurge-router", r.namespace)
        assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        container_ports = {p["name"] for p in _container(r, "vsurge-router")["ports"]}
        assert {e["port"] for e in pm["spec"]["endpoints"]} <= container_ports
        # The model Services the operator creates have ports "http" and "metrics" (issue 6).
        models_sm = r.get("ServiceMonitor", "vsurge-models")
        assert [e["port"] for e in models_sm["spec"]["endpoints"]] == ["metrics"]
        expected = r.values["monitoring"].get("modelSelector", DEFAULT_VALUES["monitoring"]["modelSelector"])
        assert models_sm["spec"]["selector"] == expected
    assert renders["all-options"].get("ServiceMonitor", "vsurge-models")["spec"]["namespaceSelector"] == {
        "any": True
    }
    assert renders["namespaced"].get("ServiceMonitor", "vsurge-models")["spec"]["namespaceSelector"] == {
        "matchNames": ["team-a", "team-b"]
    }
    cpm = renders["all-options"].get("ClusterPodMonitoring", "vsurge-models")
    assert cpm["spec"]["endpoints"][0]["port"] == 11557


# ------------------------------------------------------------------------------------------------- labels


def test_standard_labels(rendered: Rendered) -> None:
    common = rendered.values.get("commonLabels", {})
    for obj in rendered.objects:
        labels = obj["metadata"].get("labels", {})
        where = f"{obj['kind']} {obj['metadata']['name']}"
        assert labels.get("app.kubernetes.io/name") == "vsurge", where
        assert labels.get("app.kubernetes.io/instance") == RELEASE, where
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", where
        assert labels.get("app.kubernetes.io/version") == CHART_META["appVersion"], where
        assert labels.get("app.kubernetes.io/part-of") == "vsurge", where
        assert labels.get("app.kubernetes.io/component"), where
        assert labels.get("helm.sh/chart") == f"vsurge-{CHART_META['version']}", where
        assert common.items() <= labels.items(), where


def test_selectors_match_their_pods(rendered: Rendered) -> None:
    for deployment in rendered.of_kind("Deployment"):
        selector = deployment["spec"]["selector"]["matchLabels"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
        # Selectors must not contain labels that change on upgrade (immutable in a Deployment).
        assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(selector)
        others = [d for d in rendered.of_kind("Deployment") if d is not deployment]
        for other in others:  # a selector must not catch the pods of the other Deployment
            assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items()
    router_pods = rendered.get("Deployment", "vsurge-router")["spec"]["template"]["metadata"]["labels"]
    assert rendered.get("Service", "vsurge-router")["spec"]["selector"].items() <= router_pods.items()
    pdb = rendered.get("PodDisruptionBudget", "vsurge-router")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= router_pods.items()


# --------------------------------------------------------------------------------------- pod hardening


def test_pods_are_hardened(rendered: Rendered) -> None:
    specs = _pod_specs(rendered)
    pickers = {"smollm2-epp", "qwen-epp"} if rendered.name == "gateway-llmd" else set()
    assert {name for name, _ in specs} == {"vsurge-operator", "vsurge-router"} | pickers
    for name, spec in specs:
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True, name
        assert pod["runAsUser"] > 0 and pod["runAsGroup"] > 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key), name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert not sc.get("privileged"), name
            requests = container["resources"]["requests"]
            assert requests.get("cpu") and requests.get("memory"), name
            assert "memory" in container["resources"].get("limits", {}), name
            if name in pickers:  # llm-d's picker writes nothing (its image's own layout)
                continue
            (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert "emptyDir" in volumes[tmp["name"]], name
            assert container["imagePullPolicy"] in {"Always", "IfNotPresent", "Never"}


def test_pods_run_as_the_images_user(rendered: Rendered) -> None:
    uids = {final_user(path)[0] for path in DOCKERFILES.values()}
    assert len(uids) == 1
    (uid,) = uids
    for name, spec in _pod_specs(rendered):
        assert spec["securityContext"]["runAsUser"] == int(uid), name


# ------------------------------------------------------------------------------------- operator, router


def test_operator_arguments(renders: dict[str, Rendered]) -> None:
    for name, r in renders.items():
        c = _container(r, "vsurge-operator")
        op = r.values.get("operator", {})
        port = op.get("healthPort", 8080)
        assert f"--liveness=http://0.0.0.0:{port}/healthz" in c["args"], name
        assert [p["containerPort"] for p in c["ports"] if p["name"] == "health"] == [port]
        metrics_port = op.get("metricsPort", 8081)
        assert f"--metrics-port={metrics_port}" in c["args"], name
        assert [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"] == [metrics_port]
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, (name, probe)
        # Several replicas, one active through kopf peering on the chart's own peering object.
        deployment = r.get("Deployment", "vsurge-operator")
        assert deployment["spec"]["replicas"] == op.get("replicas", 2)
        assert deployment["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
        assert "--peering=vsurge-operator" in c["args"]
        assert f"--peering-lifetime={op.get('peeringLifetimeSeconds', 15)}" in c["args"]
    peering = "--peering=vsurge-operator"
    tail = ["--peering-lifetime=15", "--metrics-port=8081"]
    assert _container(renders["defaults"], "vsurge-operator")["args"] == [
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
        peering,
        *tail,
    ]
    assert _container(renders["namespaced"], "vsurge-operator")["args"] == [
        "--namespace=team-a",
        "--namespace=team-b",
        "--liveness=http://0.0.0.0:8080/healthz",
        peering,
        *tail,
    ]
    assert _container(renders["all-options"], "vsurge-operator")["args"][-1] == "--verbose"


def test_operator_high_availability(renders: dict[str, Rendered]) -> None:
    d = renders["defaults"]
    pdb = d.get("PodDisruptionBudget", "vsurge-operator")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == d.get("Deployment", "vsurge-operator")["spec"]["selector"]
    # By default the replicas prefer different nodes; a user's affinity replaces that.
    anti = d.get("Deployment", "vsurge-operator")["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    a = renders["all-options"]
    assert (
        "podAntiAffinity"
        not in a.get("Deployment", "vsurge-operator")["spec"]["template"]["spec"]["affinity"]
    )
    assert a.get("PodDisruptionBudget", "vsurge-operator")["spec"]["minAvailable"] == 2
    # The peering object the replicas elect on: cluster-wide, or one per watched namespace.
    assert a.get("ClusterKopfPeering", "vsurge-operator")
    n = renders["namespaced"]
    assert {o["metadata"]["namespace"] for o in n.of_kind("KopfPeering")} == {"team-a", "team-b"}
    crds = [
        yaml.safe_load((CHART_DIR / "crds" / f"{plural}.kopf.dev.yaml").read_text())
        for plural in ("clusterkopfpeerings", "kopfpeerings")
    ]
    assert {(c["spec"]["names"]["kind"], c["spec"]["scope"]) for c in crds} == {
        ("ClusterKopfPeering", "Cluster"),
        ("KopfPeering", "Namespaced"),
    }


def test_router_arguments(renders: dict[str, Rendered]) -> None:
    c = _container(renders["defaults"], "vsurge-router")
    # a drain as long as the longest model drain (120 s) and more; the tenants' limits split over 2 replicas
    assert c["args"] == ["route", "--port=8080", "--drain-timeout-seconds=130", "--tenant-limit-replicas=2"]
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    # preStop: out of the Service's endpoints before SIGTERM; the grace covers the hook and the drain
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["python", "-c", "import time; time.sleep(5)"]
    grace = renders["defaults"].get("Deployment", "vsurge-router")["spec"]["template"]["spec"]
    assert grace["terminationGracePeriodSeconds"] == 150 >= 5 + 130
    assert c["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    service = renders["defaults"].get("Service", "vsurge-router")
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]

    assert _container(renders["namespaced"], "vsurge-router")["args"] == [
        "route",
        "--port=8080",
        "--drain-timeout-seconds=130",
        "--tenant-limit-replicas=2",
        "--namespace=team-a",
        "--namespace=team-b",
    ]

    r = renders["all-options"]
    c = _container(r, "vsurge-router")
    assert c["args"] == [
        "route",
        "--port=9090",
        "--drain-timeout-seconds=160",
        "--tenant-limit-replicas=3",
        "--static-config=/etc/vsurge/static-config.yaml",
        "--log-level=debug",
    ]
    assert c["ports"][0]["containerPort"] == 9090
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/vsurge")
    assert mount["readOnly"] is True
    spec = r.get("Deployment", "vsurge-router")["spec"]
    volume = next(v for v in spec["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = r.get("ConfigMap", volume["configMap"]["name"])
    assert yaml.safe_load(config_map["data"]["static-config.yaml"]) == r.values["router"]["staticConfig"]
    assert "checksum/static-config" in spec["template"]["metadata"]["annotations"]
    assert spec["replicas"] == 3
    assert r.get("PodDisruptionBudget", "vsurge-router")["spec"]["maxUnavailable"] == "50%"


def test_router_tenants_and_routing(renders: dict[str, Rendered]) -> None:
    """The gateway scenario's router: routing flags, and the tenants' Secret mounted where --api-keys-file
    points, holding a file the router's own parser accepts."""
    from vsurge.router.tenants import parse_api_keys_text

    r = renders["gateway"]
    c = _container(r, "vsurge-router")
    assert c["args"] == [
        "route",
        "--port=8080",
        "--drain-timeout-seconds=130",
        "--tenant-limit-replicas=2",
        # the router is the pools' endpoint picker (router.gateway.endpointPicker.type vsurge)
        "--ext-proc-port=9002",
        "--routing=prefix",
        "--prefix-epsilon=0.5",
        "--api-keys-file=/etc/vsurge-api-keys/api-keys.yaml",
    ]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": "/etc/vsurge-api-keys", "readOnly": True}
    volume = next(
        v
        for v in r.get("Deployment", "vsurge-router")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "api-keys"
    )
    secret = r.get("Secret", volume["secret"]["secretName"])
    ring = parse_api_keys_text(base64.b64decode(secret["data"]["api-keys.yaml"]).decode())
    assert set(ring.tenants) == {"team-a", "batch"}
    assert ring.authenticate("sk-batch-0123456789abcdef").name == "batch"
    assert ring.tenants["team-a"].models == frozenset({"smollm2"}) and ring.tenants["team-a"].burst == 10
    # An existing Secret instead: no Secret rendered, the router reads that one.
    values = load_values("gateway-values.yaml")
    values["router"]["apiKeys"] = {"existingSecret": "my-keys", "secretKey": "keys.yaml"}
    other = render(helm_python.Chart.load(CHART_DIR), values, "vsurge-system")
    assert not other.of_kind("Secret")
    spec = other.get("Deployment", "vsurge-router")["spec"]["template"]["spec"]
    assert {"name": "api-keys", "secret": {"secretName": "my-keys", "defaultMode": 0o440}} in spec["volumes"]
    assert "--api-keys-file=/etc/vsurge-api-keys/keys.yaml" in spec["containers"][0]["args"]


def test_router_arguments_parse_with_the_router_cli(renders: dict[str, Rendered]) -> None:
    import argparse

    from vsurge.router.config import add_arguments, config_from_args

    for name, r in renders.items():
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        cfg = config_from_args(parser.parse_args(_container(r, "vsurge-router")["args"][1:]), {})
        if name == "gateway":
            assert (cfg.routing, cfg.prefix_epsilon) == ("prefix", 0.5) and cfg.api_keys_file
        else:
            assert (cfg.routing, cfg.prefix_epsilon, cfg.api_keys_file) == (None, 0.25, None)


def test_images(renders: dict[str, Rendered]) -> None:
    app = CHART_META["appVersion"]
    d = renders["defaults"]
    assert _container(d, "vsurge-operator")["image"] == f"ghcr.io/vsurge-stack/vsurge-operator:{app}"
    # the router's own lean image (docker/router.Dockerfile), not the service image
    assert _container(d, "vsurge-router")["image"] == f"ghcr.io/vsurge-stack/vsurge-router:{app}"
    a = renders["all-options"]
    digest = a.values["images"]["operator"]["digest"]
    assert _container(a, "vsurge-operator")["image"].endswith(f"/vsurge-operator@{digest}")
    assert (
        _container(a, "vsurge-router")["image"] == "europe-docker.pkg.dev/example/vsurge/vsurge-router:0.1.0"
    )
    assert _container(a, "vsurge-router")["imagePullPolicy"] == "Always"
    for name, spec in _pod_specs(a):
        assert spec["imagePullSecrets"] == [{"name": "regcred"}], name
    # A listed model without an image is left to the operator, which picks images.model.<accelerator>.
    assert "image" not in a.get("InferenceModel", "smollm2")["spec"]
    assert "image" not in n_model(renders)["spec"]
    for r, prefix in ((d, "ghcr.io/vsurge-stack/"), (a, "europe-docker.pkg.dev/example/vsurge/")):
        env = {e["name"]: e.get("value") for e in _container(r, "vsurge-operator")["env"]}
        if r is d:
            assert env["VSURGE_OPERATOR_IMAGE_TPU"] == f"{prefix}vsurge-service:{app}"
            assert env["VSURGE_OPERATOR_IMAGE_GPU"] == f"{prefix}vsurge-service-cuda:{app}"
            assert env["VSURGE_OPERATOR_IMAGE_CPU"] == f"{prefix}vsurge-service-cpu:{app}"
        else:
            assert env["VSURGE_OPERATOR_IMAGE_TPU"] == f"{prefix}vsurge-service:0.1.0-tpu"
            assert env["VSURGE_OPERATOR_IMAGE_GPU"] == f"{prefix}vsurge-service:0.1.0-cuda"
            assert env["VSURGE_OPERATOR_IMAGE_CPU"] == f"{prefix}vsurge-service:0.1.0-cpu"
    # ...read by the operator's own configuration as the image per accelerator.
    from vsurge_operator.config import OperatorConfig

    env = {e["name"]: e.get("value") for e in _container(d, "vsurge-operator")["env"] if "value" in e}
    images = OperatorConfig.from_env(env).model_images()
    assert images["gpu"] == f"ghcr.io/vsurge-stack/vsurge-service-cuda:{app}"


def n_model(renders: dict[str, Rendered]) -> dict[str, Any]:
    return renders["namespaced"].get("InferenceModel", "smollm2")


def test_models_from_values(renders: dict[str, Rendered]) -> None:
    r = renders["all-options"]
    listed = {m["name"]: m for m in r.values["models"]}
    for model in r.of_kind("InferenceModel"):
        source = listed[model["metadata"]["name"]]
        assert model["spec"] == source["spec"]
        assert model["metadata"]["namespace"] == r.namespace
        assert source.get("labels", {}).items() <= model["metadata"]["labels"].items()
        assert model["metadata"].get("annotations", {}) == source.get("annotations", {})


def test_tracing_environment(renders: dict[str, Rendered]) -> None:
    for name in ("operator", "router"):
        env = {e["name"]: e for e in _container(renders["all-options"], f"vsurge-{name}")["env"]}
        assert env["OTEL_SERVICE_NAME"]["value"] == f"vsurge-{name}"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability:4317"
        assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
        assert float(env["OTEL_TRACES_SAMPLER_ARG"]["value"]) == 0.25
        assert env["OTEL_PROPAGATORS"]["value"] == "tracecontext,baggage"
        attrs = env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
        for attr in (
            "k8s.namespace.name=$(POD_NAMESPACE)",
            "k8s.pod.name=$(POD_NAME)",
            "k8s.node.name=$(NODE_NAME)",
        ):
            assert attr in attrs
        # $(VAR) references only work for variables defined earlier in the list.
        names = list(env)
        assert max(names.index(v) for v in ("POD_NAMESPACE", "POD_NAME", "NODE_NAME")) < names.index(
            "OTEL_RESOURCE_ATTRIBUTES"
        )
        default_env = {e["name"] for e in _container(renders["defaults"], f"vsurge-{name}")["env"]}
        assert not any(n.startswith("OTEL_") for n in default_env)
        assert {"HOME", "POD_NAME", "POD_NAMESPACE"} <= default_env


def test_ingress(renders: dict[str, Rendered]) -> None:
    r = renders["all-options"]
    ingress = r.get("Ingress", "vsurge-router")
    service = r.get("Service", "vsurge-router")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"secretName": "llm-example-tls", "hosts": ["llm.example.com"]}]
    rules = ingress["spec"]["rules"]
    assert [rule.get("host") for rule in rules] == ["llm.example.com", None]
    for rule in rules:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == service["metadata"]["name"]
            assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"


def test_notes_tell_how_to_call_the_endpoint(renders: dict[str, Rendered]) -> None:
    d = renders["defaults"].notes
    assert "kubectl port-forward -n vsurge-system svc/vsurge-router 8080:80" in d
    assert "curl -s http://localhost:8080/v1/models" in d
    assert "http://localhost:8080/v1/chat/completions" in d
    assert 'base_url="http://localhost:8080/v1"' in d
    assert "every namespace" in d
    a = renders["all-options"].notes
    assert "https://llm.example.com/v1" in a and '"model": "smollm2"' in a
    n = renders["namespaced"].notes
    assert "team-a, team-b" in n and "kubectl apply -n team-a" in n


# ------------------------------------------------------------------------------------------- helm lint


def test_chart_metadata() -> None:
    assert CHART_META["apiVersion"] == "v2" and CHART_META["name"] == "vsurge"
    assert CHART_META["type"] == "application"
    # helm refuses to install where kubeVersion does not match: the version the objects are validated for must.
    constraint = re.fullmatch(r">=\s*(\d+)\.(\d+)\.(\d+)(-0)?", CHART_META["kubeVersion"])
    assert constraint, f"unexpected kubeVersion constraint {CHART_META['kubeVersion']!r}"
    minimum = tuple(int(x) for x in constraint.groups()[:3])
    assert minimum <= tuple(int(x) for x in K8S_VERSION.split(".")), "the chart would refuse Kubernetes 1.30"
    assert re.fullmatch(r"\d+\.\d+\.\d+", CHART_META["version"]), "the chart version is SemVer"


LINT_INFO_ALLOWED = {"icon is recommended"}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_helm_lint_clean(scenario: str) -> None:
    filename, namespace = SCENARIOS[scenario]
    report = helm_python.lint(
        CHART_DIR, load_values(filename), strict=True, namespace=namespace, kube_version=f"v{K8S_VERSION}"
    )
    assert report["errors"] == []
    assert report["total_charts_linted"] == 1
    for message in report["messages"]:
        assert message["severity"] <= 1 and message["error"] in LINT_INFO_ALLOWED, message


def test_helm_lint_reports_bad_values() -> None:
    """Control: the same lint call does report a problem."""
    report = helm_python.lint(
        CHART_DIR, {"router": {"replicas": "many"}}, strict=True, kube_version=f"v{K8S_VERSION}"
    )
    assert report["errors"]
    assert any(m["severity"] == 3 and "/router/replicas" in m["error"] for m in report["messages"])


# -------------------------------------------------------------------------------------- values schema

WRONG_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"router": {"replicas": "two"}}, "/router/replicas"),
    ({"router": {"replicas": -1}}, "/router/replicas"),
    ({"router": {"port": 70000}}, "/router/port"),
    ({"router": {"service": {"type": "Internal"}}}, "/router/service/type"),
    ({"router": {"ingress": {"enabled": "yes"}}}, "/router/ingress/enabled"),
    (
        {"router": {"ingress": {"hosts": [{"host": "x.example.com", "paths": [{"path": "v1"}]}]}}},
        "/router/ingress/hosts/0/paths/0",
    ),
    ({"router": {"resources": {"requests": {"cpu": "lots"}}}}, "/router/resources/requests/cpu"),
    (
        {"router": {"podDisruptionBudget": {"maxUnavailable": "half"}}},
        "/router/podDisruptionBudget/maxUnavailable",
    ),
    ({"router": {"replica": 2}}, "replica"),
    ({"operator": {"healthPort": "8080"}}, "/operator/healthPort"),
    ({"operator": {"extraArgs": "--verbose"}}, "/operator/extraArgs"),
    ({"operator": {"extraEnv": [{"value": "x"}]}}, "/operator/extraEnv/0"),
    ({"images": {"service": {"tag": 1.5}}}, "/images/service/tag"),
    ({"images": {"operator": {"pullPolicy": "Sometimes"}}}, "/images/operator/pullPolicy"),
    ({"images": {"operator": {"digest": "latest"}}}, "/images/operator/digest"),
    ({"watchNamespaces": "default"}, "/watchNamespaces"),
    ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0"),
    ({"podSecurity": {"runAsUser": 0}}, "/podSecurity/runAsUser"),
    ({"rbac": {"create": "true"}}, "/rbac/create"),
    ({"tracing": {"samplingRatio": 2}}, "/tracing/samplingRatio"),
    ({"tracing": {"endpoint": "otel:4317"}}, "/tracing/endpoint"),
    ({"monitoring": {"serviceMonitor": {"interval": 30}}}, "/monitoring/serviceMonitor/interval"),
    ({"monitoring": {"podMonitoring": {"enabled": 1}}}, "/monitoring/podMonitoring/enabled"),
    ({"models": {"smollm2": {}}}, "/models"),
    ({"models": [{"name": "smollm2"}]}, "/models/0"),
    ({"models": [{"name": "SmolLM2", "spec": {}}]}, "/models/0/name"),
    ({"models": [{"name": "smollm2", "spec": "default"}]}, "/models/0/spec"),
    ({"commonLabels": {"team": 7}}, "/commonLabels/team"),
    ({"routr": {}}, "routr"),
    ({"router": {"routing": "fastest"}}, "/router/routing"),
    ({"router": {"prefixEpsilon": 0}}, "/router/prefixEpsilon"),
    ({"router": {"mode": "ingress"}}, "/router/mode"),
    (
        {"router": {"apiKeys": {"tenants": [{"name": "a", "keys": ["short"]}]}}},
        "/router/apiKeys/tenants/0/keys/0",
    ),
    ({"router": {"apiKeys": {"tenants": [{"name": "a"}]}}}, "/router/apiKeys/tenants/0"),
    ({"router": {"gateway": {"parentRefs": []}}}, "/router/gateway/parentRefs"),
    (
        {"router": {"gateway": {"endpointPicker": {"failureMode": "Open"}}}},
        "/router/gateway/endpointPicker/failureMode",
    ),
    ({"router": {"gateway": {"models": [{"name": "Qwen"}]}}}, "/router/gateway/models/0/name"),
]


@pytest.mark.parametrize(("values", "where"), WRONG_VALUES, ids=[w for _, w in WRONG_VALUES])
def test_schema_rejects_wrong_values(chart: helm_python.Chart, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.render(values, name=RELEASE, namespace="vsurge-system")
    assert where in str(err.value), str(err.value)


def test_schema_accepts_documented_values(chart: helm_python.Chart) -> None:
    """Control for the cases above: their right-typed twins render."""
    ok = {
        "router": {
            "replicas": 0,
            "service": {"type": "NodePort"},
            "podDisruptionBudget": {"maxUnavailable": 0},
        },
        "images": {"service": {"tag": "1.5"}},
        "watchNamespaces": ["team-a"],
        "tracing": {"endpoint": "http://otel:4317", "samplingRatio": 1},
    }
    render(chart, ok, "team-a")


# Objects of the schema left open on purpose: Kubernetes types passed through, or user data.
OPEN_OBJECTS = {
    "/properties/global",
    "/properties/operator/properties/affinity",
    "/properties/router/properties/affinity",
    "/properties/router/properties/staticConfig",
    "/properties/models/items/properties/spec",
    "/definitions/objectList/items",
    "/definitions/envList/items",
}


def test_schema_is_strict(chart: helm_python.Chart) -> None:
    schema = chart.schema
    assert schema is not None, "the chart ships no values.schema.json"
    open_found = set()

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        if node.get("type") == "object":
            extra = node.get("additionalProperties", True)
            if extra is True:
                open_found.add(path)
        for key in ("properties", "definitions"):
            for name, child in node.get(key, {}).items():
                walk(child, f"{path}/{key}/{name}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], f"{path}/{key}")
        for key in ("oneOf", "anyOf", "allOf"):
            for i, child in enumerate(node.get(key, [])):
                walk(child, f"{path}/{key}/{i}")
        if path.count("/properties/") and not path.endswith("/items"):
            assert {"type", "$ref", "oneOf", "enum"} & set(node), f"{path} has no type"

    walk(schema, "")
    assert open_found == OPEN_OBJECTS


def test_schema_describes_every_default(chart: helm_python.Chart) -> None:
    """Every key of values.yaml has a place in the schema (a key it lacks would be refused at install)."""
    schema = chart.schema

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        return node

    def walk(values: Any, node: dict[str, Any], path: str) -> None:
        node = resolve(node)
        if isinstance(values, dict) and "properties" in node:
            for key, value in values.items():
                assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
                walk(value, node["properties"][key], f"{path}.{key}")

    walk(chart.values, schema, "")


# ------------------------------------------------------------------------------ checks across values


@pytest.mark.parametrize(
    ("values", "namespace", "message"),
    [
        (
            {"watchNamespaces": ["team-b"], "models": [{"name": "m", "spec": {}}]},
            "team-a",
            "not in watchNamespaces",
        ),
        ({"models": [{"name": "m", "spec": {}}, {"name": "m", "spec": {}}]}, "team-a", "listed twice"),
        ({"router": {"enabled": False, "ingress": {"enabled": True}}}, "team-a", "needs router.enabled"),
        (
            {
                "router": {"mode": "gateway", "ingress": {"enabled": True}},
                "models": [{"name": "m", "spec": {}}],
            },
            "team-a",
            "instead of the router's Ingress",
        ),
        (
            {"router": {"mode": "gateway", "enabled": False}, "operator": {"enabled": True}},
            "team-a",
            "the router's endpoint picker",
        ),
        (
            {"router": {"terminationGracePeriodSeconds": 60}},
            "team-a",
            "at least router.preStopSeconds + router.drainSeconds",
        ),
        (
            {
                "router": {"mode": "gateway", "gateway": {"models": [{"name": "m"}]}},
                "models": [{"name": "m", "spec": {}}],
            },
            "team-a",
            "team-a/m is listed twice",
        ),
    ],
)
def test_inconsistent_values_fail_clearly(
    chart: helm_python.Chart, values: dict[str, Any], namespace: str, message: str
) -> None:
    with pytest.raises(helm_python.HelmRenderError) as err:
        chart.render(values, name=RELEASE, namespace=namespace)
    assert message in str(err.value)


def test_components_can_be_switched_off(chart: helm_python.Chart) -> None:
    r = render(
        chart,
        {
            "operator": {"enabled": False},
            "router": {"enabled": False},
            "rbac": {"aggregateToDefaultRoles": False},
        },
        "vsurge-system",
    )
    assert r.objects == []
    r = render(
        chart,
        {
            "router": {"enabled": False},
            "monitoring": {"serviceMonitor": {"enabled": True}, "podMonitoring": {"enabled": True}},
        },
        "x",
    )
    assert {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in r.objects} == {
        "operator",
        "models",
        "rbac",
    }


# ------------------------------------------------------------------------------------------ the docs

REPO_ROOT = CHART_DIR.parent.parent
KUBERNETES_DOC = REPO_ROOT / "docs" / "kubernetes.md"


def _values_section() -> str:
    """The chart's values table: docs/kubernetes.md from '### Values' to the next heading of its level or above."""
    text = KUBERNETES_DOC.read_text()
    start = text.index("\n", text.index("### Values"))
    end = re.search(r"^#{1,3} ", text[start:], flags=re.MULTILINE)
    return text[start : start + end.start()] if end else text[start:]


def _leaf_paths(values: Any, prefix: str = "") -> list[str]:
    if isinstance(values, dict) and values:
        return [p for key, child in values.items() for p in _leaf_paths(child, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def test_values_table_matches_values_yaml() -> None:
    rows = re.findall(r"^\| `([^`]+)` \|", _values_section(), flags=re.MULTILINE)
    assert rows, "no values table in docs/kubernetes.md"
    assert len(rows) == len(set(rows)), "a key is listed twice"
    leaves = _leaf_paths(DEFAULT_VALUES)
    for leaf in leaves:
        parts = leaf.split(".")
        documented = {".".join(parts[:n]) for n in range(1, len(parts) + 1)} & set(rows)
        assert documented, f"{leaf} is not in docs/kubernetes.md's values table"
    for row in rows:
        assert any(leaf == row or leaf.startswith(row + ".") for leaf in leaves), (
            f"{row} is not in values.yaml"
        )


def test_docs_commands_match_the_chart(renders: dict[str, Rendered]) -> None:
    text = KUBERNETES_DOC.read_text()
    notes = renders["defaults"].notes
    for line in (
        "kubectl port-forward -n vsurge-system svc/vsurge-router 8080:80",
        "curl -s http://localhost:8080/v1/models",
    ):
        assert line in text and line in notes


# ------------------------------------------------------------------ the chart's arguments vs. the real CLIs


def test_operator_arguments_parse_with_the_operator_cli(renders: dict[str, Rendered]) -> None:
    """The chart's arguments, read by the operator's own argument parser (when it can be imported)."""
    try:
        from vsurge_operator.__main__ import build_parser
    except ImportError as err:  # the operator is written by another engineer, and may not import yet
        pytest.skip(
            f"vsurge_operator.__main__.build_parser does not import ({err}); reinstall with pip install -e ."
        )
    parser = build_parser()
    defaults = parser.parse_args(_container(renders["defaults"], "vsurge-operator")["args"])
    assert defaults.all_namespaces and defaults.namespaces == []
    assert defaults.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    namespaced = parser.parse_args(_container(renders["namespaced"], "vsurge-operator")["args"])
    assert namespaced.namespaces == ["team-a", "team-b"] and not namespaced.all_namespaces
    parser.parse_args(_container(renders["all-options"], "vsurge-operator")["args"])  # extraArgs: --verbose
