"""Helpers of the Helm chart tests: the chart rendered by Helm's own Go engine (helm-python-sdk).

Three scenarios are rendered once per session:
- ``defaults``: ``helm install vsurge helm/vsurge -n vsurge-system`` with no values;
- ``all-options``: ``ci/all-options-values.yaml``, every option of the chart on, watching all namespaces;
- ``namespaced``: ``ci/namespaced-values.yaml``, watching two listed namespaces (Roles instead of ClusterRoles).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "vsurge"
CRD_PATH = CHART_DIR / "crds" / "inferencemodels.vsurge.io.yaml"
CRD_MISSING = (
    f"{CRD_PATH.relative_to(REPO)} is not there yet (the operator's engineer writes it); "
    "the CRD-specific checks need it"
)
RELEASE = "vsurge"

SCENARIOS: dict[str, tuple[str | None, str]] = {
    # name: (values file under the chart's ci/, release namespace)
    "defaults": (None, "vsurge-system"),
    "all-options": ("all-options-values.yaml", "vsurge-system"),
    "namespaced": ("namespaced-values.yaml", "team-a"),
    "gateway": ("gateway-values.yaml", "vsurge-system"),
    "gateway-llmd": ("gateway-llmd-values.yaml", "vsurge-system"),
}


DEFAULT_VALUES: dict[str, Any] = yaml.safe_load((CHART_DIR / "values.yaml").read_text())


def load_values(filename: str | None) -> dict[str, Any]:
    if filename is None:
        return {}
    return yaml.safe_load((CHART_DIR / "ci" / filename).read_text())


@dataclass
class Rendered:
    """One rendering of the chart: its values, namespace, objects and NOTES.txt."""

    name: str
    values: dict[str, Any]
    namespace: str
    objects: list[dict[str, Any]]
    notes: str
    sources: dict[str, str] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        found = [
            o
            for o in self.of_kind(kind)
            if o["metadata"]["name"] == name
            and (namespace is None or o["metadata"].get("namespace") == namespace)
        ]
        assert len(found) == 1, f"expected one {kind} {name!r} (namespace {namespace}), found {len(found)}"
        return found[0]


def render(chart: helm_python.Chart, values: dict[str, Any] | None, namespace: str) -> Rendered:
    """Render like ``helm install RELEASE CHART -n NAMESPACE -f values`` and parse every manifest."""
    manifests = chart.render(values, name=RELEASE, namespace=namespace, is_install=True)
    objects: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            assert isinstance(doc, dict), f"{path} rendered a non-object YAML document: {doc!r}"
            doc.setdefault("metadata", {})
            objects.append(doc)
    return Rendered("custom", values or {}, namespace, objects, notes, manifests)
