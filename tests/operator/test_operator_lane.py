"""A multi-host model's step lane in the operator: its Secret (made once, mounted into leader and workers,
rotation rolls the groups), its NetworkPolicy, and the status naming the pod whose group failed."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from kmock_harness import KMockCluster
from kubernetes_validate import utils as kv
from operator_harness import condition, inference_model

from vsurge.multihost.channel import MIN_SECRET_BYTES, SECRET_ENV
from vsurge_operator import apply, kube, lane, manifests, reconcile, spec, status
from vsurge_operator.config import OperatorConfig

IM = "vsurge.io/v1alpha1/inferencemodels"
LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
MULTI = {"accelerator": "tpu-v6e-slice", "topology": "4x4"}


def _model(**overrides: Any) -> spec.ModelSpec:
    s: dict[str, Any] = {"model": {"source": "default"}, "image": "img:1", **overrides}
    return spec.parse(
        {"metadata": {"name": "big", "namespace": "team", "uid": "uid-1", "generation": 1}, "spec": s}
    )


def test_group_pods_mount_the_lane_secret_and_the_policy_guards_the_lane():
    m = _model(tpu=MULTI)
    lws = manifests.leader_worker_set(m, lane_version="abc123")
    for role in ("leaderTemplate", "workerTemplate"):
        t = lws["spec"]["leaderWorkerTemplate"][role]
        pod = t["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == lane.VOLUME]
        assert vol["secret"]["secretName"] == "big-lane" and vol["secret"]["defaultMode"] == 0o440
        c = pod["containers"][0]
        assert {"name": lane.VOLUME, "mountPath": lane.SECRET_DIR, "readOnly": True} in c["volumeMounts"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env[SECRET_ENV] == f"{lane.SECRET_DIR}/{lane.SECRET_KEY}"  # what `vsurge serve` reads
        assert pod["securityContext"]["fsGroup"] == manifests.IMAGE_GID  # 0440 files readable by the image
        assert t["metadata"]["annotations"][lane.ROTATION_ANNOTATION] == "abc123"
        kv.validate(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod},
            kv.latest_version(),
            strict=True,
        )

    policy = lane.network_policy(m)
    kv.validate(policy, kv.latest_version(), strict=True)
    assert policy["spec"]["podSelector"]["matchLabels"] == manifests.selector_labels(m)
    own, anyone = policy["spec"]["ingress"]
    # the model's own pods: every port (lane, coordinator, the accelerator runtime between hosts)
    assert own == {
        "from": [
            {"podSelector": {"matchLabels": {**manifests.selector_labels(m), lane.LWS_NAME_LABEL: "big"}}}
        ]
    }
    # anyone else: HTTP and metrics only, so the lane (8477) and the coordinator (8476) are unreachable
    assert "from" not in anyone and {p["port"] for p in anyone["ports"]} == {
        spec.HTTP_PORT,
        spec.METRICS_PORT,
    }
    assert not {manifests.COORDINATOR_PORT, manifests.STEP_LANE_PORT} & {p["port"] for p in anyone["ports"]}

    # one host: no lane, no policy, no secret
    single = _model(tpu={"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"})
    kinds = [o["kind"] for o in manifests.desired_objects(single)]
    assert "NetworkPolicy" not in kinds
    dep = manifests.deployment(single)
    assert SECRET_ENV not in {e["name"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_the_secret_holds_enough_random_bytes_and_each_model_gets_its_own():
    m = _model(tpu=MULTI)
    a, b = lane.secret(m), lane.secret(m)
    raw = base64.b64decode(a["data"][lane.SECRET_KEY])
    assert len(raw.strip()) >= MIN_SECRET_BYTES  # what `vsurge serve` requires of the file
    assert a["data"] != b["data"] and lane.version(a) != lane.version(b)
    assert a["metadata"]["ownerReferences"][0]["uid"] == "uid-1" and a["type"] == "Opaque"
    kv.validate(a, kv.latest_version(), strict=True)


def _reconciler(api: kube.Kube) -> reconcile.Reconciler:
    return reconcile.Reconciler(kube.Kube(api.api), OperatorConfig(), lambda *a: None)


def _annotation(cluster: KMockCluster, namespace: str) -> str:
    t = cluster.obj(LWS, namespace, "m")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    return t["metadata"]["annotations"][lane.ROTATION_ANNOTATION]


def test_the_secret_is_made_once_and_a_new_one_rolls_the_groups(cluster, namespace, api):
    r = _reconciler(api)
    api.create(kube.INFERENCE_MODEL, namespace, inference_model("m", namespace, tpu=MULTI))
    r.reconcile(cluster.obj(IM, namespace, "m"))
    first = cluster.obj("v1/secrets", namespace, "m-lane")
    assert first and apply.controlled_by(first, cluster.obj(IM, namespace, "m")["metadata"]["uid"])
    assert cluster.obj("networking.k8s.io/v1/networkpolicies", namespace, "m-lane")
    version = _annotation(cluster, namespace)
    assert version == lane.version(first)

    r.reconcile(cluster.obj(IM, namespace, "m"))  # a resync: the running groups keep their secret
    assert cluster.obj("v1/secrets", namespace, "m-lane")["data"] == first["data"]
    assert _annotation(cluster, namespace) == version

    api.delete(kube.SECRET, namespace, "m-lane")  # rotation: a new secret, new groups
    r.reconcile(cluster.obj(IM, namespace, "m"))
    second = cluster.obj("v1/secrets", namespace, "m-lane")
    assert (
        second["data"] != first["data"] and _annotation(cluster, namespace) == lane.version(second) != version
    )


def test_a_foreign_secret_of_that_name_is_never_taken_over(cluster, namespace, api):
    api.create(
        kube.SECRET,
        namespace,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "m-lane"}, "data": {"x": "eA=="}},
    )
    api.create(kube.INFERENCE_MODEL, namespace, inference_model("m", namespace, tpu=MULTI))
    with pytest.raises(apply.OwnershipConflict, match="Secret 'm-lane'"):
        _reconciler(api).reconcile(cluster.obj(IM, namespace, "m"))
    assert cluster.obj(LWS, namespace, "m") is None  # nothing runs on a secret it does not own


def _pod(name: str, message: str, ready: bool = False, finished: str = "2026-12-05T03:00:00Z") -> dict:
    term = {"exitCode": 1, "message": message, "finishedAt": finished}
    return {
        "metadata": {"name": name},
        "status": {
            "containerStatuses": [
                {"ready": ready, "state": {"running": {}}, "lastState": {"terminated": term}}
            ]
        },
    }


def test_the_status_names_the_pod_whose_group_failed_and_keeps_it():
    m = _model(tpu=MULTI)
    why = "GroupFailedError: worker 2 (pod big-0-2) sent nothing for 5.0s: its process is gone, stopped or cut off"
    pods = [
        _pod("big-0", why),
        _pod("big-0-1", "GroupFailedError: the group failed: worker 2 ...", finished="2026-12-05T02:59:59Z"),
    ]
    workload = {"status": {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 1}}
    st = status.reconciled(m, workload, {}, "2026-12-05T03:00:05Z", pods)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == lane.GROUP_FAILED
    assert degraded["message"].startswith("pod big-0: worker 2 (pod big-0-2) sent nothing for 5.0s")
    assert st["lastGroupFailure"]["message"] == degraded["message"]
    # the group is recreated (its pods and their messages are gone): the condition clears, the record stays
    healthy = {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}
    later = status.reconciled(m, healthy, st, "2026-12-05T03:10:00Z", [])
    assert next(c for c in later["conditions"] if c["type"] == "Degraded")["status"] == "False"
    assert "lastGroupFailure" not in later  # not rewritten: the stored one stays (status_patch keeps it)
    assert status.status_patch(st, later) is None or "lastGroupFailure" not in status.status_patch(st, later)


def test_the_status_reports_a_group_failure_through_the_api(cluster, namespace, api):
    r = _reconciler(api)
    api.create(kube.INFERENCE_MODEL, namespace, inference_model("m", namespace, tpu=MULTI))
    r.reconcile(cluster.obj(IM, namespace, "m"))
    labels = manifests.selector_labels(spec.parse(cluster.obj(IM, namespace, "m")))
    why = "GroupFailedError: worker 1 (pod m-0-1) closed the step lane (connection closed: its process died?)"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "m-0", "labels": labels},
        "spec": {"containers": [{"name": manifests.CONTAINER_NAME, "image": "x"}]},
        "status": _pod("m-0", why)["status"],
    }
    api.create(kube.POD, namespace, pod)
    r.reconcile(cluster.obj(IM, namespace, "m"))
    stored = cluster.obj(IM, namespace, "m")
    assert condition(stored, "Degraded")["reason"] == lane.GROUP_FAILED
    assert stored["status"]["lastGroupFailure"]["message"].startswith(
        "pod m-0: worker 1 (pod m-0-1) closed the step lane"
    )


def test_the_operator_records_a_group_failure_as_the_pod_reports_it(
    cluster, namespace, api, create_model, start_operator
):
    """The running operator sees the pod event (the LeaderWorkerSet deletes the pod right after): the
    model's status keeps which pod failed and why, and a Warning Event says it."""
    from kmock_harness import wait_for

    start_operator()
    create_model("m", tpu=MULTI)
    lws = wait_for(lambda: cluster.obj(LWS, namespace, "m"), 30, message="LeaderWorkerSet")
    labels = dict(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"])
    why = "GroupFailedError: worker 3 (pod m-0-3) sent nothing for 5.0s: its process is gone, stopped or cut off"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "m-0", "labels": labels},
        "spec": {"containers": [{"name": manifests.CONTAINER_NAME, "image": "x"}]},
        "status": _pod("m-0", why)["status"],
    }

    def failure():
        return (cluster.obj(IM, namespace, "m").get("status") or {}).get("lastGroupFailure")

    # the operator's pod watch starts beside its model handlers, a moment after the LeaderWorkerSet shows
    # (seconds on a loaded machine): a pod that came and went before it was never there for it, so the
    # group fails again until one is seen
    for _ in range(60):  # 2 s a try, two minutes in all: a loaded machine starts the watch late
        api.create(kube.POD, namespace, pod)
        api.delete(kube.POD, namespace, "m-0")  # the group is recreated at once
        try:
            recorded = wait_for(failure, 2, message="status", exact=True)
            break
        except AssertionError:
            continue
    recorded = wait_for(failure, 5, message="status")
    assert (
        recorded["message"]
        == "pod m-0: worker 3 (pod m-0-3) sent nothing for 5.0s: its process is gone, stopped or cut off"
    )
    events = wait_for(
        lambda: (
            [e for e in cluster.objects("events", namespace) if e.get("reason") == lane.GROUP_FAILED] or None
        ),
        30,
        message="a GroupFailed event",
    )
    assert events[0]["type"] == "Warning" and "worker 3 (pod m-0-3)" in events[0]["message"]
