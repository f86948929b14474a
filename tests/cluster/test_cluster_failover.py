"""No single point of failure: operator replicas with kopf peering, the active one killed mid-work.

As the chart runs them: several `python -m vsurge_operator` processes on one KopfPeering (the chart's
CRDs, registered on the kit), each with a seniority priority, so the first started is active and the others
stand by. The active one is SIGKILLed (no chance to leave the peering) right before a spec edit (a rollout)
and right before the router's wake-up of a model at zero replicas (a scale subresource patch); the standby
must take over and finish both within a stated bound: the peering lifetime (how long a silent peer counts as
alive) plus BOUND_MARGIN_S for the takeover's re-listing and one reconcile. Nothing may be duplicated and
nothing may flap: one Deployment, Service and PDB, exactly one Deployment write per change.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from clusterkit import (
    IM,
    KIT,
    REPLICA_SET,
    REPO,
    Kubelet,
    condition,
    inference_model,
    pods,
    start_operator,
    wait_for,
)

from vsurge_operator import kube

PEERING = "vsurge-operator"
LIFETIME_S = 6  # --peering-lifetime of the test (the chart's default is 15 s)
BOUND_MARGIN_S = 20
KOPF_PEERING = kube.Resource("kopf.dev/v1", "kopfpeerings", "KopfPeering")
TIMINGS: dict[str, float] = {}


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
def peering(k8s, api, namespace) -> str:
    """The chart's kopf peering CRDs on the cluster, and the KopfPeering the chart makes in a namespace."""
    crds = REPO / "helm" / "vsurge" / "crds" / "kopfpeerings.kopf.dev.yaml"
    p = subprocess.run(
        [str(KIT / "register-crd-group"), str(k8s.dir), "-f", str(crds)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    api.create(
        KOPF_PEERING,
        namespace,
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "KopfPeering",
            "metadata": {"name": PEERING, "namespace": namespace},
        },
    )
    return PEERING


@pytest.fixture
def replicas(k8s, namespace, tmp_path, peering):
    started = []

    def start(log: str):
        proc = start_operator(
            k8s.kubeconfig,
            tmp_path / log,
            f"--namespace={namespace}",
            f"--peering={peering}",
            f"--peering-lifetime={LIFETIME_S}",
            standalone=False,
        )
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.stop()


def _peers(api: kube.Kube, namespace: str) -> dict[str, Any]:
    obj = api.get(KOPF_PEERING, namespace, PEERING) or {}
    return {k: v for k, v in (obj.get("status") or {}).items() if isinstance(v, dict)}


def _active(proc) -> bool:
    """kopf's own log: the InferenceModel watch-stream of this replica was resumed and not paused since."""
    log = proc.log_path.read_text(errors="replace")  # the whole log (proc.log() is its tail)
    stream = "the watch-stream for inferencemodels"
    return log.rfind(f"Resuming {stream}") > log.rfind(f"Pausing {stream}")


def _standby(proc, api: kube.Kube, namespace: str, count: int) -> None:
    """Until ``count`` replicas keep the peering alive, ``proc`` among them, its model stream paused."""
    wait_for(lambda: len(_peers(api, namespace)) == count, 30, message=f"{count} peers")
    wait_for(lambda: proc.log().count("Keep-alive in") >= 2, 30, message="the new replica keeps alive")
    assert not _active(proc), "a younger replica took over from a live senior one"


def _generation(api: kube.Kube, namespace: str, name: str) -> int:
    return api.get(kube.DEPLOYMENT, namespace, name)["metadata"]["generation"]


def _env(dep: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_standby_finishes_a_rollout_and_a_wake_from_zero_after_the_active_replica_is_killed(
    api, namespace, replicas, kubelet
):
    a = replicas("a.log")
    # Work for the first leader: a serving model, and a model scaled to zero (autoscaled, minReplicas 0).
    api.create(IM, namespace, inference_model("roll", namespace, replicas=2))
    auto = {"enabled": True, "minReplicas": 0, "maxReplicas": 2}
    api.create(IM, namespace, inference_model("wake", namespace, replicas=0, autoscaling=auto))
    wait_for(lambda: (api.get(IM, namespace, "roll") or {}).get("status", {}).get("readyReplicas") == 2, 60)
    wait_for(lambda: condition(api.get(IM, namespace, "wake"), "Ready").get("reason") == "ScaledToZero", 60)
    b = replicas("b.log")
    _standby(b, api, namespace, 2)
    assert _active(a)  # the senior replica stays active

    # 1. A rollout: the active replica dies, then the spec changes.
    generation = _generation(api, namespace, "roll")
    t0 = time.monotonic()
    a.kill()
    api.patch(IM, namespace, "roll", {"spec": {"env": [{"name": "ROLLOUT", "value": "2"}]}})
    wait_for(
        lambda: _env(api.get(kube.DEPLOYMENT, namespace, "roll")).get("ROLLOUT") == "2",
        LIFETIME_S + BOUND_MARGIN_S,
        message="the standby carries the edit to the Deployment",
    )
    TIMINGS["rollout: kill -> Deployment patched"] = time.monotonic() - t0
    wait_for(
        lambda: (
            (s := (api.get(IM, namespace, "roll") or {}).get("status", {})).get("observedGeneration") == 2
            and s.get("readyReplicas") == 2
            and s.get("updatedReplicas", 2) == 2
            and len([p for p in pods(api, namespace, "roll") if "ROLLOUT" in str(p["spec"])]) == 2
        ),
        60,
        message="rollout finished: 2 new pods ready, status observed",
    )
    TIMINGS["rollout: kill -> rolled out and reported"] = time.monotonic() - t0
    assert _generation(api, namespace, "roll") == generation + 1  # one template write, no flapping
    assert len(api.list(REPLICA_SET, namespace, "vsurge.io/model=roll")) == 2  # the old and the new one

    # 2. A wake from zero: another replica stands by; the active one (b) dies, then the router scales.
    c = replicas("c.log")
    _standby(c, api, namespace, 2)  # a's entry was cleaned by b; b and c are left
    wake_generation = _generation(api, namespace, "wake")
    t0 = time.monotonic()
    b.kill()
    api.patch(IM, namespace, "wake", {"spec": {"replicas": 1}}, subresource="scale")
    wait_for(
        lambda: api.get(kube.DEPLOYMENT, namespace, "wake")["spec"]["replicas"] == 1,
        LIFETIME_S + BOUND_MARGIN_S,
        message="the standby scales the Deployment up",
    )
    TIMINGS["wake: kill -> Deployment scaled"] = time.monotonic() - t0
    wait_for(
        lambda: (api.get(IM, namespace, "wake") or {}).get("status", {}).get("readyReplicas") == 1,
        60,
        message="woken model ready",
    )
    TIMINGS["wake: kill -> ready"] = time.monotonic() - t0

    # Settled: a few resyncs and autoscaler passes of the new leader change nothing (no flap back to 0).
    time.sleep(3 * 2 + 1)
    assert api.get(IM, namespace, "wake")["spec"]["replicas"] == 1
    assert _generation(api, namespace, "wake") == wake_generation + 1
    assert len(pods(api, namespace, "wake")) == 1
    for name in ("roll", "wake"):
        for res in (kube.DEPLOYMENT, kube.SERVICE, kube.PDB):
            assert len([o for o in api.list(res, namespace) if o["metadata"]["name"] == name]) == 1
        (ref,) = api.get(kube.DEPLOYMENT, namespace, name)["metadata"]["ownerReferences"]
        assert ref["name"] == name
    assert len(api.list(REPLICA_SET, namespace, "vsurge.io/model=wake")) == 1
    assert _active(c)  # the last standby took over (b was killed while active)
    assert not kubelet.errors
    print("failover timings (s):", {k: round(v, 1) for k, v in TIMINGS.items()})
    for key, value in TIMINGS.items():
        if "Deployment" in key:
            assert value <= LIFETIME_S + BOUND_MARGIN_S, (key, value)
