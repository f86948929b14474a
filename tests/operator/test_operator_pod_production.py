"""Model pods fit for a shared production cluster: the restricted Pod Security profile, scheduling fields,
pod template metadata, pull secrets, the drain, rollout strategies, the compile cache and the image per
accelerator. Pure: spec -> manifests (the real API server's admission is in tests/cluster).
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_validate import utils as kv

from vsurge_operator import manifests, rollout, spec, validation
from vsurge_operator.config import OperatorConfig

K8S_VERSION = kv.latest_version()
IMAGES = {"tpu": "vsurge:tpu", "gpu": "vsurge:cuda", "cpu": "vsurge:cpu"}


def body(**overrides: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"model": {"source": "default"}}
    s.update(overrides)
    return {"metadata": {"name": "llama", "namespace": "team", "uid": "uid-1", "generation": 1}, "spec": s}


def model(**overrides: Any) -> spec.ModelSpec:
    b = body(**overrides)
    assert validation.validate(b, default_image=IMAGES) == []
    return spec.parse(b, default_image=IMAGES)


MODES = {
    "cpu": {},
    "tpu-single-host": {"tpu": {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"}},
    "tpu-multi-host": {"tpu": {"accelerator": "tpu-v6e-slice", "topology": "4x4"}},
    "gpu": {"gpu": {"count": 2, "type": "nvidia-l4"}},
    "gpu-pvc-compile-cache": {
        "gpu": {"count": 1},
        "model": {"source": "pvc://weights/llama"},
        "cache": {"claimName": "models"},
        "compileCache": {"size": "10Gi"},
    },
}


def pod_templates(m: spec.ModelSpec) -> list[dict[str, Any]]:
    w = manifests.workload(m)
    if w["kind"] == "LeaderWorkerSet":
        lwt = w["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return [w["spec"]["template"]]


# The Pod Security Standard "restricted" (v1.30 policy), as the PodSecurity admission plugin checks it,
# written out from the published standard; returns the violations.
ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    out = []
    psc = pod_spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(key):
            out.append(key)
    for v in pod_spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {v['name']}: {kinds - ALLOWED_VOLUMES}")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation != false")
        if not (
            sc.get("runAsNonRoot") is True or (psc.get("runAsNonRoot") is True and "runAsNonRoot" not in sc)
        ):
            out.append(f"{name}: runAsNonRoot != true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities.drop lacks ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                out.append(f"{name}: hostPort")
    return out


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_rendered_pod_is_restricted_with_a_read_only_root(mode):
    m = model(**MODES[mode])
    templates = pod_templates(m)
    assert len(templates) == (2 if mode == "tpu-multi-host" else 1)
    for t in templates:
        pod = t["spec"]
        assert restricted_violations(pod) == []
        assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsGroup"] == 10001
        (c,) = pod["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        # Writable only where the server writes: the cache (and the claims inside it) and /tmp.
        mounts = {v["mountPath"] for v in c["volumeMounts"] if not v.get("readOnly")}
        assert mounts <= {manifests.CACHE_DIR, "/tmp", f"{manifests.CACHE_DIR}/jax"}, mounts
        assert {"/tmp", manifests.CACHE_DIR} <= mounts
        envs = {e["name"]: e.get("value") for e in c["env"]}
        assert envs["HF_HOME"].startswith(manifests.CACHE_DIR)  # the image's HF_HOME is on the root fs
        kv.validate(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **t["metadata"]}, "spec": pod},
            K8S_VERSION,
            strict=True,
        )


def test_the_restricted_check_can_fail():
    # The pod spec the operator used to render: no container securityContext, fsGroup only.
    old = {
        "securityContext": {"fsGroup": 10001},
        "containers": [{"name": "server", "image": "x", "ports": [{"containerPort": 1, "hostPort": 1}]}],
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
    }
    found = restricted_violations(old)
    assert "server: allowPrivilegeEscalation != false" in found
    assert "server: runAsNonRoot != true" in found
    assert "server: seccompProfile None" in found
    assert "server: capabilities.drop lacks ALL" in found
    assert any(v.startswith("volume h") for v in found) and "server: hostPort" in found


def test_image_is_picked_by_accelerator_and_spec_image_wins():
    assert model().image == "vsurge:cpu"
    assert model(**MODES["tpu-single-host"]).image == "vsurge:tpu"
    assert model(**MODES["tpu-multi-host"]).image == "vsurge:tpu"
    assert model(gpu={"count": 1}).image == "vsurge:cuda"
    assert model(gpu={"count": 1}, image="mine:1").image == "mine:1"
    # An operator configured with one image for all (and per-accelerator overrides) from its environment.
    cfg = OperatorConfig.from_env(
        {"VSURGE_OPERATOR_DEFAULT_IMAGE": "all:1", "VSURGE_OPERATOR_IMAGE_GPU": "cuda:1"}
    )
    assert cfg.model_images() == {"tpu": "all:1", "gpu": "cuda:1", "cpu": "all:1"}
    # No image for the accelerator and none in the spec: a clear error, not a pod without an image.
    errors = validation.validate(body(gpu={"count": 1}), default_image={"tpu": "t", "gpu": None, "cpu": "c"})
    assert [(e.field, "gpu" in e.message) for e in errors] == [("spec.image", True)]


def test_scheduling_fields_and_pod_metadata_reach_the_pod():
    affinity = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"a": "b"}}}
            ]
        }
    }
    spread = [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    ]
    m = model(
        tpu={"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"},
        nodeSelector={"old": "flat"},
        tolerations=[{"key": "old", "operator": "Exists"}],
        scheduling={
            "nodeSelector": {"pool": "llm"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": affinity,
            "priorityClassName": "serving-high",
            "topologySpreadConstraints": spread,
        },
        podTemplate={"metadata": {"labels": {"team": "search"}, "annotations": {"example.com/x": "y"}}},
        imagePullSecrets=[{"name": "regcred"}, {"name": "mirror"}],
    )
    (t,) = pod_templates(m)
    pod = t["spec"]
    assert pod["nodeSelector"] == {
        "old": "flat",
        "pool": "llm",
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x4",
    }
    assert pod["tolerations"] == [
        {"key": "old", "operator": "Exists"},
        {"key": "spot", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    assert pod["affinity"] == affinity and pod["topologySpreadConstraints"] == spread
    assert pod["priorityClassName"] == "serving-high"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    assert t["metadata"]["labels"]["team"] == "search"
    assert t["metadata"]["labels"]["vsurge.io/model"] == "llama"  # the selector's labels stay
    assert t["metadata"]["annotations"]["example.com/x"] == "y"
    # The Deployment's selector is unchanged by the extra label (a selector is immutable).
    assert manifests.workload(m)["spec"]["selector"]["matchLabels"] == manifests.selector_labels(m)


def test_a_pod_label_may_not_take_over_the_selector():
    errors = validation.validate(
        body(podTemplate={"metadata": {"labels": {"vsurge.io/model": "other"}}}), default_image=IMAGES
    )
    assert [e.field for e in errors] == ["spec.podTemplate.metadata.labels.vsurge.io/model"]


@pytest.mark.parametrize("drain", [0, 120, 900])
def test_drain_sets_grace_period_timeout_and_a_prestop_that_announces_the_stop(drain):
    overrides = {} if drain == 120 else {"drainSeconds": drain}  # 120 is the default
    m = model(**overrides)
    (t,) = pod_templates(m)
    assert t["spec"]["terminationGracePeriodSeconds"] == rollout.PRESTOP_SECONDS + drain + 15
    (c,) = t["spec"]["containers"]
    assert {e["name"]: e.get("value") for e in c["env"]}["VSURGE_DRAIN_TIMEOUT"] == str(drain)
    cmd = c["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[:2] == ["python", "-c"] and "SIGUSR1" in cmd[2] and "os.kill(1," in cmd[2]


def test_multi_host_workers_have_no_prestop_but_the_same_grace():
    leader, worker = pod_templates(model(**MODES["tpu-multi-host"], drainSeconds=300))
    assert "lifecycle" in leader["spec"]["containers"][0]
    assert "lifecycle" not in worker["spec"]["containers"][0]
    assert leader["spec"]["terminationGracePeriodSeconds"] == worker["spec"]["terminationGracePeriodSeconds"]


@pytest.mark.parametrize(
    ("rollout_spec", "expected"),
    [
        (None, (1, 0)),
        ({"surge": 0, "maxUnavailable": 1}, (0, 1)),
        ({"surge": 2, "maxUnavailable": 1}, (2, 1)),
    ],
)
def test_rollout_strategy_on_deployment_and_leader_worker_set(rollout_spec, expected):
    extra = {} if rollout_spec is None else {"rollout": rollout_spec}
    d = manifests.workload(model(**extra))
    assert d["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": expected[0], "maxUnavailable": expected[1]},
    }
    lws = manifests.workload(model(**MODES["tpu-multi-host"], **extra))
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": expected[0],
        "maxUnavailable": expected[1],
    }


def test_surge_and_max_unavailable_both_zero_is_refused():
    errors = validation.validate(body(rollout={"surge": 0, "maxUnavailable": 0}), default_image=IMAGES)
    assert [e.field for e in errors] == ["spec.rollout"]


def test_compile_cache_created_claim_is_owned_and_mounted_at_the_jax_cache():
    # ReadWriteMany: one claim shared by the pods (ReadWriteOnce, the default, is a claim per pod:
    # test_operator_gateway_access.py)
    m = model(compileCache={"size": "20Gi", "storageClassName": "filestore", "accessMode": "ReadWriteMany"})
    objects = manifests.desired_objects(m)
    assert [o["kind"] for o in objects] == [
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "PersistentVolumeClaim",
    ]
    pvc = objects[-1]
    kv.validate(pvc, K8S_VERSION, strict=True)
    assert pvc["metadata"]["name"] == "llama-compile-cache"
    assert pvc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # deleted with the model
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "20Gi"}},
        "storageClassName": "filestore",
    }
    pod = objects[0]["spec"]["template"]["spec"]
    assert {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "llama-compile-cache"}} in pod[
        "volumes"
    ]
    mounts = pod["containers"][0]["volumeMounts"]
    # `vsurge serve` keeps compiled programs in $VSURGE_CACHE_DIR/jax: the claim is mounted right there.
    assert {"name": "compile-cache", "mountPath": f"{manifests.CACHE_DIR}/jax"} in mounts


def test_compile_cache_existing_claim_is_mounted_not_created():
    m = model(compileCache={"claimName": "shared-jax"})
    assert [o["kind"] for o in manifests.desired_objects(m)] == [
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    ]
    vols = manifests.workload(m)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "shared-jax"}} in vols
    # A multi-host slice mounts it on every host (leader and workers).
    for t in pod_templates(model(**MODES["tpu-multi-host"], compileCache={"claimName": "shared-jax"})):
        assert any(v["name"] == "compile-cache" for v in t["spec"]["volumes"])
