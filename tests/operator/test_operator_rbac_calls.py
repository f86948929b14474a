"""The chart's RBAC covers every call the operator really makes.

The operator runs through a scenario (create, autoscale through /scale, status, Events, a deleted Deployment
recreated, a switch to a multi-host LeaderWorkerSet) against KMock; every request KMock saw is mapped to its
RBAC (group, resource, verb) and must be allowed by the tables tests/helm/test_helm_rbac.py holds the chart
to. Together: chart == table ⊇ calls.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from kmock_harness import wait_for

from vsurge_operator import kube

HELM_TESTS = Path(__file__).resolve().parent.parent / "helm"
IM = "vsurge.io/v1alpha1/inferencemodels"
DEP = "apps/v1/deployments"
LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"


def _rbac_tables():
    sys.path.insert(0, str(HELM_TESTS))  # test_helm_rbac imports its sibling chartkit
    try:
        spec = importlib.util.spec_from_file_location("helm_rbac_tables", HELM_TESTS / "test_helm_rbac.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(HELM_TESTS))


def rbac_verb(request) -> str | None:
    action = str(getattr(request.action, "value", request.action) or "").lower()
    method = str(getattr(request.method, "value", request.method)).upper()
    if action == "watch":
        return "watch"
    if action == "list":
        return "list"
    if action == "create":
        return "create"
    if action == "fetch":
        return "get"
    if action == "delete":
        return "delete"
    if action == "update":
        return "patch" if method == "PATCH" else "update"
    return None


def test_every_operator_call_is_allowed_by_the_chart(
    cluster, namespace, api, start_operator, create_model, kubelet, board
):
    tables = _rbac_tables()
    board.occupancy = 0.95
    start_operator()
    create_model(
        "rbac",
        autoscaling={
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 2,
            "target": 0.5,
            "intervalSeconds": 1,
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 60,
        },
    )
    wait_for(lambda: cluster.obj(DEP, namespace, "rbac"), message="Deployment created")
    wait_for(
        lambda: (cluster.obj(IM, namespace, "rbac") or {}).get("spec", {}).get("replicas") == 2,
        20,
        message="scaled through /scale",
    )
    api.delete(kube.DEPLOYMENT, namespace, "rbac")
    wait_for(lambda: cluster.obj(DEP, namespace, "rbac"), 20, message="Deployment recreated")
    api.patch(
        kube.INFERENCE_MODEL,
        namespace,
        "rbac",
        {"spec": {"tpu": {"accelerator": "tpu-v5-lite-podslice", "topology": "4x4"}}},
    )
    wait_for(
        lambda: cluster.obj(LWS, namespace, "rbac"), 20, message="LeaderWorkerSet for a multi-host slice"
    )

    perms = tables.expected_operator([namespace])
    seen, denied = set(), []
    for r in cluster.requests():
        agent = r.headers.get("User-Agent", "")
        if not (agent.startswith("kopf/") or agent.startswith(kube.USER_AGENT)):
            continue  # the test's own client and the fake kubelet
        if r.resource is None or r.resource.plural is None:
            continue  # discovery (/api, /apis, /version) needs no RBAC
        verb = rbac_verb(r)
        if verb is None:
            continue
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        group = r.resource.group or ""
        seen.add((group, resource, verb))
        if not tables.allowed(perms, group, resource, verb, r.namespace):
            denied.append((group, resource, verb, r.namespace))
    assert not denied, f"calls the chart's RBAC would refuse: {sorted(set(denied))}"
    # the scenario exercised the operator's own rows, so the check above had something to check
    for must in [
        ("vsurge.io", "inferencemodels/scale", "patch"),
        ("apps", "deployments", "create"),
        ("", "pods", "list"),
        ("", "events", "create"),
        ("vsurge.io", "inferencemodels/status", "patch"),
    ]:
        assert must in seen, f"{must} never called; seen: {sorted(seen)}"
