"""Parse a model source: ``hf://org/name[@revision][/path]``, ``gs://bucket/prefix``, ``s3://bucket/prefix``,
``pvc://claim/path`` or a local path."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import ModelSourceError

REMOTE_SCHEMES = ("hf", "gs", "s3")
PVC_MOUNT_ENV = "VSURGE_PVC_MOUNT"
PVC_MOUNT_DEFAULT = "/mnt/models"  # where the operator mounts the claim (manifests.MODEL_MOUNT)

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]$")
_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


@dataclass(frozen=True)
class SourceURI:
    raw: str
    scheme: str  # "hf", "gs", "s3"
    bucket: str  # bucket, or "org/name" for hf
    prefix: str  # object prefix / path inside the repo, no leading or trailing "/"
    revision: str | None = None  # hf only

    @property
    def display(self) -> str:
        return self.raw


def is_remote(source: str) -> bool:
    return any(source.startswith(f"{s}://") for s in REMOTE_SCHEMES)


def pvc_path(source: str) -> str:
    """``pvc://claim/sub/dir`` -> the claim's mount point (``$VSURGE_PVC_MOUNT``, default /mnt/models) / sub/dir."""
    rest = source[len("pvc://") :]
    claim, _, path = rest.partition("/")
    if not claim:
        raise ModelSourceError(source, "expected pvc://CLAIM[/PATH]", "invalid")
    mount = os.environ.get(PVC_MOUNT_ENV, PVC_MOUNT_DEFAULT)
    return os.path.join(mount, path.strip("/")) if path.strip("/") else mount


def parse(source: str) -> SourceURI:
    scheme, sep, rest = source.partition("://")
    if not sep or scheme not in REMOTE_SCHEMES:
        raise ModelSourceError(source, f"not a remote source (expected one of {', '.join(REMOTE_SCHEMES)})")
    rest = rest.rstrip("/")
    if scheme == "hf":
        parts = rest.split("/")
        if len(parts) < 2 or not parts[0] or not parts[1]:
            raise ModelSourceError(source, "expected hf://ORG/NAME[@REVISION][/PATH]", "invalid")
        name, _, revision = parts[1].partition("@")
        if not _HF_PART.match(parts[0]) or not _HF_PART.match(name):
            raise ModelSourceError(source, f"invalid repository id {parts[0]}/{name}", "invalid")
        if "@" in parts[1] and not revision:
            raise ModelSourceError(source, "empty revision after '@'", "invalid")
        return SourceURI(source, "hf", f"{parts[0]}/{name}", "/".join(parts[2:]).strip("/"), revision or None)
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ModelSourceError(source, f"expected {scheme}://BUCKET[/PREFIX]", "invalid")
    if not _BUCKET.match(bucket):
        raise ModelSourceError(source, f"invalid bucket name {bucket!r}", "invalid")
    return SourceURI(source, scheme, bucket, prefix.strip("/"))
