"""A pod whose `vsurge serve` cannot load its model makes the InferenceModel Degraded/ModelSourceError.

The termination message is the real one: `vsurge serve` runs with the container's environment as the
operator built it, fails on its model source, exits non-zero and writes its termination log; the test then
plays the kubelet, publishing that message in the pod's containerStatuses through KMock.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kmock_harness import wait_for
from operator_harness import condition

from vsurge_operator import kube, manifests

IM = "vsurge.io/v1alpha1/inferencemodels"


def _serve_with_pod_env(container: dict, tmp_path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VSURGE_")}
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    env.update(
        {"VSURGE_PORT": "0", "VSURGE_METRICS_PORT": "-1", "VSURGE_TERMINATION_LOG": str(tmp_path / "tlog")}
    )
    env["VSURGE_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run(
        [sys.executable, "-m", "vsurge.cli", "serve"], env=env, capture_output=True, text=True, timeout=120
    )
    return proc.returncode, (tmp_path / "tlog").read_text()


def _pod(name: str, labels: dict, message: str, ready: bool) -> dict:
    status = {
        "name": manifests.CONTAINER_NAME,
        "ready": ready,
        "restartCount": 3,
        "image": "x",
        "imageID": "",
    }
    if ready:
        status["state"] = {"running": {"startedAt": "2026-12-01T00:00:00Z"}}
    else:
        status["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
    status["lastState"] = {"terminated": {"exitCode": 1, "reason": "Error", "message": message}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": manifests.CONTAINER_NAME, "image": "x"}]},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": str(ready)}],
            "containerStatuses": [status],
        },
    }


def test_source_error_in_termination_message_degrades_the_model(
    cluster, namespace, api, create_model, start_operator, tmp_path
):
    start_operator()
    create_model("llama", model={"source": "pvc://weights/llama-3-8b"})
    dep = wait_for(lambda: cluster.obj("apps/v1/deployments", namespace, "llama"), 30, message="deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"

    code, message = _serve_with_pod_env(container, tmp_path)
    assert code == 1
    assert message.startswith("ModelSourceError: /mnt/models/llama-3-8b: no such file or directory"), message

    labels = dict(dep["spec"]["template"]["metadata"]["labels"])
    api.create(kube.POD, namespace, _pod("llama-abc12", labels, message, ready=False))
    api.create(
        kube.POD, namespace, _pod("other-model-pod", {"app": "other"}, "ModelSourceError: not ours", False)
    )

    def degraded():
        obj = cluster.obj(IM, namespace, "llama")
        c = condition(obj, "Degraded")
        return c if c.get("status") == "True" and c.get("reason") == "ModelSourceError" else None

    c = wait_for(degraded, 30, message="Degraded/ModelSourceError")
    assert c["message"] == "pod llama-abc12: /mnt/models/llama-3-8b: no such file or directory"
    events = wait_for(
        lambda: (
            [e for e in cluster.objects("events", namespace) if e.get("reason") == "ModelSourceError"] or None
        ),
        30,
        message="a ModelSourceError event",
    )
    assert "no such file or directory" in events[0]["message"] and events[0]["type"] == "Warning"

    # The pod recovers (the volume was fixed): Degraded clears on the next resync.
    api.patch(
        kube.POD,
        namespace,
        "llama-abc12",
        {"status": _pod("llama-abc12", labels, message, True)["status"]},
        subresource="status",
    )
    wait_for(
        lambda: condition(cluster.obj(IM, namespace, "llama"), "Degraded").get("status") == "False" or None,
        30,
        message="Degraded cleared",
    )


# ------------------------------------------------------------------ credentials, service account, cache


def _spec(**spec):
    from operator_harness import inference_model

    from vsurge_operator import spec as specmod

    body = inference_model("llama", "models", **spec)
    body["metadata"]["uid"] = "u1"
    return body, specmod.parse(body)


def test_credentials_secret_becomes_env_and_a_mounted_directory():
    from vsurge_operator import validation

    body, model = _spec(
        model={"source": "s3://private/llama", "credentialsSecret": "llama-s3"},
        serviceAccountName="llama-reader",
    )
    assert validation.validate(body) == []
    pod = manifests.pod_template(model)["spec"]
    c = pod["containers"][0]
    assert c["envFrom"] == [{"secretRef": {"name": "llama-s3"}}]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert (
        env["VSURGE_CREDENTIALS_DIR"] == manifests.CREDENTIALS_DIR
        and env["VSURGE_MODEL"] == "s3://private/llama"
    )
    assert {"name": "model-credentials", "mountPath": manifests.CREDENTIALS_DIR, "readOnly": True} in c[
        "volumeMounts"
    ]
    assert {"name": "model-credentials", "secret": {"secretName": "llama-s3", "defaultMode": 0o440}} in pod[
        "volumes"
    ]
    assert pod["serviceAccountName"] == "llama-reader"
    _, plain = _spec(model={"source": "gs://public/llama"})
    c = manifests.pod_template(plain)["spec"]["containers"][0]
    assert "envFrom" not in c and "VSURGE_CREDENTIALS_DIR" not in {e["name"] for e in c["env"]}


def test_cache_is_an_emptydir_with_a_size_limit_or_a_pvc():
    _, default = _spec()
    assert manifests.pod_template(default)["spec"]["volumes"][0] == {"name": "cache", "emptyDir": {}}
    _, sized = _spec(cache={"sizeLimit": "200Gi"})
    assert manifests.pod_template(sized)["spec"]["volumes"][0] == {
        "name": "cache",
        "emptyDir": {"sizeLimit": "200Gi"},
    }
    _, claimed = _spec(cache={"claimName": "model-cache"})
    assert manifests.pod_template(claimed)["spec"]["volumes"][0] == {
        "name": "cache",
        "persistentVolumeClaim": {"claimName": "model-cache"},
    }
    assert (
        manifests.pod_template(claimed)["spec"]["securityContext"]["fsGroup"] == 10001
    )  # writable by the image's user
    # Every pod runs as the image's user (restricted profile), with or without a claim.
    assert manifests.pod_template(sized)["spec"]["securityContext"]["runAsUser"] == 10001
    mounts = manifests.pod_template(claimed)["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "cache", "mountPath": manifests.CACHE_DIR} in mounts


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"cache": {"sizeLimit": "lots"}}, "spec.cache.sizeLimit"),
        ({"cache": {"sizeLimit": "10Gi", "claimName": "c"}}, "spec.cache"),
        ({"cache": {"claimName": "Bad_Name"}}, "spec.cache.claimName"),
        ({"model": {"source": "s3://b/m", "credentialsSecret": "No Such"}}, "spec.model.credentialsSecret"),
    ],
)
def test_bad_cache_and_credentials_fields_are_rejected(spec, field):
    import jsonschema

    from vsurge_operator import crd, validation

    body, _ = _spec(**spec)
    assert field in [e.field for e in validation.validate(body)]
    if (
        field != "spec.cache"
    ):  # the both-set rule is CEL (x-kubernetes-validations), checked by the API server
        schema = crd.openapi_schema(crd.load_crd())
        errors = list(jsonschema.Draft7Validator(schema).iter_errors(body))
        assert errors, f"the CRD schema accepted {spec}"


def test_crd_patterns_match_the_operator():
    from vsurge_operator import crd, validation

    props = crd.openapi_schema(crd.load_crd())["properties"]["spec"]["properties"]
    assert props["model"]["properties"]["credentialsSecret"]["pattern"] == validation.DNS1123_SUBDOMAIN
    assert props["cache"]["properties"]["claimName"]["pattern"] == validation.DNS1123_SUBDOMAIN
    assert props["cache"]["properties"]["sizeLimit"]["pattern"] == validation.QUANTITY_PATTERN
    rules = [r["rule"] for r in props["cache"]["x-kubernetes-validations"]]
    assert rules == ["!(has(self.sizeLimit) && has(self.claimName))"]


def test_pods_with_credentials_and_cache_are_valid_kubernetes_objects():
    """The Deployment built with every new field passes Kubernetes' own OpenAPI schema (strict)."""
    from kubernetes_validate import utils as kv

    for cache in ({"sizeLimit": "100Gi"}, {"claimName": "model-cache"}):
        _, model = _spec(
            model={"source": "gs://b/llama", "credentialsSecret": "gcs-key"},
            serviceAccountName="reader",
            cache=cache,
        )
        kv.validate(manifests.deployment(model), kv.latest_version(), strict=True)
