"""The security settings of every model pod: the Pod Security Standard ``restricted`` profile.

Non-root with the service image's fixed uid/gid (docker/service.Dockerfile), no privilege escalation, no
capabilities, the runtime's default seccomp profile and a read-only root filesystem; the only writable
paths are the volumes the server writes to (the model cache and /tmp). Pure data: the builders in
``manifests`` put them on the pod and on each container.
"""

from __future__ import annotations

from typing import Any

IMAGE_UID = 10001  # the vsurge user of the service image
IMAGE_GID = 10001
TMP_DIR = "/tmp"  # Python's tempfile, libtpu's logs, XLA dumps: an emptyDir on a read-only root
TMP_SIZE_LIMIT = "1Gi"


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": IMAGE_UID,
        "runAsGroup": IMAGE_GID,
        # Claims (model cache, compile cache) become writable for the image's group.
        "fsGroup": IMAGE_GID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def tmp_volume() -> dict[str, Any]:
    return {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}}


def tmp_mount() -> dict[str, Any]:
    return {"name": "tmp", "mountPath": TMP_DIR}
