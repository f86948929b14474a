"""Manifest builders: spec -> Deployment / LeaderWorkerSet / Service / PDB, checked against Kubernetes' schemas."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_validate import utils as kv

from vsurge_operator import manifests, spec

K8S_VERSION = kv.latest_version()


def model(**overrides: Any) -> spec.ModelSpec:
    s: dict[str, Any] = {"model": {"source": "default"}, "image": "img:1"}
    s.update(overrides)
    body = {"metadata": {"name": "llama", "namespace": "team", "uid": "uid-1", "generation": 3}, "spec": s}
    return spec.parse(body)


TPU_1HOST = {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"}
TPU_4HOSTS = {"accelerator": "tpu-v6e-slice", "topology": "4x4"}

MODELS = {
    "cpu": model(),
    "tpu": model(
        tpu=TPU_1HOST,
        replicas=3,
        tracing={"endpoint": "http://otel:4317"},
        resources={"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
    ),
    "pvc": model(
        model={"source": "pvc://weights/llama-3/8b"}, imagePullPolicy="Always", serviceAccountName="sa"
    ),
    "multi": model(tpu=TPU_4HOSTS, replicas=2, tolerations=[{"key": "spot", "operator": "Exists"}]),
}


def env(m: spec.ModelSpec) -> dict[str, dict]:
    return {e["name"]: e for e in manifests.env(m)}


def pod_of(template: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x", **template["metadata"]},
        "spec": template["spec"],
    }


@pytest.mark.parametrize("name", sorted(MODELS))
def test_objects_pass_the_kubernetes_schemas(name):
    m = MODELS[name]
    for obj in manifests.desired_objects(m):
        if obj["kind"] == "LeaderWorkerSet":
            # A CRD outside Kubernetes' schemas: validate its pod templates as Pods instead.
            for role in ("leaderTemplate", "workerTemplate"):
                kv.validate(pod_of(obj["spec"]["leaderWorkerTemplate"][role]), K8S_VERSION, strict=True)
        else:
            kv.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_owner_labels_and_selectors_are_consistent(name):
    m = MODELS[name]
    workload, svc, pdb, *rest = manifests.desired_objects(m)
    groups = [o for o in rest if o["kind"] == "PodDisruptionBudget"]
    lane_objects = [o for o in rest if o["kind"] != "PodDisruptionBudget"]
    assert [o["kind"] for o in lane_objects] == (["NetworkPolicy"] if m.multi_host else [])
    # a multi-host model: one budget per LeaderWorkerSet group, selecting that group's pods only
    assert [g["metadata"]["name"] for g in groups] == (
        [f"llama-group-{i}" for i in range(m.desired_replicas())] if m.multi_host else []
    )
    for i, g in enumerate(groups):
        assert g["spec"]["selector"]["matchLabels"] == {
            **manifests.selector_labels(m),
            "leaderworkerset.sigs.k8s.io/group-index": str(i),
        }
        assert g["spec"]["maxUnavailable"] == 1
    owner = {
        "apiVersion": "vsurge.io/v1alpha1",
        "kind": "InferenceModel",
        "name": "llama",
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for obj in (workload, svc, pdb):
        assert obj["metadata"]["ownerReferences"] == [owner]
        assert obj["metadata"]["name"] == "llama" and obj["metadata"]["namespace"] == "team"
        assert obj["metadata"]["labels"]["vsurge.io/model"] == "llama"
    templates = (
        [
            workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"],
            workload["spec"]["leaderWorkerTemplate"]["workerTemplate"],
        ]
        if workload["kind"] == "LeaderWorkerSet"
        else [workload["spec"]["template"]]
    )
    for t in templates:
        assert manifests.selector_labels(m).items() <= t["metadata"]["labels"].items()
    assert pdb["spec"]["selector"]["matchLabels"] == manifests.selector_labels(m)
    assert manifests.selector_labels(m).items() <= svc["spec"]["selector"].items()


def test_cpu_model_has_no_tpu_anything():
    d = manifests.workload(MODELS["cpu"])
    assert d["kind"] == "Deployment"
    pod = d["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert pod["containers"][0]["resources"] == {}
    assert "VSURGE_MESH" not in env(MODELS["cpu"])
    assert d["spec"]["replicas"] == 1


def test_single_host_tpu_deployment():
    m = MODELS["tpu"]
    d = manifests.workload(m)
    assert d["kind"] == "Deployment" and d["spec"]["replicas"] == 3
    pod = d["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x4",
    }
    assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    res = pod["containers"][0]["resources"]
    assert res == {
        "requests": {"cpu": "4", "memory": "16Gi", "google.com/tpu": "8"},
        "limits": {"memory": "32Gi", "google.com/tpu": "8"},
    }
    assert env(m)["VSURGE_MESH"]["value"] == "tp=8"
    assert d["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }


def test_multi_host_leader_worker_set():
    m = MODELS["multi"]
    lws = manifests.workload(m)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    t = lws["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 4 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["replicas"] == 2
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["maxUnavailable"] == 0
    for role in ("leaderTemplate", "workerTemplate"):
        c = t[role]["spec"]["containers"][0]
        assert c["resources"]["limits"]["google.com/tpu"] == "4"
        assert {e["name"]: e.get("value") for e in c["env"]}["VSURGE_MESH"] == "dp=2,tp=8"
        assert {"key": "spot", "operator": "Exists"} in t[role]["spec"]["tolerations"]
    assert "readinessProbe" in t["leaderTemplate"]["spec"]["containers"][0]
    assert "readinessProbe" not in t["workerTemplate"]["spec"]["containers"][0]
    assert manifests.service(m)["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert manifests.pod_disruption_budget(m)["spec"]["maxUnavailable"] == 1


def test_pvc_source_is_mounted_read_only():
    m = MODELS["pvc"]
    pod = manifests.workload(m)["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod[
        "volumes"
    ]
    c = pod["containers"][0]
    assert {"name": "model", "mountPath": "/mnt/models", "readOnly": True} in c["volumeMounts"]
    assert env(m)["VSURGE_MODEL"]["value"] == "/mnt/models/llama-3/8b"
    assert c["imagePullPolicy"] == "Always" and pod["serviceAccountName"] == "sa"
    assert manifests.model_path("pvc://weights") == "/mnt/models"


def test_environment_contract():
    m = model(
        model={"source": "hf://Qwen/Qwen3-8B", "servedName": "qwen3"},
        engine={
            "driver": "vdriver",
            "maxConcurrentDecodes": 32,
            "maxLength": 8192,
            "prefillLengths": [512, 8192],
            "pageSize": 64,
            "hbmUtilization": 0.9,
            "dtype": "bfloat16",
            "mesh": "dp=2,tp=4",
        },
        tpu=TPU_1HOST,
        tracing={"endpoint": "http://otel:4317", "samplingRatio": 0.05, "serviceName": "qwen-serving"},
        env=[{"name": "VSURGE_DTYPE", "value": "float32"}, {"name": "EXTRA", "value": "1"}],
    )
    names = [e["name"] for e in manifests.env(m)]
    values = {e["name"]: e.get("value") for e in manifests.env(m)}
    assert (
        values
        | {
            "VSURGE_MODEL": "hf://Qwen/Qwen3-8B",
            "VSURGE_SERVED_MODEL_NAME": "qwen3",
            "VSURGE_DRIVER": "vdriver",
            "VSURGE_MAX_CONCURRENT_DECODES": "32",
            "VSURGE_MAX_LENGTH": "8192",
            "VSURGE_PREFILL_LENGTHS": "512,8192",
            "VSURGE_PAGE_SIZE": "64",
            "VSURGE_HBM_UTILIZATION": "0.9",
            "VSURGE_MESH": "dp=2,tp=4",
            "VSURGE_HOST": "0.0.0.0",
            "VSURGE_PORT": "11556",
            "VSURGE_METRICS_PORT": "11557",
            "OTEL_SERVICE_NAME": "qwen-serving",
            "OTEL_TRACES_SAMPLER_ARG": "0.05",
        }
        == values
    )
    # The user's VSURGE_DTYPE replaced ours in place; downward API variables come before their users.
    assert values["VSURGE_DTYPE"] == "float32" and names.count("VSURGE_DTYPE") == 1
    assert names.index("VSURGE_DTYPE") < names.index("VSURGE_CACHE_DIR") and names[-1] == "EXTRA"
    assert names.index("POD_NAMESPACE") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert "OTEL_SERVICE_NAME" not in {e["name"] for e in manifests.env(model())}


def test_service_pdb_endpoint_and_selector_string():
    m = MODELS["tpu"]
    svc = manifests.service(m)
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 11556, "targetPort": "http", "protocol": "TCP"},
        {"name": "metrics", "port": 11557, "targetPort": "metrics", "protocol": "TCP"},
    ]
    assert manifests.pod_disruption_budget(m)["spec"]["maxUnavailable"] == 1
    assert manifests.endpoint(m) == "http://llama.team.svc.cluster.local:11556"
    assert manifests.selector_string(m) == "app.kubernetes.io/name=vsurge-server,vsurge.io/model=llama"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, 1),
        ({"replicas": 4}, 4),
        ({"replicas": 0}, 0),
        ({"autoscaling": {"enabled": True, "minReplicas": 2}}, 2),
        ({"autoscaling": {"enabled": True, "minReplicas": 2}, "replicas": 5}, 5),
        ({"autoscaling": {"enabled": False, "minReplicas": 2}}, 1),
    ],
)
def test_desired_replicas(overrides, expected):
    m = model(**overrides)
    assert m.desired_replicas() == expected
    assert manifests.workload(m)["spec"]["replicas"] == expected
