"""What the operator renders around a model's pods (issue 53): its InferencePool (gateway.py), its
NetworkPolicy (access.py), the Secrets its pods read (model_secrets.py), the per-group budgets of a
multi-host model (disruption.py) and the compile cache's per-pod claim (compile_cache.py). Pure builders
checked against Kubernetes' schemas and the released InferencePool CRD; one reconcile on KMock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import yaml
from kmock_harness import KMockCluster
from kubernetes_validate import utils as kv
from operator_harness import inference_model

from vsurge_operator import access, compile_cache, gateway, kube, manifests, model_secrets, reconcile, spec
from vsurge_operator.config import OperatorConfig

K8S_VERSION = kv.latest_version()
GATEWAY_CRDS = Path(__file__).resolve().parents[1] / "fixtures" / "gateway-crds"
POOL_CRD = GATEWAY_CRDS / "inferencepools.inference.networking.k8s.io.yaml"
REACH = access.Access(
    enabled=True,
    serving_namespaces=("vsurge-system", "gateway"),
    serving_cidrs=("10.129.0.0/23",),
    metrics_namespaces=("monitoring",),
    operator_namespace="vsurge-system",
)


def model(**overrides: Any) -> spec.ModelSpec:
    s: dict[str, Any] = {"model": {"source": "default"}, "image": "img:1"}
    s.update(overrides)
    body = {"metadata": {"name": "llama", "namespace": "team", "uid": "uid-1", "generation": 1}, "spec": s}
    return spec.parse(body)


MULTI = {"accelerator": "tpu-v6e-slice", "topology": "4x4"}


def _pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(POOL_CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def test_inference_pool_selects_serving_pods_and_names_the_picker() -> None:
    schema = _pool_schema()
    on = gateway.PoolDefaults(enabled=True, picker="{model}-epp", port=9002, failure_mode="FailOpen")
    assert gateway.inference_pool(model(), gateway.PoolDefaults()) is None  # the operator's default: off
    assert gateway.inference_pool(model(gateway={"inferencePool": False}), on) is None
    single = gateway.inference_pool(model(), on)
    multi = gateway.inference_pool(model(tpu=MULTI, replicas=2), on)
    for pool in (single, multi):
        assert pool is not None
        assert not list(jsonschema.Draft4Validator(schema).iter_errors(pool))
        assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert pool["spec"]["targetPorts"] == [{"number": 11556}]
        assert pool["spec"]["endpointPickerRef"] == {
            "name": "llama-epp",
            "port": {"number": 9002},
            "failureMode": "FailOpen",
        }
    assert single["spec"]["selector"]["matchLabels"] == manifests.selector_labels(model())
    # multi-host: the leaders only (the workers serve no HTTP)
    assert multi["spec"]["selector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    # the spec's own picker wins over the default
    own = gateway.inference_pool(
        model(gateway={"inferencePool": True, "endpointPicker": {"name": "llmd", "port": 9003}}),
        gateway.PoolDefaults(),
    )
    assert own is not None and own["spec"]["endpointPickerRef"]["name"] == "llmd"
    assert own["spec"]["endpointPickerRef"]["port"] == {"number": 9003}


def test_network_policy_admits_only_the_named_namespaces() -> None:
    pol = access.network_policy(model(), REACH)
    assert pol is not None
    kv.validate(pol, K8S_VERSION, strict=True)
    http, metrics = pol["spec"]["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 11556}]
    assert http["from"] == [
        {
            "namespaceSelector": {
                "matchExpressions": [
                    {
                        "key": "kubernetes.io/metadata.name",
                        "operator": "In",
                        "values": ["gateway", "vsurge-system"],
                    }
                ]
            }
        },
        {"ipBlock": {"cidr": "10.129.0.0/23"}},
    ]
    assert metrics["ports"] == [{"protocol": "TCP", "port": 11557}]
    assert metrics["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == [
        "monitoring",
        "vsurge-system",
    ]
    # nobody named: no rule at all (an empty `from` would admit everyone)
    closed = access.network_policy(model(), access.Access(enabled=True))
    assert closed is not None and closed["spec"]["ingress"] == []
    assert access.network_policy(model(), access.Access()) is None


def test_multi_host_lane_policy_stops_admitting_everyone_when_the_model_policy_decides() -> None:
    m = model(tpu=MULTI, replicas=2)
    objs = manifests.desired_objects(m, reach=REACH)
    lane_pol = next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "llama-lane")
    assert all("from" in rule for rule in lane_pol["spec"]["ingress"])  # its own pods only
    assert any(o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "llama" for o in objs)
    open_lane = next(
        o
        for o in manifests.desired_objects(m)
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "llama-lane"
    )
    assert any("from" not in rule for rule in open_lane["spec"]["ingress"])


def test_pod_env_from_secrets_and_engine_labels() -> None:
    m = model(
        compileCache={"size": "10Gi"},
        apiKeySecret={"name": "llama-key"},
        adminKeySecret={"name": "llama-admin"},
    )
    env = {e["name"]: e for e in manifests.env(m)}
    assert env["VSURGE_CACHE_HMAC_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "llama-cache-key", "key": "hmac.key"}
    }
    assert env["VSURGE_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "llama-key", "key": "api-key"}}
    assert env["VSURGE_ADMIN_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "llama-admin", "key": "admin-key"}
    }
    assert "VSURGE_CACHE_HMAC_KEY" not in {e["name"] for e in manifests.env(model())}
    labels = manifests.pod_template(m)["metadata"]["labels"]
    assert labels["llm-d.ai/engine-type"] == labels["inference.networking.k8s.io/engine-type"] == "vllm"
    secret = model_secrets.cache_key_secret(m)
    kv.validate(secret, K8S_VERSION, strict=True)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_compile_cache_is_a_claim_per_pod_unless_read_write_many() -> None:
    m = compile_cache.with_default(model(compileCache={"size": "10Gi"}), "ReadWriteOnce")
    (vol,) = [v for v in manifests.pod_volumes(m) if v["name"] == "compile-cache"]
    assert vol["ephemeral"]["volumeClaimTemplate"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert not [o for o in manifests.desired_objects(m) if o["kind"] == "PersistentVolumeClaim"]
    kv.validate(manifests.workload(m), K8S_VERSION, strict=True)
    shared = compile_cache.with_default(model(compileCache={"size": "10Gi"}), "ReadWriteMany")
    (claim,) = [o for o in manifests.desired_objects(shared) if o["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # the spec's own mode wins over the operator's
    own = compile_cache.with_default(
        model(compileCache={"size": "1Gi", "accessMode": "ReadWriteMany"}), "ReadWriteOnce"
    )
    assert compile_cache.claim(own, {"name": "x"}) is not None


def test_reconcile_renders_and_removes_pool_policy_secret_and_group_budgets(
    cluster: KMockCluster, namespace: str, api: kube.Kube
) -> None:
    config = OperatorConfig(
        inference_pool=True,
        network_policy=True,
        serving_from_namespaces=("vsurge-system",),
        metrics_from_namespaces=("monitoring",),
        compile_cache_access_mode="ReadWriteOnce",
    )
    r = reconcile.Reconciler(kube.Kube(api.api), config)
    body = inference_model("m", namespace, tpu=MULTI, replicas=3, compileCache={"size": "1Gi"})
    api.create(kube.INFERENCE_MODEL, namespace, body)
    r.reconcile(cluster.obj("vsurge.io/v1alpha1/inferencemodels", namespace, "m"))
    assert cluster.obj("inference.networking.k8s.io/v1/inferencepools", namespace, "m")
    assert cluster.obj("networking.k8s.io/v1/networkpolicies", namespace, "m")
    assert cluster.obj("v1/secrets", namespace, "m-cache-key")
    for i in range(3):
        assert cluster.obj("policy/v1/poddisruptionbudgets", namespace, f"m-group-{i}")
    # scaled to one group, the pool turned off: the budgets of groups 1 and 2 and the pool go
    api.patch(
        kube.INFERENCE_MODEL, namespace, "m", {"spec": {"replicas": 1, "gateway": {"inferencePool": False}}}
    )
    out = r.reconcile(cluster.obj("vsurge.io/v1alpha1/inferencemodels", namespace, "m"))
    assert sorted(out.removed) == ["InferencePool", "PodDisruptionBudget", "PodDisruptionBudget"]
    assert cluster.obj("policy/v1/poddisruptionbudgets", namespace, "m-group-0")
    assert not cluster.obj("policy/v1/poddisruptionbudgets", namespace, "m-group-1")
    assert not cluster.obj("inference.networking.k8s.io/v1/inferencepools", namespace, "m")


def test_a_namespace_without_secret_rights_is_reported(
    cluster: KMockCluster, namespace: str, api: kube.Kube
) -> None:
    """Cluster-wide mode grants Secrets only in secretNamespaces: elsewhere the API answers 403, and the
    model says what to change instead of a bare 403."""
    from kmock_harness import Fault

    r = reconcile.Reconciler(kube.Kube(api.api), OperatorConfig())
    api.create(kube.INFERENCE_MODEL, namespace, inference_model("m", namespace, compileCache={"size": "1Gi"}))
    body = cluster.obj("vsurge.io/v1alpha1/inferencemodels", namespace, "m")
    cluster.emulator.faults.append(Fault("GET", "secrets", 403, times=1))
    try:
        r.reconcile(body)
    except model_secrets.SecretsForbidden as e:
        r.report_failure(body, e)
    else:
        raise AssertionError("a 403 on the model's Secret passed silently")
    degraded = next(
        c
        for c in cluster.obj("vsurge.io/v1alpha1/inferencemodels", namespace, "m")["status"]["conditions"]
        if c["type"] == "Degraded"
    )
    assert degraded["reason"] == "SecretsForbidden"
    assert f"add {namespace} to the chart's secretNamespaces" in degraded["message"]
