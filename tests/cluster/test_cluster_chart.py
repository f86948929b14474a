"""Every object the chart renders (Helm's own engine; the default, all-options and namespaced values of
tests/helm/chartkit.py) is accepted by the real server: server-side apply with dryRun=All, in the order
`helm install` creates them; and Helm's own install action (helm-python-sdk's Config.install, Helm 4)
installs and uninstalls the chart for real (test_helm_install_for_real).

The server must also keep what we wrote: kube-apiserver 1.20 silently drops fields it does not know, so
each answer is compared with the rendered object (a field missing from the answer fails the test).

InferencePool (Gateway API Inference Extension v1.6.0) and HTTPRoute (Gateway API v1.6.1, standard channel),
rendered with `router.mode: gateway`, are checked against those projects' released CRDs, vendored in
tests/fixtures/gateway-crds: their schemas and CEL rules run in the kit's apiextensions-apiserver, and
test_gateway_objects_are_stored_and_checked_by_the_released_crds creates them for real.

Other kinds no Kubernetes version serves come from other projects' CRDs: ServiceMonitor and PrometheusRule
(Prometheus Operator) and PodMonitoring / ClusterPodMonitoring (Google Cloud Managed Prometheus). Their real CRDs are not
available offline, so they are served here by permissive stand-in CRDs (scope as upstream, no schema):
the server then checks their names, namespaces and scope, not their spec (tests/helm checks those fields).
policy/v1 PodDisruptionBudget, which 1.20 lacks, is served by the kit's shim (typed spec).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import yaml
from clusterkit import KIT, REPO, ensure_namespace, helm_order, render_chart, server_side_apply

STAND_IN_CRDS = [  # (group, kind, plural, scope)
    ("monitoring.coreos.com", "ServiceMonitor", "servicemonitors", "Namespaced"),
    ("monitoring.googleapis.com", "PodMonitoring", "podmonitorings", "Namespaced"),
    ("monitoring.googleapis.com", "ClusterPodMonitoring", "clusterpodmonitorings", "Cluster"),
    ("monitoring.coreos.com", "PrometheusRule", "prometheusrules", "Namespaced"),
]


def _stand_in(group: str, kind: str, plural: str, scope: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "listKind": f"{kind}List", "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }


def _missing(want: Any, got: Any, path: str = "") -> list[str]:
    """Paths of fields in ``want`` that ``got`` lacks or changed (quantities and int-or-strings by text)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [path or "."]
        out = []
        for key, value in want.items():
            if key not in got:
                if value not in ({}, [], None):
                    out.append(f"{path}.{key}")
                continue
            out += _missing(value, got[key], f"{path}.{key}")
        return out
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [path]
        return [
            p for i, (w, g) in enumerate(zip(want, got, strict=True)) for p in _missing(w, g, f"{path}[{i}]")
        ]
    return [] if want == got or str(want) == str(got) else [f"{path}: {want!r} -> {got!r}"]


@pytest.fixture(scope="module")
def stand_ins(k8s, tmp_path_factory) -> None:
    folder = tmp_path_factory.mktemp("crds")
    paths = []
    for crd in STAND_IN_CRDS:  # one CRD per file: the kit reads one name per `kubectl apply` answer
        paths.append(folder / f"{crd[2]}.yaml")
        paths[-1].write_text(yaml.safe_dump(_stand_in(*crd)))
    # Applied and routed to the CRD server, and served, before it returns (the kit's own command).
    # The chart's own kopf peering CRDs too (what `helm install` puts in first from crds/), so that they are
    # served before the peering object is created (the kit routes a new CRD group a second after its apply).
    paths += [
        REPO / "helm" / "vsurge" / "crds" / f"{p}.kopf.dev.yaml"
        for p in ("clusterkopfpeerings", "kopfpeerings")
    ]
    # router.mode gateway: the released CRDs themselves (not stand-ins), with their schemas and CEL rules.
    paths += sorted((REPO / "tests" / "fixtures" / "gateway-crds").glob("*.yaml"))
    p = subprocess.run(
        [str(KIT / "register-crd-group"), str(k8s.dir), "-f", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KUBECONFIG": str(k8s.kubeconfig)},
    )
    assert p.returncode == 0, p.stdout + p.stderr


SCENARIOS = {
    "defaults": (None, "vsurge-system"),
    "all-options": ("all-options-values.yaml", "vsurge-system"),
    "namespaced": ("namespaced-values.yaml", "team-a"),
    "gateway": ("gateway-values.yaml", "vsurge-system"),
    "gateway-llmd": ("gateway-llmd-values.yaml", "vsurge-system"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_rendered_object_is_accepted_by_the_server(k8s, stand_ins, scenario):
    import sys

    sys.path.insert(0, str(REPO / "tests" / "helm"))
    from chartkit import load_values

    filename, release_ns = SCENARIOS[scenario]
    rendered = render_chart(load_values(filename), release_ns)
    api_client = k8s.api_client()
    admin = k8s.kube()
    namespaces = {release_ns} | {o["metadata"].get("namespace") for o in rendered.objects} - {None}
    for ns in sorted(namespaces):  # `helm install --create-namespace`, and the watched namespaces
        ensure_namespace(admin, ns)
    problems = []
    kinds = set()
    for obj in helm_order(rendered.objects):
        obj = {**obj, "metadata": {**obj["metadata"]}}
        if obj["metadata"].get("namespace") is None and obj["kind"] not in (
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterPodMonitoring",
            "ClusterKopfPeering",
        ):
            obj["metadata"]["namespace"] = release_ns  # as helm does for namespaced kinds
        try:
            answer = server_side_apply(api_client, obj, dry_run=True)
        except Exception as e:  # noqa: BLE001 - collect every refusal with the object's name
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {getattr(e, 'body', e)}")
            continue
        kinds.add(obj["kind"])
        lost = _missing({k: v for k, v in obj.items() if k != "status"}, answer)
        if lost:
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: the server dropped or changed {lost}")
    assert not problems, "\n".join(problems)
    assert kinds == {o["kind"] for o in rendered.objects}


def test_helm_install_for_real(k8s, stand_ins, tmp_path):
    """Helm's own install action (helm-python-sdk, Helm 4) against the cluster: the default values, then
    the all-options ones, each installed and uninstalled. The chart as shipped asks for Kubernetes >= 1.28
    and must be refused by a 1.20 server; a copy with that bound lowered is installed (release
    `vsurge-helm`, so no object clashes with the other tests' `vsurge-*` RBAC objects)."""
    import shutil

    import helm_python

    chart_dir = REPO / "helm" / "vsurge"
    sys.path.insert(0, str(REPO / "tests" / "helm"))
    from chartkit import load_values

    namespace = "helm-install"
    config = helm_python.Config(kubeconfig_path=str(k8s.kubeconfig), namespace=namespace)
    try:
        with pytest.raises(helm_python.HelmError) as refused:
            config.install(str(chart_dir), "vsurge-helm", {}, namespace=namespace, create_namespace=True)
        # "chart requires kubeVersion: >=1.28.0-0 which is incompatible with Kubernetes v1.20.2"
        assert "kubeVersion" in str(refused.value) and "v1.20" in str(refused.value), refused.value

        copy = tmp_path / "vsurge"
        shutil.copytree(chart_dir, copy)
        meta = yaml.safe_load((copy / "Chart.yaml").read_text())
        meta["kubeVersion"] = ">=1.20.0-0"
        (copy / "Chart.yaml").write_text(yaml.safe_dump(meta))
        admin = k8s.kube()
        for values_file in (None, "all-options-values.yaml"):
            release = config.install(
                str(copy), "vsurge-helm", load_values(values_file), namespace=namespace, create_namespace=True
            )
            assert config.status("vsurge-helm")["status"] == "deployed", release
            for kind, path in (
                ("Deployment", f"/apis/apps/v1/namespaces/{namespace}/deployments"),
                ("Service", f"/api/v1/namespaces/{namespace}/services"),
                ("PodDisruptionBudget", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets"),
            ):
                names = {o["metadata"]["name"] for o in admin.request("GET", path)["items"]}
                want = {"Deployment": {"vsurge-helm-operator", "vsurge-helm-router"}}.get(
                    kind, {"vsurge-helm-router"}
                )
                assert want <= names, (kind, names, values_file)
            config.uninstall("vsurge-helm", wait="watcher", timeout=60)
            left = admin.request("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments")["items"]
            assert not [o for o in left if not o["metadata"].get("deletionTimestamp")], left
    finally:
        config.close()


def test_gateway_objects_are_stored_and_checked_by_the_released_crds(k8s, stand_ins):
    """The gateway scenario's InferencePools and HTTPRoutes, created for real (not a dry run) and read
    back whole; a broken pool is refused by the extension's own CEL rules."""
    sys.path.insert(0, str(REPO / "tests" / "helm"))
    from chartkit import load_values

    from vsurge_operator import gateway, spec
    from vsurge_operator.config import OperatorConfig
    from vsurge_operator.reconcile import Reconciler

    rendered = render_chart(load_values("gateway-values.yaml"), "vsurge-system")
    api_client = k8s.api_client()
    admin = k8s.kube()
    created = []
    # the pools are the operator's (one per InferenceModel), with the settings the chart gives it
    (operator,) = [
        o
        for o in rendered.objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "vsurge-operator"
    ]
    env = {
        e["name"]: e.get("value")
        for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    _, defaults = Reconciler(None, OperatorConfig.from_env(env)).surroundings()
    pools = []
    for route in rendered.of_kind("HTTPRoute"):
        meta = {"name": route["metadata"]["name"], "namespace": route["metadata"]["namespace"], "uid": "u"}
        model = spec.parse({"metadata": meta, "spec": {"model": {"source": "default"}}}, default_image="img")
        pool = gateway.inference_pool(model, defaults)
        del pool["metadata"]["ownerReferences"]  # no InferenceModel of that uid here
        pools.append(pool)
    for obj in [*rendered.objects, *pools]:
        if obj["kind"] not in ("InferencePool", "HTTPRoute"):
            continue
        ensure_namespace(admin, obj["metadata"]["namespace"])
        answer = server_side_apply(api_client, obj)
        assert answer["metadata"]["uid"] and not _missing(obj["spec"], answer["spec"]), answer
        created.append((obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]))
    assert sorted(created) == [
        ("HTTPRoute", "team-b", "qwen"),
        ("HTTPRoute", "vsurge-system", "smollm2"),
        ("InferencePool", "team-b", "qwen"),
        ("InferencePool", "vsurge-system", "smollm2"),
    ]
    pool = admin.request(
        "GET", "/apis/inference.networking.k8s.io/v1/namespaces/vsurge-system/inferencepools/smollm2"
    )
    assert (
        pool["spec"]["endpointPickerRef"]["kind"] == "Service"
    )  # the CRD's default, filled in by the server
    broken = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "broken", "namespace": "vsurge-system"},
        "spec": {
            "selector": {"matchLabels": {"vsurge.io/model": "x"}},
            "targetPorts": [{"number": 11556}, {"number": 11556}],
            "endpointPickerRef": {"name": "x-epp"},
        },
    }
    with pytest.raises(Exception) as refused:
        server_side_apply(api_client, broken)
    body = str(getattr(refused.value, "body", refused.value))
    assert "port number must be unique" in body and "port is required" in body, body
