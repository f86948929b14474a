"""Status and conditions, computed purely from the spec, the workload's status and the previous status."""

from __future__ import annotations

from typing import Any

import pytest

from vsurge_operator import spec, status


def model(**overrides: Any) -> spec.ModelSpec:
    s: dict[str, Any] = {"model": {"source": "default"}, "image": "img"}
    s.update(overrides)
    return spec.parse({"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 4}, "spec": s})


def workload(replicas: int, ready: int, updated: int | None = None) -> dict[str, Any]:
    return {
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
        }
    }


def conds(st: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


@pytest.mark.parametrize(
    ("m", "w", "expected"),
    [
        (
            model(replicas=2),
            workload(2, 2),
            {
                "Ready": ("True", "Serving"),
                "Progressing": ("False", "Stable"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            model(replicas=2),
            workload(1, 0),
            {
                "Ready": ("False", "NoReplicasReady"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            model(replicas=3),
            workload(3, 2),
            {
                "Ready": ("True", "Serving"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            model(replicas=2),
            workload(2, 2, updated=1),
            {
                "Ready": ("True", "Serving"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            model(replicas=1),
            workload(3, 3),
            {
                "Ready": ("True", "Serving"),
                "Progressing": ("True", "ScalingDown"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            model(replicas=0),
            workload(0, 0),
            {
                "Ready": ("False", "ScaledToZero"),
                "Progressing": ("False", "Stable"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            model(),
            None,
            {
                "Ready": ("False", "NoReplicasReady"),
                "Progressing": ("True", "RollingOut"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
    ],
)
def test_reconciled_conditions(m, w, expected):
    st = status.reconciled(m, w, None, "2026-01-01T00:00:00Z")
    assert conds(st) == expected
    assert st["observedGeneration"] == 4
    assert st["desiredReplicas"] == m.desired_replicas()
    assert st["endpoint"] == "http://m.ns.svc.cluster.local:11556"
    assert [c["type"] for c in st["conditions"]] == ["Ready", "Progressing", "Degraded"]


def test_multi_host_reports_leader_worker_set():
    st = status.reconciled(model(tpu={"accelerator": "tpu-v5p-slice", "topology": "2x2x2"}), None, None, "t")
    assert st["workloadKind"] == "LeaderWorkerSet"


def test_transition_time_moves_only_when_status_flips():
    m = model(replicas=1)
    first = status.reconciled(m, workload(1, 0), None, "T1")
    second = status.reconciled(m, workload(1, 0), first, "T2")
    assert all(c["lastTransitionTime"] == "T1" for c in second["conditions"])
    third = status.reconciled(m, workload(1, 1), second, "T3")
    times = {c["type"]: c["lastTransitionTime"] for c in third["conditions"]}
    assert times == {"Ready": "T3", "Progressing": "T3", "Degraded": "T1"}


def test_invalid_spec_and_api_error_statuses():
    ok = status.reconciled(model(replicas=1), workload(1, 1), None, "T1")
    previous = {**ok}
    invalid = status.failed(previous, 5, "InvalidSpec", "spec.tpu.topology: nope", "T2", invalid=True)
    c = {x["type"]: x for x in invalid["conditions"]}
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "InvalidSpec")
    assert "spec.tpu.topology" in c["Degraded"]["message"]
    # Old pods keep serving an invalid update, so Ready stays True, but with the reason why nothing changes.
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("True", "InvalidSpec")
    assert invalid["observedGeneration"] == 5

    api = status.failed(previous, 5, "ApiError", "Kubernetes API returned 500", "T2", invalid=False)
    c = {x["type"]: x for x in api["conditions"]}
    assert c["Degraded"]["status"] == "True" and c["Ready"] == {**ok["conditions"][0]}
    assert "observedGeneration" not in api


def test_status_patch_is_minimal():
    old = {"a": 1, "b": {"c": 2}, "keep": True}
    assert status.status_patch(old, {"a": 1, "b": {"c": 2}}) is None
    assert status.status_patch(old, {"a": 2, "b": {"c": 2}}) == {"a": 2}
    assert status.status_patch(None, {"a": 1}) == {"a": 1}
    assert status.status_patch({"x": 1}, {"x": None}) == {"x": None}


def test_rfc3339():
    import datetime

    t = datetime.datetime(2026, 1, 2, 3, 4, 5, 678, tzinfo=datetime.UTC)
    assert status.now_rfc3339(t) == "2026-01-02T03:04:05Z"
