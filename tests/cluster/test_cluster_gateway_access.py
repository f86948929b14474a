"""What the operator renders around a model's pods (issue 53), on the real API server: the InferencePool
against the Gateway API Inference Extension's released CRD (its schema and CEL rules served by the kit's
apiextensions-apiserver), the model's NetworkPolicy, the compile cache's signing-key Secret and the
pods' API key from their Secrets, the per-group PodDisruptionBudgets of a multi-host model. One reconcile
pass (operator/vsurge_operator/reconcile.py) with the chart's settings, against the kit's admin client;
every object is read back and compared with what was sent: nothing refused, nothing pruned.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from clusterkit import KIT, REPO, dump, inference_model

from vsurge_operator import kube, reconcile
from vsurge_operator.config import OperatorConfig

POOL_CRD = REPO / "tests" / "fixtures" / "gateway-crds" / "inferencepools.inference.networking.k8s.io.yaml"
MULTI = {"accelerator": "tpu-v6e-slice", "topology": "4x4"}
CONFIG = OperatorConfig(
    inference_pool=True,
    endpoint_picker="vsurge-epp",
    network_policy=True,
    serving_from_namespaces=("vsurge-system", "gateway-system"),
    serving_from_cidrs=("10.129.0.0/23",),
    metrics_from_namespaces=("vsurge-system", "monitoring"),
    namespace="vsurge-system",
    compile_cache_access_mode="ReadWriteMany",  # 1.20 has no ephemeral volumes (the per-pod default)
    default_image="ghcr.io/vsurge-stack/vsurge-service:0.1.0",
)


@pytest.fixture(scope="module")
def pool_crd(k8s) -> None:
    p = subprocess.run(
        [str(KIT / "register-crd-group"), str(k8s.dir), "-f", str(POOL_CRD)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KUBECONFIG": str(k8s.kubeconfig)},
    )
    assert p.returncode == 0, p.stdout + p.stderr


def _missing(want, got, path=""):
    """Fields of ``want`` the server did not keep (pruned or changed)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [path]
        return [p for k, v in want.items() for p in _missing(v, got.get(k), f"{path}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(want) != len(got):
            return [path]
        return [
            p for i, (w, g) in enumerate(zip(want, got, strict=True)) for p in _missing(w, g, f"{path}[{i}]")
        ]
    return [] if want == got or str(want) == str(got) else [f"{path}: {want!r} -> {got!r}"]


def test_pool_policy_secrets_and_group_budgets_accepted(k8s, pool_crd, namespace) -> None:
    from vsurge_operator import manifests
    from vsurge_operator import spec as specmod

    api = k8s.kube()
    r = reconcile.Reconciler(api, CONFIG)
    shown = []
    for name, extra in (
        ("single", {"compileCache": {"size": "1Gi"}, "apiKeySecret": {"name": "single-key"}}),
        ("multi", {"tpu": MULTI, "replicas": 2}),
    ):
        api.create(kube.INFERENCE_MODEL, namespace, inference_model(name, namespace, **extra))
        body = api.get(kube.INFERENCE_MODEL, namespace, name)
        outcome = r.reconcile(body)
        assert not outcome.errors
        model = specmod.parse(body, default_image=CONFIG.model_images())
        reach, pool = r.surroundings()
        for want in manifests.desired_objects(model, reach=reach, pool=pool):
            if want["kind"] in ("Deployment", "LeaderWorkerSet", "Service", "PersistentVolumeClaim"):
                continue  # the other suites check these
            got = api.get(kube.resource_of(want), namespace, want["metadata"]["name"])
            assert got is not None, f"{want['kind']} {want['metadata']['name']} was not created"
            assert _missing(want["spec"], got["spec"]) == [], f"{want['kind']} {want['metadata']['name']}"
            if want["kind"] in ("InferencePool", "NetworkPolicy"):
                shown.append(
                    {k: got[k] for k in ("apiVersion", "kind")}
                    | {"metadata": {"name": got["metadata"]["name"]}, "spec": got["spec"]}
                )
        # the signing key's Secret, owned by the model, passed to the pods from the Secret
        if name == "single":
            secret = api.get(kube.SECRET, namespace, "single-cache-key")
            assert secret["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
            deployment = api.get(kube.DEPLOYMENT, namespace, "single")
            env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
            assert env["VSURGE_CACHE_HMAC_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "single-cache-key"
            assert env["VSURGE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
                "name": "single-key",
                "key": "api-key",
            }
    # a second pass writes nothing: the server's defaults (the pool's appProtocol, the picker's kind) are
    # not drift
    for name in ("single", "multi"):
        again = r.reconcile(api.get(kube.INFERENCE_MODEL, namespace, name))
        changed = {(a.kind, a.name): a.action for a in again.applied if a.action != "unchanged"}
        assert changed == {} and again.removed == [], changed
    # the leaders only, for the multi-host pool
    multi_pool = api.get(kube.INFERENCE_POOL, namespace, "multi")
    assert multi_pool["spec"]["selector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    budgets = {p["metadata"]["name"] for p in api.list(kube.PDB, namespace)}
    assert {"multi", "multi-group-0", "multi-group-1", "single"} <= budgets
    print("\n" + "".join("---\n" + yaml.safe_dump(o, sort_keys=False) for o in shown))
    # control: the released CRD refuses a pool without a port (its schema is enforced here)
    bad = {
        **multi_pool,
        "metadata": {"name": "bad", "namespace": namespace},
        "spec": {**multi_pool["spec"], "targetPorts": []},
    }
    with pytest.raises(Exception) as refused:
        api.create(kube.INFERENCE_POOL, namespace, bad)
    assert "422" in str(refused.value) or "Invalid" in str(refused.value), dump(str(refused.value))
