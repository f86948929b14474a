"""Autoscaling end to end: the operator scrapes real /metrics servers on loopback and scales through /scale.

The fake kubelet keeps one pod per replica of the Deployment; every pod is a real HTTP server that
serves ``vsurge_slot_occupancy`` from a shared board the test moves. Intervals and windows are short.
"""

from __future__ import annotations

import time

from kmock_harness import KMockCluster, wait_for
from patience import ceiling

from vsurge_operator import kube

IM = "vsurge.io/v1alpha1/inferencemodels"
DEP = "apps/v1/deployments"


def _replicas(cluster: KMockCluster, namespace: str, name: str) -> int | None:
    obj = cluster.obj(IM, namespace, name)
    return None if obj is None else obj["spec"].get("replicas")


def _spec_replicas_history(cluster: KMockCluster, resource: str, namespace: str, name: str) -> list[int]:
    return [
        v["spec"]["replicas"]
        for v in cluster.history(resource, namespace, name)
        if v and v.get("spec", {}).get("replicas") is not None
    ]


def test_replicas_follow_occupancy_within_windows_and_bounds(
    cluster, namespace, start_operator, create_model, kubelet, board
):
    board.occupancy = 0.3
    start_operator()
    create_model(
        "auto",
        autoscaling={
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 3,
            "target": 0.5,
            "intervalSeconds": 1,
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 6,
        },
    )
    wait_for(lambda: cluster.obj(DEP, namespace, "auto"), message="Deployment created")

    # Low load: the autoscaler reads the pod, reports occupancy, and keeps the minimum.
    def observed(value: float):
        def check():
            st = (cluster.obj(IM, namespace, "auto") or {}).get("status", {})
            return st if st.get("occupancy") == value else None

        return check

    st = wait_for(observed(0.3), message="occupancy 0.3 in status")
    assert st["autoscaler"]["metric"] == "slotOccupancy"
    assert _replicas(cluster, namespace, "auto") in (None, 1)

    # A spike: 0.95 against 0.5 -> 1 -> 2 -> 3 (clamped at maxReplicas, 4 would be recommended).
    board.occupancy = 0.95
    t_up = time.monotonic()
    wait_for(lambda: _replicas(cluster, namespace, "auto") == 3, 15, message="scaled up to max")
    assert time.monotonic() - t_up < ceiling(10)
    wait_for(
        lambda: cluster.obj(DEP, namespace, "auto")["spec"]["replicas"] == 3, 5, message="Deployment at 3"
    )
    wait_for(lambda: len(kubelet.servers) == 3, 5, message="three pods serving metrics")
    time.sleep(1.5)  # stays at the maximum while the load stays high
    assert _replicas(cluster, namespace, "auto") == 3
    st = cluster.obj(IM, namespace, "auto")["status"]["autoscaler"]
    assert st["reason"] == "TooManyReplicas" and st["recommendedReplicas"] > 3

    # The load drops: no scale-down before the 6 s window has passed, then down to the minimum. The last
    # high sample may predate the drop by an interval plus a slow pass, hence the 3 s lower bound
    # (without the window it takes about one interval).
    board.occupancy = 0.05
    t_down = time.monotonic()
    wait_for(lambda: _replicas(cluster, namespace, "auto") < 3, 20, interval=0.05, message="scaled down")
    waited = time.monotonic() - t_down
    assert waited >= 3.0, f"scaled down after {waited:.1f}s, inside the 6 s stabilization window"
    assert waited < ceiling(15)
    wait_for(lambda: _replicas(cluster, namespace, "auto") == 1, 10, message="back to minReplicas")
    wait_for(observed(0.05), message="occupancy 0.05 in status")
    time.sleep(1.5)
    assert _replicas(cluster, namespace, "auto") == 1

    # Never outside [min, max], neither on the InferenceModel nor on the Deployment.
    for resource in (IM, DEP):
        history = _spec_replicas_history(cluster, resource, namespace, "auto")
        assert history and all(1 <= r <= 3 for r in history), (resource, history)
        assert 3 in history
    # kopf posts events from its own task, after the patch: wait for them, do not read once.
    wait_for(
        lambda: {"ScaledUp", "ScaledDown"} <= {e["reason"] for e in cluster.objects("events", namespace)},
        10,
        message="ScaledUp and ScaledDown events",
    )
    # Every change went through the scale subresource.
    scale_patches = cluster.requests(
        method="PATCH", plural="inferencemodels", subresource="scale", agent=kube.USER_AGENT
    )
    assert len(scale_patches) >= 3
    assert not kubelet.errors


def test_missing_metrics_hold_replicas(cluster, namespace, start_operator, create_model, kubelet, board):
    board.occupancy = 0.05
    board.silent.update({"quiet-pod-0", "quiet-pod-1"})  # both pods answer /metrics without the series
    start_operator()
    create_model(
        "quiet",
        replicas=2,
        autoscaling={
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 4,
            "target": 0.5,
            "intervalSeconds": 1,
            "scaleDownStabilizationSeconds": 0,
        },
    )
    wait_for(lambda: len(kubelet.servers) == 2, 10, message="two pods")

    def reason() -> str | None:
        st = (cluster.obj(IM, namespace, "quiet") or {}).get("status", {})
        return (st.get("autoscaler") or {}).get("reason")

    wait_for(lambda: reason() == "NoMetrics", 10, message="NoMetrics reported")
    time.sleep(2.5)  # several intervals without metrics: nothing moves
    assert _replicas(cluster, namespace, "quiet") == 2
    assert reason() == "NoMetrics"

    board.silent.clear()  # metrics are back, and they say the pods are idle
    wait_for(lambda: _replicas(cluster, namespace, "quiet") == 1, 10, message="scaled down once measured")
