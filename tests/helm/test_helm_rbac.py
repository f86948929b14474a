"""RBAC of the chart: exactly the verbs the operator and the router use, and no more.

The tables below are the contract. They can be compared with the calls the operator really makes (for instance
the requests KMock records in the operator's end-to-end tests) through ``allowed``: every call must be allowed,
and every row of the table should be exercised by some call.

What is checked is the effective permission of each pod: Deployment -> its ServiceAccount -> every binding whose
subject is that ServiceAccount -> the rules of the bound role, in the binding's scope.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import helm_python
import pytest
from chartkit import Rendered, render

Rules = dict[tuple[str, str], frozenset[str]]  # (apiGroup, resource) -> verbs; "" is the core group


def _t(rows: list[tuple[str, str, str]]) -> Rules:
    return {(group, resource): frozenset(verbs.split()) for group, resource, verbs in rows}


# What the operator does in every namespace it watches.
OPERATOR_RECONCILE = _t(
    [
        ("vsurge.io", "inferencemodels", "get list watch patch"),  # watch; kopf finalizers and annotations
        ("vsurge.io", "inferencemodels/status", "patch"),  # status: replicas, conditions, occupancy
        ("vsurge.io", "inferencemodels/scale", "get patch"),  # the autoscaler's decision
        # blockOwnerDeletion on its owner references, under OwnerReferencesPermissionEnforcement
        # (tests/cluster runs the API server with it)
        ("vsurge.io", "inferencemodels/finalizers", "update"),
        ("apps", "deployments", "get list watch create patch delete"),  # single-host workloads
        ("leaderworkerset.x-k8s.io", "leaderworkersets", "get list watch create patch delete"),  # multi-host
        ("", "services", "get list watch create patch delete"),
        ("policy", "poddisruptionbudgets", "get list watch create patch delete"),
        ("", "persistentvolumeclaims", "get list watch create patch delete"),  # spec.compileCache.size
        # every model's NetworkPolicy, and a multi-host model's step-lane policy
        ("networking.k8s.io", "networkpolicies", "get list watch create patch delete"),
        # router.mode gateway: each model's InferencePool
        ("inference.networking.k8s.io", "inferencepools", "get list watch create patch delete"),
        ("", "pods", "get list watch"),  # ready pods of a model, to scrape their /metrics
        ("", "events", "create patch"),  # kopf's and the autoscaler's Events
    ]
)
# Secrets, never cluster-wide: in each namespace of secretNamespaces (watching all; default the release
# namespace) or each watched one. The operator creates a model's lane Secret and compile-cache key once and
# reads back only those it controls; the router reads a model's spec.apiKeySecret by name.
OPERATOR_SECRETS = _t([("", "secrets", "get create")])
ROUTER_SECRETS = _t([("", "secrets", "get")])
# kopf's own needs, cluster-scoped, in every mode (observing CRDs and namespaces appearing).
OPERATOR_FRAMEWORK = _t(
    [
        ("apiextensions.k8s.io", "customresourcedefinitions", "get list watch"),
        ("", "namespaces", "list watch"),
    ]
)
# kopf's peering: ClusterKopfPeerings when it watches all namespaces, KopfPeerings in each watched one otherwise.
OPERATOR_CLUSTER_PEERING = _t([("kopf.dev", "clusterkopfpeerings", "get list watch patch")])
OPERATOR_NAMESPACED_PEERING = _t([("kopf.dev", "kopfpeerings", "get list watch patch")])
# The router: find the models and their ready pods (EndpointSlices, nothing more), and wake a model at
# zero replicas.
ROUTER = _t(
    [
        ("vsurge.io", "inferencemodels", "list watch"),
        ("vsurge.io", "inferencemodels/scale", "get patch"),
        ("discovery.k8s.io", "endpointslices", "list watch"),
    ]
)
# Added to the built-in admin/edit and view roles for the people who apply models.
USERS_EDIT = _t(
    [
        ("vsurge.io", "inferencemodels", "get list watch create update patch delete deletecollection"),
        ("vsurge.io", "inferencemodels/scale", "get update patch"),
        ("vsurge.io", "inferencemodels/status", "get"),
    ]
)
USERS_VIEW = _t(
    [
        ("vsurge.io", "inferencemodels", "get list watch"),
        ("vsurge.io", "inferencemodels/status", "get list watch"),
        ("vsurge.io", "inferencemodels/scale", "get list watch"),
    ]
)

CLUSTER = "*"  # the scope of a ClusterRoleBinding


def merge(*tables: Rules) -> Rules:
    out: dict[tuple[str, str], frozenset[str]] = {}
    for table in tables:
        for key, verbs in table.items():
            out[key] = out.get(key, frozenset()) | verbs
    return out


def rules_of(role: dict[str, Any]) -> Rules:
    """Flatten a role's rules, refusing what a least-privilege role should never hold."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for rule in role["rules"]:
        name = role["metadata"]["name"]
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule, name
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert "*" not in (group, resource) and "*" not in rule["verbs"], f"wildcard in {name}"
                out[(group, resource)] |= set(rule["verbs"])
    return {key: frozenset(verbs) for key, verbs in out.items()}


def effective(r: Rendered, deployment: str) -> dict[str, Rules]:
    """scope (a namespace, or CLUSTER) -> what the pods of ``deployment`` may do there."""
    pod = r.get("Deployment", deployment)["spec"]["template"]["spec"]
    sa_name, sa_ns = pod["serviceAccountName"], r.namespace
    r.get("ServiceAccount", sa_name, sa_ns)  # it exists, beside the Deployment
    scopes: dict[str, list[Rules]] = defaultdict(list)
    for binding in r.of_kind("ClusterRoleBinding") + r.of_kind("RoleBinding"):
        subjects = binding.get("subjects", [])
        if not any(s == {"kind": "ServiceAccount", "name": sa_name, "namespace": sa_ns} for s in subjects):
            continue
        ref = binding["roleRef"]
        assert ref["apiGroup"] == "rbac.authorization.k8s.io"
        bound_ns = binding["metadata"].get("namespace")
        if ref["kind"] == "ClusterRole":
            role = r.get("ClusterRole", ref["name"])
        else:
            role = r.get("Role", ref["name"], bound_ns)
        scopes[CLUSTER if binding["kind"] == "ClusterRoleBinding" else bound_ns].append(rules_of(role))
    return {scope: merge(*tables) for scope, tables in scopes.items()}


def allowed(perms: dict[str, Rules], group: str, resource: str, verb: str, namespace: str | None) -> bool:
    """Would a call be allowed? ``namespace`` None means a cluster-scoped or all-namespaces call."""
    return any(
        verb in rules.get((group, resource), frozenset())
        for scope, rules in perms.items()
        if scope == CLUSTER or (namespace is not None and scope == namespace)
    )


def _diff(got: dict[str, Rules], want: dict[str, Rules]) -> str:
    lines = []
    for scope in sorted(set(got) | set(want)):
        g, w = got.get(scope, {}), want.get(scope, {})
        for key in sorted(set(g) | set(w)):
            extra, missing = (
                g.get(key, frozenset()) - w.get(key, frozenset()),
                w.get(key, frozenset()) - g.get(key, frozenset()),
            )
            if extra:
                lines.append(f"{scope} {key}: granted but not needed {sorted(extra)}")
            if missing:
                lines.append(f"{scope} {key}: needed but not granted {sorted(missing)}")
    return "\n".join(lines)


def expected_operator(watch: list[str], secret_namespaces: list[str] = ()) -> dict[str, Rules]:
    if not watch:
        return {CLUSTER: merge(OPERATOR_FRAMEWORK, OPERATOR_CLUSTER_PEERING, OPERATOR_RECONCILE)} | {
            ns: OPERATOR_SECRETS for ns in secret_namespaces
        }
    return {CLUSTER: OPERATOR_FRAMEWORK} | {
        ns: merge(OPERATOR_NAMESPACED_PEERING, OPERATOR_RECONCILE, OPERATOR_SECRETS) for ns in watch
    }


def expected_router(watch: list[str], secret_namespaces: list[str] = ()) -> dict[str, Rules]:
    if not watch:
        return {CLUSTER: ROUTER} | {ns: ROUTER_SECRETS for ns in secret_namespaces}
    return {ns: merge(ROUTER, ROUTER_SECRETS) for ns in watch}


def _secret_namespaces(r: Rendered) -> list[str]:
    return r.values.get("secretNamespaces") or [r.namespace]


def test_operator_rbac_is_the_table(rendered: Rendered) -> None:
    got = effective(rendered, "vsurge-operator")
    want = expected_operator(rendered.values.get("watchNamespaces", []), _secret_namespaces(rendered))
    assert got == want, _diff(got, want)


def test_router_rbac_is_the_table(rendered: Rendered) -> None:
    got = effective(rendered, "vsurge-router")
    want = expected_router(rendered.values.get("watchNamespaces", []), _secret_namespaces(rendered))
    assert got == want, _diff(got, want)


def _cluster_wide_secret_verbs(r: Rendered) -> list[str]:
    """Every way the rendered RBAC grants a verb on Secrets cluster-wide: a ClusterRole with a secrets
    rule (bound or not: a RoleBinding to it is the only safe use, and the chart needs none), and any
    ServiceAccount's effective cluster scope."""
    found = []
    for role in r.of_kind("ClusterRole"):
        verbs = rules_of(role).get(("", "secrets"))
        if verbs:
            found.append(f"ClusterRole {role['metadata']['name']}: {sorted(verbs)}")
    for deployment in r.of_kind("Deployment"):
        sa = deployment["spec"]["template"]["spec"].get("serviceAccountName")
        if deployment["metadata"]["namespace"] != r.namespace or not sa:
            continue
        if not any(s["metadata"]["name"] == sa for s in r.of_kind("ServiceAccount")):
            continue
        scope = effective(r, deployment["metadata"]["name"]).get(CLUSTER, {})
        if scope.get(("", "secrets")):
            found.append(f"{deployment['metadata']['name']} cluster-wide: {sorted(scope[('', 'secrets')])}")
    return found


def test_no_cluster_wide_secret_verb(rendered: Rendered) -> None:
    """Issue 53: the operator (and the router) touch Secrets only in namespaces named for it, through
    Roles; cluster-wide mode grants no secret verb at all."""
    assert _cluster_wide_secret_verbs(rendered) == []
    roles = [
        role
        for role in rendered.of_kind("Role")
        if rules_of(role).get(("", "secrets")) and role["metadata"]["name"].endswith("-secrets")
    ]
    expected = set(rendered.values.get("watchNamespaces") or _secret_namespaces(rendered))
    assert {role["metadata"]["namespace"] for role in roles} == expected


def test_the_secret_check_sees_a_cluster_wide_grant(renders: dict[str, Rendered]) -> None:
    """Control: a secrets rule put back into the operator's ClusterRole is reported."""
    r = renders["defaults"]
    role = r.get("ClusterRole", "vsurge-operator")
    role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    try:
        assert _cluster_wide_secret_verbs(r) == [
            "ClusterRole vsurge-operator: ['get']",
            "vsurge-operator cluster-wide: ['get']",
        ]
    finally:
        role["rules"].pop()


def test_user_roles_aggregate_into_the_builtin_roles(renders: dict[str, Rendered]) -> None:
    r = renders["defaults"]
    edit = r.get("ClusterRole", "vsurge-inferencemodels-edit")
    view = r.get("ClusterRole", "vsurge-inferencemodels-view")
    assert rules_of(edit) == USERS_EDIT and rules_of(view) == USERS_VIEW
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    bound = {b["roleRef"]["name"] for b in r.of_kind("ClusterRoleBinding") + r.of_kind("RoleBinding")}
    assert not bound & {"vsurge-inferencemodels-edit", "vsurge-inferencemodels-view"}


def test_namespaced_mode_keeps_the_operator_out_of_other_namespaces(renders: dict[str, Rendered]) -> None:
    perms = effective(renders["namespaced"], "vsurge-operator")
    assert allowed(perms, "apps", "deployments", "create", "team-b")
    assert not allowed(perms, "apps", "deployments", "create", "kube-system")
    assert not allowed(perms, "apps", "deployments", "list", None)  # no cluster-wide listing
    assert allowed(perms, "", "namespaces", "list", None)
    assert not allowed(perms, "kopf.dev", "clusterkopfpeerings", "get", None)
    router = effective(renders["namespaced"], "vsurge-router")
    assert allowed(router, "vsurge.io", "inferencemodels/scale", "patch", "team-a")
    assert not allowed(router, "vsurge.io", "inferencemodels/scale", "patch", "default")


def test_no_secrets_and_no_escalation(rendered: Rendered) -> None:
    for role in rendered.of_kind("ClusterRole") + rendered.of_kind("Role"):
        rules = rules_of(role)
        # the operator makes each multi-host model's lane Secret: create, and get (its digest); nothing
        # may list, watch, change or delete secrets
        assert rules.get(("", "secrets"), {"get", "create"}) <= {"get", "create"}, role["metadata"]["name"]
        for key, verbs in rules.items():
            assert not verbs & {"escalate", "bind", "impersonate"}, (role["metadata"]["name"], key)
            assert key[0] != "rbac.authorization.k8s.io", role["metadata"]["name"]


def test_rbac_off_renders_no_roles(chart: helm_python.Chart) -> None:
    r = render(chart, {"rbac": {"create": False}}, "vsurge-system")
    kinds = {o["kind"] for o in r.objects}
    assert not kinds & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    assert "Deployment" in kinds


def test_the_comparison_sees_an_extra_verb(renders: dict[str, Rendered]) -> None:
    """Control: one verb more in a rendered role is reported."""
    r = renders["defaults"]
    role = r.get("ClusterRole", "vsurge-operator")
    role["rules"].append({"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]})
    try:
        got = effective(r, "vsurge-operator")
        want = expected_operator([], ["vsurge-system"])
        assert got != want
        assert "granted but not needed ['delete']" in _diff(got, want)
    finally:
        role["rules"].pop()


def test_rbac_table_matches_the_crd_subresources(crd: dict[str, Any]) -> None:
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    subresources = set(version.get("subresources", {}))
    used = {res.split("/")[1] for tables in (OPERATOR_RECONCILE, ROUTER) for (_, res) in tables if "/" in res}
    # "finalizers" is no served subresource: only the authorizer asks about it (blockOwnerDeletion).
    assert used - {"finalizers"} <= subresources


@pytest.mark.parametrize("verb", ["update", "deletecollection", "escalate"])
def test_operator_never_gets_verbs_it_does_not_use(renders: dict[str, Rendered], verb: str) -> None:
    """kopf and the operator patch; they never PUT (update) or delete collections."""
    perms = effective(renders["defaults"], "vsurge-operator")
    # update on inferencemodels/finalizers is what the authorizer asks for blockOwnerDeletion; no PUT is sent.
    granted = {
        key: verbs
        for key, verbs in perms[CLUSTER].items()
        if key != ("vsurge.io", "inferencemodels/finalizers")
    }
    assert not any(verb in verbs for verbs in granted.values())
