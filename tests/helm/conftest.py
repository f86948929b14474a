"""Fixtures of the Helm chart tests; the helpers and the scenarios are in chartkit.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
import yaml
from chartkit import CHART_DIR, CRD_MISSING, CRD_PATH, SCENARIOS, Rendered, load_values, render


@pytest.fixture(scope="session")
def chart() -> Iterator[helm_python.Chart]:
    loaded = helm_python.Chart.load(CHART_DIR)
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def renders(chart: helm_python.Chart) -> dict[str, Rendered]:
    out = {}
    for name, (filename, namespace) in SCENARIOS.items():
        values = load_values(filename)
        rendered = render(chart, values, namespace)
        rendered.name = name
        out[name] = rendered
    return out


@pytest.fixture(params=list(SCENARIOS))
def rendered(request: pytest.FixtureRequest, renders: dict[str, Rendered]) -> Rendered:
    return renders[request.param]


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    if not CRD_PATH.exists():
        pytest.skip(CRD_MISSING)
    docs = [d for d in yaml.safe_load_all(CRD_PATH.read_text()) if d]
    assert len(docs) == 1, f"{CRD_PATH} should hold exactly one object, found {len(docs)}"
    return docs[0]
