"""The operator for real: `python -m vsurge_operator` with a kubeconfig against kube-apiserver 1.20 + the
aggregated CRD server, the controller-manager making ReplicaSets and Pods, garbage collection by owner
references. The test plays the kubelet (pods Ready on 127.0.0.X) and kubectl.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
from clusterkit import (
    IM,
    REPLICA_SET,
    Kubelet,
    condition,
    events,
    inference_model,
    kubectl,
    pods,
    start_operator,
    wait_for,
)

from vsurge_operator import kube, lane


@pytest.fixture
def api(k8s):
    return k8s.kube()


@pytest.fixture
def kubelet(api, namespace) -> Iterator[Kubelet]:
    k = Kubelet(api, namespace).start()
    try:
        yield k
    finally:
        k.stop()


@pytest.fixture
def operator(k8s, namespace, tmp_path):
    started = []

    def start(*args: str, log: str = "operator.log"):
        proc = start_operator(k8s.kubeconfig, tmp_path / log, f"--namespace={namespace}", *args)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.stop()


def _status(api, namespace, name):
    return (api.get(IM, namespace, name) or {}).get("status") or {}


def _versions(api, namespace, name, kinds=(kube.DEPLOYMENT, kube.SERVICE, kube.PDB)):
    return {
        r.kind: (api.get(r, namespace, name) or {}).get("metadata", {}).get("resourceVersion") for r in kinds
    }


def _scale(k8s, api, namespace, name, replicas):
    """`kubectl scale im/NAME --replicas=N` (through the scale subresource); the client's call without kubectl."""
    out = kubectl(k8s.kubeconfig, "scale", "-n", namespace, f"im/{name}", f"--replicas={replicas}")
    if out is None:
        api.patch(IM, namespace, name, {"spec": {"replicas": replicas}}, subresource="scale")


def test_cpu_model_deployment_pods_status_scale_drift_and_gc(k8s, api, namespace, operator, kubelet):
    operator()
    im = api.create(IM, namespace, inference_model("cpu", namespace, replicas=2))
    uid = im["metadata"]["uid"]

    # Deployment, Service and PDB, each controlled by the model (the uid the server gave it).
    for res in (kube.DEPLOYMENT, kube.SERVICE, kube.PDB):
        obj = wait_for(lambda res=res: api.get(res, namespace, "cpu"), message=f"{res.kind} created")
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("InferenceModel", uid, True)
    svc = api.get(kube.SERVICE, namespace, "cpu")
    assert svc["spec"]["clusterIP"]  # allocated by the real server
    pdb = api.get(kube.PDB, namespace, "cpu")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"

    # The controller-manager makes one ReplicaSet and two pods; our kubelet reports them Ready.
    rs = wait_for(lambda: api.list(REPLICA_SET, namespace, "vsurge.io/model=cpu"), message="ReplicaSet")
    assert len(rs) == 1
    wait_for(
        lambda: len([p for p in pods(api, namespace, "cpu") if p["status"].get("podIP")]) == 2,
        message="2 pods",
    )
    st = wait_for(
        lambda: (s := _status(api, namespace, "cpu")).get("readyReplicas") == 2 and s,
        message="status.readyReplicas 2",
    )
    ready = condition({"status": st}, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "Serving")
    assert st["observedGeneration"] == 1 and st["workloadKind"] == "Deployment"
    assert st["selector"] == "app.kubernetes.io/name=vsurge-server,vsurge.io/model=cpu"
    assert st["endpoint"] == f"http://cpu.{namespace}.svc.cluster.local:11556"
    assert condition({"status": st}, "Degraded")["status"] == "False"

    # Resyncs (every 2 s) against the real server's defaulted objects write nothing.
    before = _versions(api, namespace, "cpu")
    import time

    time.sleep(5)
    assert _versions(api, namespace, "cpu") == before
    assert not events(api, namespace, "Updated")

    # kubectl scale through the scale subresource: spec.replicas -> Deployment -> a third pod.
    _scale(k8s, api, namespace, "cpu", 3)
    wait_for(
        lambda: api.get(kube.DEPLOYMENT, namespace, "cpu")["spec"]["replicas"] == 3, message="Deployment 3"
    )
    wait_for(lambda: _status(api, namespace, "cpu").get("readyReplicas") == 3, message="3 ready")
    scale = api.request("GET", IM.path(namespace, "cpu", "scale"))
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 3)
    assert scale["status"]["selector"] == "app.kubernetes.io/name=vsurge-server,vsurge.io/model=cpu"
    assert api.get(IM, namespace, "cpu")["metadata"]["generation"] == 2  # spec changed, status did not count

    # Drift: a deleted Service comes back, a hand-edited Deployment is put back.
    api.delete(kube.SERVICE, namespace, "cpu")
    wait_for(lambda: api.get(kube.SERVICE, namespace, "cpu"), message="Service recreated")
    api.patch(kube.DEPLOYMENT, namespace, "cpu", {"spec": {"replicas": 1}})
    wait_for(
        lambda: api.get(kube.DEPLOYMENT, namespace, "cpu")["spec"]["replicas"] == 3, message="drift repaired"
    )

    # Scale to zero: the pods go, Ready=False ScaledToZero.
    _scale(k8s, api, namespace, "cpu", 0)
    wait_for(lambda: not pods(api, namespace, "cpu"), message="pods deleted by the ReplicaSet controller")
    wait_for(
        lambda: condition(api.get(IM, namespace, "cpu"), "Ready").get("reason") == "ScaledToZero", message="0"
    )

    # Deleting the model: kopf's finalizer goes, and the garbage collector removes everything it owned.
    api.delete(IM, namespace, "cpu")
    wait_for(lambda: api.get(IM, namespace, "cpu") is None, message="model deleted (finalizer removed)")
    for res in (kube.DEPLOYMENT, kube.SERVICE, kube.PDB, REPLICA_SET):
        wait_for(
            lambda res=res: (
                api.get(res, namespace, "cpu") is None and not api.list(res, namespace, "vsurge.io/model=cpu")
            ),
            90,
            message=f"{res.kind} garbage-collected",
        )
    assert not kubelet.errors


def test_tpu_single_host_deployment_multi_host_lws_switch_and_invalid(k8s, api, namespace, operator, kubelet):
    operator()
    api.create(
        IM,
        namespace,
        inference_model("small", namespace, tpu={"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"}),
    )
    big = api.create(
        IM,
        namespace,
        inference_model("big", namespace, tpu={"accelerator": "tpu-v5-lite-podslice", "topology": "4x4"}),
    )
    api.create(
        IM,
        namespace,
        inference_model("bad", namespace, tpu={"accelerator": "tpu-v5-lite-podslice", "topology": "4x4x4"}),
    )

    dep = wait_for(lambda: api.get(kube.DEPLOYMENT, namespace, "small"), message="small Deployment")
    pod_spec = dep["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"
    assert pod_spec["containers"][0]["resources"]["limits"]["google.com/tpu"] in ("8", 8)
    # The pods the controller-manager made carry the same placement (the real pod template was accepted).
    pod = wait_for(lambda: pods(api, namespace, "small"), message="small pod")[0]
    assert pod["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"

    lws = wait_for(lambda: api.get(kube.LEADER_WORKER_SET, namespace, "big"), message="LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 4
    assert lws["metadata"]["ownerReferences"][0]["uid"] == big["metadata"]["uid"]
    # its step lane (operator/vsurge_operator/lane.py), as the real API server stored it: the Secret the
    # leader and the workers mount, and the NetworkPolicy that keeps other pods off the lane
    secret = api.get(kube.SECRET, namespace, "big-lane")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == big["metadata"]["uid"]
    assert len(base64.b64decode(secret["data"]["lane.key"])) >= 32
    for role in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][role]
        assert pod["metadata"]["annotations"]["vsurge.io/lane-secret"] == lane.version(secret)
        (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == lane.VOLUME]
        assert vol["secret"]["secretName"] == "big-lane"
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["VSURGE_LANE_SECRET_FILE"] == f"{lane.SECRET_DIR}/lane.key"
    policy = wait_for(lambda: api.get(kube.NETWORK_POLICY, namespace, "big-lane"), message="NetworkPolicy")
    assert policy["metadata"]["ownerReferences"][0]["uid"] == big["metadata"]["uid"]
    ports = {p["port"] for p in policy["spec"]["ingress"][1]["ports"]}
    assert 8477 not in ports and 8476 not in ports
    wait_for(
        lambda: _status(api, namespace, "big").get("workloadKind") == "LeaderWorkerSet", message="status"
    )

    # Invalid for the operator (not offered by v5e) although the schema passed it: Degraded, nothing made.
    wait_for(
        lambda: condition(api.get(IM, namespace, "bad"), "Degraded").get("reason") == "InvalidSpec",
        message="bad",
    )
    assert "spec.tpu.topology" in condition(api.get(IM, namespace, "bad"), "Degraded")["message"]
    assert (
        api.get(kube.DEPLOYMENT, namespace, "bad") is None and api.get(kube.SERVICE, namespace, "bad") is None
    )
    # kopf posts the event from its own queue, after the status was written: wait for it, do not read once.
    wait_for(
        lambda: any(e["involvedObject"]["name"] == "bad" for e in events(api, namespace, "InvalidSpec")),
        message="InvalidSpec event",
    )

    # Several hosts -> one host: the LeaderWorkerSet is replaced by a Deployment, and the lane's policy goes.
    api.patch(IM, namespace, "big", {"spec": {"tpu": {"topology": "2x4"}}})
    wait_for(lambda: api.get(kube.DEPLOYMENT, namespace, "big"), message="big Deployment")
    wait_for(lambda: api.get(kube.LEADER_WORKER_SET, namespace, "big") is None, message="LWS deleted")
    wait_for(lambda: api.get(kube.NETWORK_POLICY, namespace, "big-lane") is None, message="policy deleted")
    wait_for(
        lambda: _status(api, namespace, "big").get("workloadKind") == "Deployment", message="status kind"
    )

    # A fix of the bad spec is picked up.
    api.patch(IM, namespace, "bad", {"spec": {"tpu": {"topology": "4x4"}}})
    wait_for(lambda: api.get(kube.LEADER_WORKER_SET, namespace, "bad"), message="bad -> LWS once valid")
    wait_for(
        lambda: condition(api.get(IM, namespace, "bad"), "Degraded").get("status") == "False", message="ok"
    )
    for name in ("small", "big", "bad"):
        api.delete(IM, namespace, name)
    for res in (kube.DEPLOYMENT, kube.LEADER_WORKER_SET, kube.PDB):
        # the controller-manager's garbage collector runs on its own schedule: slow on a loaded machine
        wait_for(lambda res=res: not api.list(res, namespace), 90, message=f"{res.kind}s garbage-collected")


def test_restart_and_two_racing_operators_create_no_duplicates(k8s, api, namespace, operator, kubelet):
    names = [f"m{i}" for i in range(4)]
    # Two operators at once (as during a rolling restart with no peering): both race to create every
    # object; the loser gets 409 AlreadyExists from the server and must converge, not duplicate or fail.
    first = operator(log="first.log")
    operator(log="second.log")
    for name in names:
        api.create(IM, namespace, inference_model(name, namespace, replicas=1))
    for name in names:
        wait_for(
            lambda name=name: _status(api, namespace, name).get("readyReplicas") == 1,
            30,
            message=f"{name} ready",
        )
    assert len(api.list(kube.DEPLOYMENT, namespace)) == len(names)
    assert len(api.list(REPLICA_SET, namespace)) == len(names)
    assert len(api.list(kube.POD, namespace)) == len(names)

    # A hard kill and a restart: resume finds everything in place and writes nothing to the workloads.
    before = {n: _versions(api, namespace, n) for n in names}
    first.kill()
    operator(log="third.log")
    import time

    time.sleep(5)  # resume + two resyncs of each model
    assert {n: _versions(api, namespace, n) for n in names} == before
    for name in names:
        st = _status(api, namespace, name)
        assert condition({"status": st}, "Degraded")["status"] == "False", st
    assert len(api.list(REPLICA_SET, namespace)) == len(names)


def test_edit_storm_converges_to_the_last_edit(k8s, api, namespace, operator, kubelet):
    """Users edit the model while the operator writes to it (kopf's finalizer and annotation patches carry
    the resourceVersion they read; the status and scale writes race with the edits): whatever conflicts the
    server answers, the workload ends at the last edit and the model is healthy."""
    import threading
    import time

    operator()
    api.create(IM, namespace, inference_model("storm", namespace, replicas=1))
    stop = threading.Event()
    edits: list[int] = []
    conflicts: list[int] = []

    def editor() -> None:  # like `kubectl edit`: read, change, write back with the resourceVersion read
        n = 0
        while not stop.is_set():
            n += 1
            live = api.get(IM, namespace, "storm")
            body = {**live, "spec": {**live["spec"], "replicas": 1 + n % 3}}
            body["metadata"] = {
                **live["metadata"],
                "annotations": {**(live["metadata"].get("annotations") or {}), "edit": str(n)},
            }
            try:
                api.request("PUT", IM.path(namespace, "storm"), body)
                edits.append(body["spec"]["replicas"])
            except kube.ApiException as e:
                assert e.status == 409, e.body  # a stale resourceVersion: the server refuses the write
                conflicts.append(n)
            time.sleep(0.05)

    t = threading.Thread(target=editor, daemon=True)
    t.start()
    time.sleep(4)
    stop.set()
    t.join(10)
    assert edits, "no edit got through"
    last = api.get(IM, namespace, "storm")["spec"]["replicas"]
    wait_for(
        lambda: api.get(kube.DEPLOYMENT, namespace, "storm")["spec"]["replicas"] == last,
        20,
        message="last edit",
    )
    wait_for(
        lambda: _status(api, namespace, "storm").get("readyReplicas") == last,
        20,
        message="ready at the last edit",
    )
    # the status write that records the last generation may trail the workload by one handler run
    model = wait_for(
        lambda: (
            (m := api.get(IM, namespace, "storm"))["status"].get("observedGeneration")
            == m["metadata"]["generation"]
            and m
        ),
        30,
        message="observedGeneration reaches the last generation",
    )
    assert model["metadata"]["finalizers"] and condition(model, "Degraded")["status"] == "False"
    assert len(api.list(kube.DEPLOYMENT, namespace)) == 1
    print(f"{len(edits)} edits, {len(conflicts)} refused with 409 (stale resourceVersion)")
