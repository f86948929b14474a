"""Identity of the InferenceModel custom resource, and where its CRD lives.

The CRD YAML under ``helm/vsurge/crds/`` is the single source of truth for the schema; the operator
itself never installs it (the Helm chart does), so this module only names things and finds the file
for tests and tools.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

GROUP = "vsurge.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceModel"
PLURAL = "inferencemodels"
SINGULAR = "inferencemodel"
SHORT_NAMES = ("im",)
CRD_NAME = f"{PLURAL}.{GROUP}"

# Repository layout: operator/vsurge_operator/crd.py -> <repo>/helm/vsurge/crds/<name>.yaml
_REPO_CRD_PATH = Path(__file__).resolve().parents[2] / "helm" / "vsurge" / "crds" / f"{CRD_NAME}.yaml"


def crd_path() -> Path:
    """The CRD file in a source checkout (the Helm chart ships the same file)."""
    return _REPO_CRD_PATH


def load_crd(path: Path | None = None) -> dict[str, Any]:
    """Load the CRD manifest as a dict."""
    with open(path or crd_path(), encoding="utf-8") as f:
        return yaml.safe_load(f)


def openapi_schema(crd: dict[str, Any], version: str = VERSION) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of one served version of a CRD."""
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"version {version!r} not found in CRD {crd['metadata']['name']}")
