"""Model pods under Pod Security admission "restricted", on a real API server.

The kit's kube-apiserver is 1.20: the PodSecurity admission plugin (1.22+) is not in it, and neither is
ValidatingAdmissionPolicy (1.26+). What 1.20 has is the upstream **PodSecurityPolicy** admission plugin, and
the restricted PodSecurityPolicy expresses every rule of the "restricted" standard: no privileged
containers, no privilege escalation, ALL capabilities dropped (NET_BIND_SERVICE the only one that may be
added), non-root users, the runtime/default seccomp profile, only the allowed volume types, no host
namespaces or ports (and, stricter than the standard, a read-only root filesystem). This module starts its
own kit cluster with that plugin on, gives the model namespace's service accounts that one policy, and
creates every kind of pod the operator renders through the real admission chain: the controller-manager
makes the Deployments' pods (CPU, TPU single host, GPU, with claims and secrets), and the test creates the
LeaderWorkerSet's leader and worker pods from its templates, as the LWS controller would.

PodSecurityPolicy *defaults* a field it requires when the pod leaves it out (where PodSecurity admission
would refuse the pod), so each admitted pod is also compared with the template: admission must have changed
nothing in the security contexts. Controls show both failure modes: a privileged pod and a pod without a
seccomp profile are refused, and the pod the operator rendered before (no container securityContext) is
refused.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clusterkit import IM, KIT, REPLICA_SET, events, inference_model, start_operator, wait_for
from kubernetes.client.exceptions import ApiException

from vsurge_operator import kube

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
POLICY = "vsurge-test-restricted"
# The restricted PodSecurityPolicy (the policy the "restricted" standard was written from), strict and
# non-defaulting where it can be: no default seccomp profile, so a pod without one is refused.
RESTRICTED_PSP = {
    "apiVersion": "policy/v1beta1",
    "kind": "PodSecurityPolicy",
    "metadata": {
        "name": POLICY,
        "annotations": {"seccomp.security.alpha.kubernetes.io/allowedProfileNames": "runtime/default"},
    },
    "spec": {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "requiredDropCapabilities": ["ALL"],
        "allowedCapabilities": ["NET_BIND_SERVICE"],
        "volumes": [
            "configMap",
            "csi",
            "downwardAPI",
            "emptyDir",
            "ephemeral",
            "persistentVolumeClaim",
            "projected",
            "secret",
        ],
        "hostNetwork": False,
        "hostIPC": False,
        "hostPID": False,
        "runAsUser": {"rule": "MustRunAsNonRoot"},
        "seLinux": {"rule": "RunAsAny"},
        "supplementalGroups": {"rule": "RunAsAny"},
        "fsGroup": {"rule": "RunAsAny"},
        "readOnlyRootFilesystem": True,
    },
}
ROLE = kube.Resource("rbac.authorization.k8s.io/v1", "roles", "Role")
ROLE_BINDING = kube.Resource("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding")
SECRET = kube.Resource("v1", "secrets", "Secret")

TPU_1 = {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"}
TPU_4 = {"accelerator": "tpu-v6e-slice", "topology": "4x4"}
MODELS = {
    "cpu": {"replicas": 1, "podTemplate": {"metadata": {"labels": {"team": "a"}}}},
    # the shared claim (the default, a claim per pod, is a generic ephemeral volume: GA in 1.23, not in 1.20)
    "tpu-one-host": {"tpu": TPU_1, "compileCache": {"size": "5Gi", "accessMode": "ReadWriteMany"}},
    "gpu": {
        "gpu": {"count": 1, "type": "nvidia-l4"},
        "model": {"source": "pvc://weights/llama", "credentialsSecret": "creds"},
        "cache": {"claimName": "model-cache"},
        "compileCache": {"claimName": "jax-cache"},
        "scheduling": {"priorityClassName": "system-cluster-critical"},
        "imagePullSecrets": [{"name": "regcred"}],
    },
    "tpu-multi-host": {"tpu": TPU_4},
}


@pytest.fixture(scope="module")
def psp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A kit cluster of its own with the PodSecurityPolicy admission plugin on; yields its kubeconfig."""
    run_dir = tmp_path_factory.mktemp("k8s-psp")
    bin_dir = os.environ.get("K8SKIT_BIN_DIR") or os.path.join(tempfile.gettempdir(), "k8skit-bin")
    cmd = [str(KIT / "up"), str(run_dir), "--owner-pid", str(os.getpid()), "--quiet"]
    for crd in (
        REPO / "helm/vsurge/crds/inferencemodels.vsurge.io.yaml",
        KIT / "crds/leaderworkersets.leaderworkerset.x-k8s.io.yaml",
    ):
        cmd += ["--crd", str(crd)]
    env = {
        **os.environ,
        "K8SKIT_BIN_DIR": bin_dir,
        "K8SKIT_APISERVER_ARGS": "--enable-admission-plugins=PodSecurityPolicy,OwnerReferencesPermissionEnforcement",
    }
    try:
        p = subprocess.run(cmd, timeout=300, env=env, capture_output=True, text=True)
        assert p.returncode == 0, f"k8skit up failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        yield run_dir / "kubeconfig"
    finally:
        subprocess.run([str(KIT / "down"), str(run_dir)], check=False, timeout=120, capture_output=True)


@pytest.fixture(scope="module")
def api(psp_cluster: Path) -> kube.Kube:
    import kubernetes

    return kube.Kube(kubernetes.config.new_client_from_config(config_file=str(psp_cluster)), timeout=20)


@pytest.fixture(scope="module")
def namespace(api: kube.Kube) -> str:
    """A model namespace whose service accounts may use the restricted policy, and only that one."""
    ns = "models-restricted"
    api.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    )
    api.request("POST", "/apis/policy/v1beta1/podsecuritypolicies", RESTRICTED_PSP)  # cluster-scoped
    api.create(
        ROLE,
        ns,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "use-restricted", "namespace": ns},
            "rules": [
                {
                    "apiGroups": ["policy"],
                    "resources": ["podsecuritypolicies"],
                    "resourceNames": [POLICY],
                    "verbs": ["use"],
                }
            ],
        },
    )
    api.create(
        ROLE_BINDING,
        ns,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "use-restricted", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "use-restricted"},
            "subjects": [
                {
                    "kind": "Group",
                    "apiGroup": "rbac.authorization.k8s.io",
                    "name": f"system:serviceaccounts:{ns}",
                }
            ],
        },
    )
    api.create(
        SECRET,
        ns,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds"},
            "stringData": {"HF_TOKEN": "x"},
        },
    )
    return ns


def _lws_pods(lws: dict[str, Any]) -> list[dict[str, Any]]:
    """The leader and worker pods of group 0, made from the templates as the LWS controller makes them."""
    name = lws["metadata"]["name"]
    lwt = lws["spec"]["leaderWorkerTemplate"]
    out = []
    for index in range(lwt["size"]):
        template = copy.deepcopy(lwt["leaderTemplate"] if index == 0 else lwt["workerTemplate"])
        labels = {
            **template["metadata"]["labels"],
            "leaderworkerset.sigs.k8s.io/name": name,
            "leaderworkerset.sigs.k8s.io/group-index": "0",
            "leaderworkerset.sigs.k8s.io/worker-index": str(index),
        }
        pod_name = f"{name}-0" if index == 0 else f"{name}-0-{index}"
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {**template["metadata"], "name": pod_name, "labels": labels},
                "spec": template["spec"],
            }
        )
    return out


def _security(spec: dict[str, Any]) -> tuple[Any, list[Any]]:
    return spec.get("securityContext"), [c.get("securityContext") for c in spec["containers"]]


def _assert_admitted_unchanged(pod: dict[str, Any], template_spec: dict[str, Any]) -> None:
    name = pod["metadata"]["name"]
    assert pod["metadata"]["annotations"].get("kubernetes.io/psp") == POLICY, name
    # Admission defaulted nothing: the pod is compliant as the operator wrote it.
    assert _security(pod["spec"]) == _security(template_spec), name
    assert [c.get("volumeMounts") for c in pod["spec"]["containers"]][0][
        : len(template_spec["containers"][0]["volumeMounts"])
    ] == template_spec["containers"][0]["volumeMounts"]


def test_every_rendered_pod_is_admitted_as_restricted(psp_cluster, api, namespace, tmp_path):
    operator = start_operator(psp_cluster, tmp_path / "operator.log", f"--namespace={namespace}")
    try:
        for name, spec in MODELS.items():
            api.create(IM, namespace, inference_model(name, namespace, **spec))
        checked = 0
        for name, spec in MODELS.items():
            if "tpu" in spec and spec["tpu"] is TPU_4:
                lws = wait_for(lambda n=name: api.get(kube.LEADER_WORKER_SET, namespace, n), 60, message=name)
                pods = _lws_pods(lws)
                lwt = lws["spec"]["leaderWorkerTemplate"]
                for i, pod in enumerate(pods):
                    created = api.create(kube.POD, namespace, pod)
                    template = lwt["leaderTemplate"] if i == 0 else lwt["workerTemplate"]
                    _assert_admitted_unchanged(created, template["spec"])
                    checked += 1
                assert len(pods) == 4
                continue
            dep = wait_for(
                lambda n=name: api.get(kube.DEPLOYMENT, namespace, n), 60, message=f"{name} Deployment"
            )

            def made(n: str = name) -> list[dict[str, Any]]:
                return api.list(kube.POD, namespace, f"vsurge.io/model={n}")

            try:
                (pod,) = wait_for(made, 60, message=f"the controller-manager's pod of {name}")
            except AssertionError:
                rs = api.list(REPLICA_SET, namespace, f"vsurge.io/model={name}")
                refused = [e["message"] for e in events(api, namespace, "FailedCreate")]
                raise AssertionError(f"no pod for {name}: {refused or rs}") from None
            _assert_admitted_unchanged(pod, dep["spec"]["template"]["spec"])
            checked += 1
        assert checked == 7  # cpu, tpu one host, gpu, and the 4 pods of one multi-host group
        # The compile cache claim the operator created is there, owned by its model.
        pvc = api.get(kube.PVC, namespace, "tpu-one-host-compile-cache")
        assert pvc["metadata"]["ownerReferences"][0]["name"] == "tpu-one-host"
    finally:
        operator.stop()


def _pod(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_admission_refuses_what_restricted_forbids(api, namespace):
    good_container = {
        "name": "c",
        "image": "x",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    good_pod = {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}}
    # Control: a minimal compliant pod is admitted unchanged.
    ok = api.create(
        kube.POD, namespace, _pod("ok", {"securityContext": good_pod, "containers": [good_container]})
    )
    assert ok["metadata"]["annotations"]["kubernetes.io/psp"] == POLICY

    privileged = copy.deepcopy(good_container)
    privileged["securityContext"]["privileged"] = True
    root = {**good_pod, "runAsNonRoot": False, "runAsUser": 0}
    host_path = {"name": "h", "hostPath": {"path": "/"}}
    # The pod the operator rendered before: no container securityContext, fsGroup only.
    before = {
        "securityContext": {"fsGroup": 10001},
        "containers": [{"name": "server", "image": "x"}],
    }
    refused = {
        "privileged": _pod("privileged", {"securityContext": good_pod, "containers": [privileged]}),
        "root": _pod("root", {"securityContext": root, "containers": [good_container]}),
        "no-seccomp": _pod(
            "no-seccomp",
            {"securityContext": {"runAsNonRoot": True, "runAsUser": 1}, "containers": [good_container]},
        ),
        "host-path": _pod(
            "host-path", {"securityContext": good_pod, "containers": [good_container], "volumes": [host_path]}
        ),
        "operator-before": _pod("operator-before", before),
    }
    reasons = {
        "privileged": "Privileged containers are not allowed",
        "root": "runAsNonRoot: Invalid value: false: must be true",
        "no-seccomp": "seccomp",
        "host-path": "hostPath volumes are not allowed",
        "operator-before": "seccomp",
    }
    for what, pod in refused.items():
        with pytest.raises(ApiException) as e:
            api.create(kube.POD, namespace, pod)
        message = json.loads(e.value.body)["message"]
        assert e.value.status == 403 and "PodSecurityPolicy: unable to admit pod" in message, (what, message)
        assert reasons[what] in message, (what, message)
