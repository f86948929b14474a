"""RBAC enforced by the real authorizer: the chart's ServiceAccounts, ClusterRoles and bindings (rendered by
Helm's engine with the default values, applied in Helm's order) and the tokens the controller-manager issues
for them. The operator (`python -m vsurge_operator --all-namespaces`, as the chart runs it) and the router
(`vsurge route`) run with those tokens, not as admin: none of their calls may be forbidden while they do
their whole job (reconcile, status, events, scale from zero through the router), and calls outside their
tables are refused with 403.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from clusterkit import (
    IM,
    REPO,
    Kubelet,
    clean_env,
    condition,
    ensure_namespace,
    ensure_node,
    helm_order,
    inference_model,
    render_chart,
    server_side_apply,
    service_account_token,
    start_operator,
    vsurge_command,
    wait_for,
)
from kmock_harness import LoggedProcess, free_port
from kubernetes.client.exceptions import ApiException

from vsurge_operator import kube

RELEASE_NS = "vsurge-system"
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def _forbidden(api: kube.Kube, method: str, path: str, body: Any = None, **kw: Any) -> bool:
    try:
        api.request(method, path, body, **kw)
    except ApiException as e:
        if e.status == 403:
            assert "forbidden" in json.loads(e.body)["message"]
            return True
        raise AssertionError(f"{method} {path}: {e.status}, expected 403") from e
    return False


def test_operator_and_router_under_the_charts_service_accounts(k8s, namespace, tmp_path):
    admin = k8s.kube()
    rendered = render_chart({}, RELEASE_NS)
    ensure_namespace(admin, RELEASE_NS)
    rbac = [o for o in helm_order(rendered.objects) if o["kind"] in RBAC_KINDS]
    assert {o["kind"] for o in rbac} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    api_client = k8s.api_client()
    for obj in rbac:
        server_side_apply(api_client, obj)
    sa = {o["metadata"]["name"] for o in rbac if o["kind"] == "ServiceAccount"}
    assert sa == {"vsurge-operator", "vsurge-router"}
    configs = {
        name: k8s.token_kubeconfig(
            tmp_path / f"{name}.kubeconfig", service_account_token(admin, RELEASE_NS, name), RELEASE_NS
        )
        for name in sa
    }
    as_operator = kube.Kube(_client(configs["vsurge-operator"]))
    as_router = kube.Kube(_client(configs["vsurge-router"]))
    _wait_until_authorized(as_operator, "vsurge-operator", rbac, namespace)
    _wait_until_authorized(as_router, "vsurge-router", rbac, namespace)

    # Least privilege, proven by the server's authorizer: outside the tables -> 403.
    ns_path = f"/api/v1/namespaces/{namespace}"
    assert _forbidden(as_operator, "GET", f"{ns_path}/secrets")
    assert _forbidden(
        as_operator, "DELETE", f"/apis/vsurge.io/v1alpha1/namespaces/{namespace}/inferencemodels/x"
    )
    assert _forbidden(
        as_operator,
        "POST",
        f"{ns_path}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
        },
    )
    assert _forbidden(as_router, "GET", f"{ns_path}/secrets")
    # Secrets only through the Roles of secretNamespaces (the release namespace by default): a named get
    # there is allowed (404, not 403), a list never, and nothing outside it (the checks above)
    released = f"/api/v1/namespaces/{RELEASE_NS}/secrets"
    for who in (as_operator, as_router):
        assert _forbidden(who, "GET", released)  # list
        with pytest.raises(ApiException) as missing:
            who.request("GET", f"{released}/not-there")
        assert missing.value.status == 404
    assert _forbidden(
        as_router, "POST", released, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}}
    )
    assert _forbidden(as_router, "GET", f"{ns_path}/pods")  # its pods come from EndpointSlices only
    assert _forbidden(as_router, "GET", f"{ns_path}/endpoints")
    assert as_router.request("GET", f"/apis/discovery.k8s.io/v1beta1/namespaces/{namespace}/endpointslices")
    assert _forbidden(as_router, "GET", f"/apis/apps/v1/namespaces/{namespace}/deployments")
    assert _forbidden(
        as_router,
        "PATCH",
        f"/apis/vsurge.io/v1alpha1/namespaces/{namespace}/inferencemodels/x",
        {"spec": {"replicas": 5}},
        content_type=kube.MERGE_PATCH,
    )
    assert _forbidden(
        as_router,
        "PATCH",
        f"/apis/vsurge.io/v1alpha1/namespaces/{namespace}/inferencemodels/x/status",
        {"status": {}},
        content_type=kube.MERGE_PATCH,
    )

    # Bound to a Node, so that the EndpointSlice controller lists the pods the router sends requests to.
    ensure_node(admin, "rbac-test-node")
    kubelet = Kubelet(admin, namespace, node="rbac-test-node").start()
    # As the chart runs it: --all-namespaces, peering left to kopf (no KopfPeering CRD here: standalone).
    operator = start_operator(
        configs["vsurge-operator"], tmp_path / "operator.log", "--all-namespaces", standalone=False
    )
    port = free_port()
    router = LoggedProcess(
        [
            *vsurge_command(),
            "route",
            "--host=127.0.0.1",
            f"--port={port}",
            "--wake-timeout-seconds=3",
            "--log-level=info",
        ],
        tmp_path / "router.log",
        clean_env(KUBECONFIG=str(configs["vsurge-router"])),
    ).start()
    url = f"http://127.0.0.1:{port}"
    try:
        router.wait_http(f"{url}/readiness", timeout=60)
        admin.create(IM, namespace, inference_model("served", namespace, replicas=1))
        admin.create(IM, namespace, inference_model("sleepy", namespace, replicas=0))
        wait_for(
            lambda: (admin.get(IM, namespace, "served") or {}).get("status", {}).get("readyReplicas") == 1,
            30,
            message="served ready",
        )
        wait_for(lambda: _models(url) == {"served": True, "sleepy": False}, 20, message="router sees both")

        # Scale from zero through the router's own token: the router patches /scale, the operator follows.
        # The pod is held back until the router gives up (503), so that the router never connects to the
        # model's in-cluster Service name (no DNS here; traffic stays on loopback).
        kubelet.paused.set()
        response = httpx.post(f"{url}/v1/completions", json={"model": "sleepy", "prompt": "hi"}, timeout=40)
        assert response.status_code == 503 and response.headers.get("retry-after"), response.text
        assert admin.get(IM, namespace, "sleepy")["spec"]["replicas"] == 1, response.text
        wait_for(
            lambda: admin.get(kube.DEPLOYMENT, namespace, "sleepy")["spec"]["replicas"] == 1,
            20,
            message="operator followed",
        )
        kubelet.paused.clear()
        wait_for(
            lambda: (admin.get(IM, namespace, "sleepy") or {}).get("status", {}).get("readyReplicas") == 1,
            30,
            message="woken",
        )
        wait_for(lambda: _models(url).get("sleepy") is True, 20, message="router sees it ready")
        assert condition(admin.get(IM, namespace, "served"), "Degraded")["status"] == "False"
        # kopf's own calls (CRD and namespace watches, finalizers, events) went through too.
        assert any(
            e.get("reason") == "Created"
            for e in admin.list(kube.Resource("v1", "events", "Event"), namespace)
        )
        admin.delete(IM, namespace, "served")
        wait_for(
            lambda: admin.get(IM, namespace, "served") is None,
            20,
            message="finalizer removed by the operator",
        )
    finally:
        router.stop()
        operator.stop()
        kubelet.stop()
    for name, log in (("operator", operator.log()), ("router", router.log())):
        assert not _refusals(log), f"{name} was refused:\n" + "\n".join(_refusals(log))


def _wait_until_authorized(api: kube.Kube, account: str, rbac: list[dict], namespace: str) -> None:
    """Wait until the authorizer grants `account` every rule its bindings give it. The RBAC authorizer reads
    roles and bindings from an informer cache, so for a moment after they are applied a granted call is
    still refused; a process started in that moment logs a 403 that the chart is not to blame for."""
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in rbac if "rules" in o
    }
    checks = []
    for binding in rbac:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s.get("name") == account for s in binding.get("subjects", [])):
            continue
        ns = binding["metadata"].get("namespace") or namespace
        ref = binding["roleRef"]
        role = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            for group in rule.get("apiGroups", [""]):
                for resource in rule.get("resources", []):
                    kind, _, sub = resource.partition("/")
                    for verb in rule["verbs"]:
                        checks.append(
                            {
                                "namespace": ns,
                                "group": group,
                                "resource": kind,
                                "subresource": sub,
                                "verb": verb,
                            }
                        )
    assert checks, f"no rules bound to {account}"

    def granted() -> bool:
        for attributes in checks:
            review = api.request(
                "POST",
                "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                {"spec": {"resourceAttributes": attributes}},
            )
            if not review["status"].get("allowed"):
                return False
        return True

    wait_for(granted, 30, message=f"{account}'s rules in the authorizer's cache")


def _refusals(log: str) -> list[str]:
    """The log lines that carry an RBAC refusal, with the line before each (kopf logs the call, then the
    error). A 403 for writing into a namespace being deleted (reason NamespaceTerminating) is the namespace
    lifecycle admission, not RBAC: the operator watches every namespace and another test's namespace may be
    going away while it posts an event there. Neither is kopf's report of that refusal as an event it could
    not post because the namespace is gone by then (404 namespaces "..." not found)."""
    lines = log.splitlines()
    hits = [
        i
        for i, line in enumerate(lines)
        if (" 403" in line or "orbidden" in line)
        and "NamespaceTerminating" not in line
        and not ("Failed to post an event" in line and "Code: 404" in line and "not found" in line)
    ]
    return [lines[j] for i in hits for j in (i - 1, i) if j >= 0][:40]


def _client(kubeconfig):
    import kubernetes

    return kubernetes.config.new_client_from_config(config_file=str(kubeconfig))


def _models(url: str) -> dict[str, bool]:
    try:
        data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError):
        return {}
    return {m["id"]: m.get("ready") for m in data}


def test_namespaced_operator_and_router_are_confined_to_their_namespaces(k8s, tmp_path):
    """`watchNamespaces: [team-a, team-b]` (ci/namespaced-values.yaml): Roles in those two namespaces and a
    read-only ClusterRole for kopf; the operator and the router work there and are refused anywhere else."""
    import sys

    sys.path.insert(0, str(REPO / "tests" / "helm"))
    from chartkit import load_values

    admin = k8s.kube()
    values = load_values("namespaced-values.yaml")
    rendered = render_chart(values, "team-a")
    watched = values["watchNamespaces"]
    for ns in {"team-a", *watched, "elsewhere"}:
        ensure_namespace(admin, ns)
    api_client = k8s.api_client()
    for obj in helm_order(rendered.objects):
        if obj["kind"] in RBAC_KINDS:
            server_side_apply(api_client, obj)
    accounts = {o["metadata"]["name"] for o in rendered.of_kind("ServiceAccount")}
    assert accounts == {"vsurge-operator", "vsurge-router"}
    configs = {
        name: k8s.token_kubeconfig(
            tmp_path / f"{name}.kubeconfig", service_account_token(admin, "team-a", name), "team-a"
        )
        for name in accounts
    }
    config = configs["vsurge-operator"]
    as_operator = kube.Kube(_client(config))
    rbac = [o for o in rendered.objects if o["kind"] in RBAC_KINDS]
    _wait_until_authorized(as_operator, "vsurge-operator", rbac, "team-a")
    assert _forbidden(as_operator, "GET", "/apis/vsurge.io/v1alpha1/namespaces/elsewhere/inferencemodels")
    assert _forbidden(as_operator, "GET", "/apis/vsurge.io/v1alpha1/inferencemodels")  # no cluster-wide list
    assert _forbidden(as_operator, "GET", "/apis/apps/v1/namespaces/elsewhere/deployments")
    as_router = kube.Kube(_client(configs["vsurge-router"]))
    _wait_until_authorized(as_router, "vsurge-router", rbac, "team-a")
    assert _forbidden(as_router, "GET", "/apis/vsurge.io/v1alpha1/inferencemodels")
    assert _forbidden(as_router, "GET", "/apis/vsurge.io/v1alpha1/namespaces/elsewhere/inferencemodels")

    ensure_node(admin, "rbac-test-node")  # bound pods: the EndpointSlice controller lists them for the router
    kubelet = Kubelet(admin, "team-b", node="rbac-test-node").start()
    operator = start_operator(config, tmp_path / "operator.log", *(f"--namespace={ns}" for ns in watched))
    port = free_port()
    router = LoggedProcess(  # as the chart runs it: one watch per listed namespace
        [*vsurge_command(), "route", "--host=127.0.0.1", f"--port={port}"]
        + [f"--namespace={ns}" for ns in watched],
        tmp_path / "router.log",
        clean_env(KUBECONFIG=str(configs["vsurge-router"])),
    ).start()
    try:
        router.wait_http(f"http://127.0.0.1:{port}/readiness", timeout=60)
        admin.create(IM, "team-b", inference_model("confined", "team-b", replicas=1))
        wait_for(
            lambda: (admin.get(IM, "team-b", "confined") or {}).get("status", {}).get("readyReplicas") == 1,
            30,
            message="ready",
        )
        admin.create(IM, "elsewhere", inference_model("ignored", "elsewhere", replicas=1))
        import time

        time.sleep(3)  # an operator that watched "elsewhere" would have made its Deployment by now
        assert admin.get(kube.DEPLOYMENT, "elsewhere", "ignored") is None
        models = _models(f"http://127.0.0.1:{port}")
        assert models.get("confined") is True and "ignored" not in models, models
        admin.delete(IM, "team-b", "confined")
        wait_for(lambda: admin.get(IM, "team-b", "confined") is None, 20, message="finalizer removed")
    finally:
        router.stop()
        operator.stop()
        kubelet.stop()
    for name, log in (("operator", operator.log()), ("router", router.log())):
        assert not _refusals(log), f"{name} was refused:\n" + "\n".join(_refusals(log))
