"""End to end: ``python -m vsurge_operator`` (kopf, for real) against KMock on loopback.

Each test starts KMock, the operator process (resync 1 s, retry delay 0.3 s) and, where pods matter,
the fake kubelet; the operator is always stopped in the fixture's ``finally``.
"""

from __future__ import annotations

import time

from kmock_harness import Fault, KMockCluster, wait_for
from operator_harness import condition, issue_example

from vsurge_operator import kube

IM = "vsurge.io/v1alpha1/inferencemodels"
DEP = "apps/v1/deployments"
SVC = "v1/services"
PDB = "policy/v1/poddisruptionbudgets"
LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
WRITES = ("POST", "PATCH", "DELETE", "PUT")


def _env(workload_pod_template: dict) -> dict[str, dict]:
    return {e["name"]: e for e in workload_pod_template["spec"]["containers"][0]["env"]}


def _status_where(
    cluster: KMockCluster, ns: str, name: str, pred, timeout: float = 15, message: str = ""
) -> dict:
    def check():
        obj = cluster.obj(IM, ns, name)
        return obj if obj and pred(obj) else None

    return wait_for(check, timeout, message=message or f"status of {name}")


def _condition_where(cluster: KMockCluster, ns: str, name: str, type_: str, status: str) -> dict:
    """Wait until the InferenceModel's condition ``type_`` has ``status``; return the object."""
    return _status_where(
        cluster, ns, name, lambda o: condition(o, type_).get("status") == status, message=f"{type_}={status}"
    )


def _events(cluster: KMockCluster, ns: str, reason: str | None = None) -> list[dict]:
    events = cluster.objects("events", ns)
    return [e for e in events if reason is None or e.get("reason") == reason]


def _operator_writes(cluster: KMockCluster, plural: str | None = None, method: str | None = None) -> list:
    return [
        r
        for r in cluster.requests(plural=plural, method=method, agent=kube.USER_AGENT)
        if str(getattr(r.method, "value", r.method)).upper() in WRITES
    ]


def test_create_builds_workload_service_and_pdb(cluster, namespace, start_operator, create_model, kubelet):
    start_operator()
    # The issue's example: gs://bucket/llama-3-8b served as llama-3-8b, odriver with 64 decode slots,
    # maxLength 4096, prefill lengths 256/1024/4096, pages of 128, 85 % of HBM, bfloat16, on a v5e 2x4.
    create_model(
        "llama",
        **issue_example(),
        tracing={"endpoint": "http://otel-collector:4317", "samplingRatio": 0.25},
        env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    )
    dep = wait_for(lambda: cluster.obj(DEP, namespace, "llama"), message="Deployment created")
    svc = wait_for(lambda: cluster.obj(SVC, namespace, "llama"), message="Service created")
    pdb = wait_for(lambda: cluster.obj(PDB, namespace, "llama"), message="PDB created")
    im = cluster.obj(IM, namespace, "llama")

    # Owner references with the InferenceModel's uid on everything (garbage collection).
    for obj in (dep, svc, pdb):
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "vsurge.io/v1alpha1",
                "kind": "InferenceModel",
                "name": "llama",
                "uid": im["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]

    pod = dep["spec"]["template"]
    spec = pod["spec"]
    assert spec["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x4",
    }
    container = spec["containers"][0]
    assert container["resources"] == {"requests": {"google.com/tpu": "8"}, "limits": {"google.com/tpu": "8"}}
    assert container["command"] == ["vsurge", "serve"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 11556, "metrics": 11557}
    env = _env(pod)
    expected = {
        "VSURGE_MODEL": "gs://bucket/llama-3-8b",
        "VSURGE_SERVED_MODEL_NAME": "llama-3-8b",
        "VSURGE_DRIVER": "odriver",
        "VSURGE_MAX_CONCURRENT_DECODES": "64",
        "VSURGE_MAX_LENGTH": "4096",
        "VSURGE_PREFILL_LENGTHS": "256,1024,4096",
        "VSURGE_PAGE_SIZE": "128",
        "VSURGE_HBM_UTILIZATION": "0.85",
        "VSURGE_MESH": "tp=8",
        "VSURGE_DTYPE": "bfloat16",
        "VSURGE_HOST": "0.0.0.0",
        "VSURGE_PORT": "11556",
        "VSURGE_METRICS_PORT": "11557",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4317",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_PROPAGATORS": "tracecontext,baggage",
    }
    assert {k: env[k]["value"] for k in expected} == expected
    assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"] == (
        "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME),k8s.node.name=$(NODE_NAME)"
    )
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}

    # The Service and the PDB select exactly the Deployment's pods.
    selector = dep["spec"]["selector"]["matchLabels"]
    assert all(pod["metadata"]["labels"][k] == v for k, v in selector.items())
    assert svc["spec"]["selector"] == selector
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": 11556, "metrics": 11557}

    # Status, once the fake kubelet reports the pod ready.
    im = _condition_where(cluster, namespace, "llama", "Ready", "True")
    st = im["status"]
    assert st["endpoint"] == "http://llama.models.svc.cluster.local:11556"
    assert st["readyReplicas"] == 1 and st["desiredReplicas"] == 1 and st["observedGeneration"] == 1
    assert st["selector"] == "app.kubernetes.io/name=vsurge-server,vsurge.io/model=llama"
    im = _condition_where(cluster, namespace, "llama", "Progressing", "False")
    assert condition(im, "Progressing")["reason"] == "Stable"
    assert condition(im, "Degraded")["status"] == "False"

    created = {e["message"] for e in _events(cluster, namespace, "Created")}
    assert created >= {
        "Created Deployment llama",
        "Created Service llama",
        "Created PodDisruptionBudget llama",
    }
    assert not cluster.requests(method="PUT")


def test_update_patches_in_place(cluster, namespace, api, start_operator, create_model):
    start_operator()
    create_model("qwen", engine={"maxLength": 2048}, tracing={"endpoint": "http://otel:4317"})
    dep = wait_for(lambda: cluster.obj(DEP, namespace, "qwen"), message="Deployment created")
    uid = dep["metadata"]["uid"]
    assert _env(dep["spec"]["template"])["VSURGE_MAX_LENGTH"]["value"] == "2048"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in _env(dep["spec"]["template"])

    # A user edit: longer context, two replicas, tracing switched off (fields must be removed, too).
    api.patch(
        kube.INFERENCE_MODEL,
        namespace,
        "qwen",
        {"spec": {"engine": {"maxLength": 8192}, "replicas": 2, "tracing": None}},
    )

    def updated():
        d = cluster.obj(DEP, namespace, "qwen")
        env = _env(d["spec"]["template"])
        return d if env["VSURGE_MAX_LENGTH"]["value"] == "8192" and d["spec"]["replicas"] == 2 else None

    dep = wait_for(updated, message="Deployment patched")
    assert dep["metadata"]["uid"] == uid, "the Deployment was recreated instead of patched"
    assert not any(k.startswith("OTEL_") for k in _env(dep["spec"]["template"]))
    assert None not in cluster.history(DEP, namespace, "qwen"), "the Deployment was deleted at some point"
    assert len(_operator_writes(cluster, "deployments", "POST")) == 1
    assert not _operator_writes(cluster, "deployments", "DELETE")
    assert _operator_writes(cluster, "deployments", "PATCH")
    _status_where(
        cluster,
        namespace,
        "qwen",
        lambda o: (
            o.get("status", {}).get("observedGeneration") == 2
            and o.get("status", {}).get("desiredReplicas") == 2
        ),
        message="observedGeneration 2",
    )
    assert not cluster.requests(method="PUT")

    # Deleting the model: kopf's finalizer (for the timer and the daemon) is released, the object goes.
    api.delete(kube.INFERENCE_MODEL, namespace, "qwen")
    wait_for(lambda: cluster.obj(IM, namespace, "qwen") is None, message="InferenceModel deleted")


def test_steady_state_writes_nothing_and_timer_repairs_drift(
    cluster, namespace, api, start_operator, create_model
):
    start_operator(resync=0.5)
    create_model("gemma")
    dep = wait_for(lambda: cluster.obj(DEP, namespace, "gemma"), message="Deployment created")
    _status_where(
        cluster, namespace, "gemma", lambda o: o.get("status", {}).get("endpoint"), message="status written"
    )
    time.sleep(1.0)  # let the creation settle

    # No write when nothing changed, although the timer reconciles twice a second.
    before = len(_operator_writes(cluster)) + len(cluster.requests(method="PATCH", plural="inferencemodels"))
    time.sleep(2.0)
    after = len(_operator_writes(cluster)) + len(cluster.requests(method="PATCH", plural="inferencemodels"))
    assert after == before, [str(r.url) for r in _operator_writes(cluster)][-5:]
    assert len(cluster.requests(method="GET", plural="deployments", agent=kube.USER_AGENT)) >= 3

    # A deleted Deployment comes back (a new object), without any change to the InferenceModel.
    api.delete(kube.DEPLOYMENT, namespace, "gemma")
    assert cluster.obj(DEP, namespace, "gemma") is None
    recreated = wait_for(lambda: cluster.obj(DEP, namespace, "gemma"), 10, message="Deployment recreated")
    assert recreated["metadata"]["uid"] != dep["metadata"]["uid"]

    # A hand edit of the Deployment is reverted.
    api.patch(kube.DEPLOYMENT, namespace, "gemma", {"spec": {"replicas": 7}})
    wait_for(
        lambda: cluster.obj(DEP, namespace, "gemma")["spec"]["replicas"] == 1, 10, message="drift reverted"
    )
    # ...and so is a deleted Service.
    api.delete(kube.SERVICE, namespace, "gemma")
    wait_for(lambda: cluster.obj(SVC, namespace, "gemma"), 10, message="Service recreated")


def test_multi_host_topology_gets_a_leader_worker_set(cluster, namespace, api, start_operator, create_model):
    start_operator()
    create_model("big", tpu={"accelerator": "tpu-v5-lite-podslice", "topology": "4x4"}, replicas=2)
    lws = wait_for(lambda: cluster.obj(LWS, namespace, "big"), message="LeaderWorkerSet created")
    svc = wait_for(lambda: cluster.obj(SVC, namespace, "big"), message="Service created")
    pdb = wait_for(lambda: cluster.obj(PDB, namespace, "big"), message="PDB created")
    assert cluster.obj(DEP, namespace, "big") is None

    spec = lws["spec"]
    assert spec["replicas"] == 2
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == 4 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    for role in ("leaderTemplate", "workerTemplate"):
        pod = template[role]["spec"]
        assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": "4"}
        assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
        assert _env(template[role])["VSURGE_MESH"]["value"] == "dp=2,tp=8"
    assert "readinessProbe" in template["leaderTemplate"]["spec"]["containers"][0]
    assert "readinessProbe" not in template["workerTemplate"]["spec"]["containers"][0]
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    # one pod of the model at a time, and a budget per group (disruption.py)
    assert pdb["spec"]["maxUnavailable"] == 1
    for i in range(2):
        group = wait_for(lambda i=i: cluster.obj(PDB, namespace, f"big-group-{i}"), message="group budget")
        assert group["spec"]["selector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/group-index"] == str(i)
    _status_where(
        cluster, namespace, "big", lambda o: o.get("status", {}).get("workloadKind") == "LeaderWorkerSet"
    )

    # Down to one host: a Deployment replaces the LeaderWorkerSet.
    api.patch(kube.INFERENCE_MODEL, namespace, "big", {"spec": {"tpu": {"topology": "2x4"}}})
    dep = wait_for(lambda: cluster.obj(DEP, namespace, "big"), message="Deployment created")
    wait_for(lambda: cluster.obj(LWS, namespace, "big") is None, message="LeaderWorkerSet deleted")
    assert dep["spec"]["replicas"] == 2
    assert (
        "leaderworkerset.sigs.k8s.io/worker-index"
        not in cluster.obj(SVC, namespace, "big")["spec"]["selector"]
    )
    _status_where(
        cluster, namespace, "big", lambda o: o.get("status", {}).get("workloadKind") == "Deployment"
    )


def test_api_errors_are_retried(cluster, namespace, api, start_operator, create_model):
    faults = [
        Fault("POST", "deployments", 500),
        Fault("POST", "services", 409),
        Fault("PATCH", "services", 503, agent=kube.USER_AGENT),
    ]
    cluster.call(lambda: cluster.emulator.faults.extend(faults))
    # A long resync: recovery must come from the handler's own retry, not from the drift timer.
    start_operator(resync=60)
    create_model("mistral")

    wait_for(lambda: cluster.obj(DEP, namespace, "mistral"), message="Deployment created after a 500")
    wait_for(lambda: cluster.obj(SVC, namespace, "mistral"), message="Service created after a 409")
    wait_for(lambda: cluster.obj(PDB, namespace, "mistral"), message="PDB created")
    assert [f.hits for f in faults[:2]] == [1, 1]
    assert len(_operator_writes(cluster, "deployments", "POST")) == 2  # the failed attempt, then the retry
    assert len(_operator_writes(cluster, "services", "POST")) == 2
    warnings = _events(cluster, namespace, "ApiError")
    assert warnings and all(e["type"] == "Warning" for e in warnings)
    assert any("500" in e["message"] for e in warnings) and any("409" in e["message"] for e in warnings)
    # Degraded was set while failing, and cleared once the reconcile went through.
    history = [v for v in cluster.history(IM, namespace, "mistral") if v]
    assert any(condition(v, "Degraded").get("status") == "True" for v in history)
    _condition_where(cluster, namespace, "mistral", "Degraded", "False")

    # A failing PATCH (after a spec change) is retried as well.
    api.patch(kube.INFERENCE_MODEL, namespace, "mistral", {"spec": {"model": {"servedName": "mistral-7b"}}})
    wait_for(
        lambda: (
            _env(cluster.obj(DEP, namespace, "mistral")["spec"]["template"])["VSURGE_SERVED_MODEL_NAME"][
                "value"
            ]
            == "mistral-7b"
        ),
        message="Deployment patched",
    )
    # A PATCH answered with 503 is retried too: a hand edit of the Service, then a spec change.
    api.patch(kube.SERVICE, namespace, "mistral", {"spec": {"type": "NodePort"}})
    api.patch(kube.INFERENCE_MODEL, namespace, "mistral", {"spec": {"replicas": 2}})
    wait_for(
        lambda: cluster.obj(SVC, namespace, "mistral")["spec"]["type"] == "ClusterIP",
        10,
        message="Service patched after a 503",
    )
    assert faults[2].hits == 1


def test_invalid_spec_is_degraded_and_creates_nothing(cluster, namespace, api, start_operator, create_model):
    start_operator()
    # Passes the CRD's topology pattern, but v5e has no 4x4x4 slice.
    create_model("bad", tpu={"accelerator": "tpu-v5-lite-podslice", "topology": "4x4x4"})
    im = _condition_where(cluster, namespace, "bad", "Degraded", "True")
    degraded = condition(im, "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.tpu.topology" in degraded["message"] and "4x4x4" in degraded["message"]
    assert condition(im, "Ready")["status"] == "False"
    # kopf posts the event after the status patch, from its own task: wait for it
    invalid = wait_for(lambda: _events(cluster, namespace, "InvalidSpec"), message="InvalidSpec event")
    assert invalid[0]["type"] == "Warning" and "spec.tpu.topology" in invalid[0]["message"]
    time.sleep(1.5)  # a few resyncs: still nothing half-way
    for plural in ("deployments", "leaderworkersets", "services", "poddisruptionbudgets"):
        assert not cluster.objects(plural, namespace), plural
        assert not _operator_writes(cluster, plural)
    assert len(_events(cluster, namespace, "InvalidSpec")) == len(invalid), (
        "one Event per problem, not per resync"
    )

    api.patch(kube.INFERENCE_MODEL, namespace, "bad", {"spec": {"tpu": {"topology": "2x2"}}})
    dep = wait_for(lambda: cluster.obj(DEP, namespace, "bad"), message="created once fixed")
    assert dep["spec"]["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2"
    _condition_where(cluster, namespace, "bad", "Degraded", "False")


def test_replicas_set_through_scale_are_kept_when_autoscaling_is_off(
    cluster, namespace, api, start_operator, create_model
):
    start_operator()
    create_model("phi", replicas=1)
    wait_for(lambda: cluster.obj(DEP, namespace, "phi"), message="Deployment created")

    # `kubectl scale im/phi --replicas=3` (or the router waking a model) goes through /scale.
    api.patch(kube.INFERENCE_MODEL, namespace, "phi", {"spec": {"replicas": 3}}, subresource="scale")
    wait_for(lambda: cluster.obj(DEP, namespace, "phi")["spec"]["replicas"] == 3, message="Deployment scaled")
    time.sleep(1.5)
    assert cluster.obj(IM, namespace, "phi")["spec"]["replicas"] == 3
    assert cluster.obj(DEP, namespace, "phi")["spec"]["replicas"] == 3
    assert not _operator_writes(cluster, "inferencemodels", "PATCH") or all(
        r.subresource == "status" for r in _operator_writes(cluster, "inferencemodels", "PATCH")
    ), "the operator wrote the InferenceModel's spec"
