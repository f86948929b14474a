"""The chart's Grafana dashboard and PrometheusRule use only series that the code really exports.

Every PromQL expression (dashboard targets, alert rules) is parsed by a PromQL parser (promql-parser, a port
of Prometheus' own grammar) and each metric it selects is looked up in the exposition of the real metric
registries: the server's (a ServerMetrics over a real vSurge of a tiny model), the router's and the
operator's. A name not exported, or a label matcher on a label the series do not carry, fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from chartkit import CHART_DIR, Rendered

promql_parser = pytest.importorskip("promql_parser", reason="promql-parser (the test extra) is not installed")

REPO = Path(__file__).resolve().parents[2]
# Labels Prometheus adds when it scrapes (target labels); matchers and groupings on them are fine.
SCRAPE_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint", "le"}


def _families(text: str) -> dict[str, tuple[str, set[str]]]:
    """{exported series name: (family type, label names seen)} from an exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, tuple[str, set[str]]] = {}
    for fam in text_string_to_metric_families(text):
        suffixes = {
            "counter": ["_total", "_created"],
            "histogram": ["_bucket", "_sum", "_count", "_created"],
            "summary": ["_sum", "_count", "_created", ""],
        }.get(fam.type, [""])
        labels = {k for s in fam.samples for k in s.labels}
        for suffix in suffixes:
            out[fam.name + suffix] = (fam.type, labels)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, set[str]]]:
    from prometheus_client import generate_latest

    for extra in (REPO / "tests" / "service", REPO / "tests" / "server"):
        if str(extra) not in sys.path:
            sys.path.insert(0, str(extra))
    from server_helpers import make_surge
    from tiny_models import make_checkpoint

    from vsurge.router.metrics import RouterMetrics
    from vsurge.server.metrics import ServerMetrics
    from vsurge_operator import metrics as operator_metrics

    d = tmp_path_factory.mktemp("tiny")
    make_checkpoint(d, "llama", seed=0)
    surge = make_surge(str(d))
    server = ServerMetrics()
    server.add_model("tiny", surge)
    names: dict[str, tuple[str, set[str]]] = {}
    for registry in (server.registry, RouterMetrics().registry, operator_metrics.REGISTRY):
        found = _families(generate_latest(registry).decode())
        # A labelled metric with no child yet exposes no sample, hence no label names: read them from the
        # metric objects (prometheus_client keeps them in _labelnames; its registry lists its collectors).
        for collector, series in registry._collector_to_names.items():  # noqa: SLF001
            for name in series:
                if name in found and getattr(collector, "_labelnames", None):
                    found[name] = (found[name][0], found[name][1] | set(collector._labelnames))  # noqa: SLF001
        names.update(found)
    return names


def _selectors(expr: Any) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) of every vector selector in a parsed expression."""
    p = promql_parser
    if isinstance(expr, p.VectorSelector):
        return [(expr.name, {m.name for m in expr.matchers.matchers})]
    if isinstance(expr, p.MatrixSelector):
        return _selectors(expr.vector_selector)
    if isinstance(expr, p.BinaryExpr):
        return _selectors(expr.lhs) + _selectors(expr.rhs)
    if isinstance(expr, p.AggregateExpr):
        return _selectors(expr.expr) + (_selectors(expr.param) if expr.param is not None else [])
    if isinstance(expr, p.Call):
        return [s for a in expr.args for s in _selectors(a)]
    if isinstance(expr, p.ParenExpr | p.UnaryExpr | p.SubqueryExpr):
        return _selectors(expr.expr)
    if isinstance(expr, p.NumberLiteral | p.StringLiteral):
        return []
    raise AssertionError(f"unexpected PromQL node {type(expr).__name__}: {expr}")


def _check(expr_text: str, exported: dict[str, tuple[str, set[str]]], where: str) -> list[str]:
    # Grafana's variables are not PromQL: give them values Prometheus would see.
    text = expr_text.replace("$__rate_interval", "5m").replace("$model", ".*")
    parsed = promql_parser.parse(text)
    selectors = _selectors(parsed)
    assert selectors, f"{where}: selects no series: {expr_text}"
    problems = []
    for name, labels in selectors:
        if name not in exported:
            problems.append(f"{where}: {name} is not exported by the server, the router or the operator")
            continue
        kind, known = exported[name]
        unknown = labels - known - SCRAPE_LABELS - {"__name__"}
        if known and unknown:
            problems.append(f"{where}: {name} has no label(s) {sorted(unknown)} (it has {sorted(known)})")
    return problems


def _dashboard() -> dict[str, Any]:
    return json.loads((CHART_DIR / "dashboards" / "vsurge-overview.json").read_text())


def test_dashboard_expressions_use_exported_metrics(exported) -> None:
    problems, targets = [], 0
    for panel in _dashboard()["panels"]:
        for t in panel.get("targets", []):
            targets += 1
            problems += _check(t["expr"], exported, f"panel {panel['title']!r}")
    assert targets >= 20
    assert problems == []


def test_dashboard_covers_what_the_issue_lists(exported) -> None:
    used = " ".join(t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", []))
    for series in (
        "vsurge_generation_tokens_total",  # tok/s
        "vsurge_time_to_first_token_seconds_bucket",
        "vsurge_time_per_output_token_seconds_bucket",
        "vsurge_slot_occupancy",
        "vsurge_prefill_queue_size",
        "vsurge_kv_pages_used",
        "vsurge_http_requests_total",  # errors
        "vsurge_router_requests_total",
        "vsurge_compile_seconds",
        "vsurge_model_load_seconds",
        "vsurge_operator_scale_events_total",
        "vsurge_operator_reconciles_total",
    ):
        assert series in used, series


def test_dashboard_configmap_carries_the_sidecar_label_and_the_json(renders: dict[str, Rendered]) -> None:
    assert not renders["defaults"].of_kind("PrometheusRule") and not [
        c for c in renders["defaults"].of_kind("ConfigMap") if c["metadata"]["name"].endswith("dashboards")
    ]
    cm = renders["all-options"].get("ConfigMap", "vsurge-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "vSurge"}
    assert json.loads(cm["data"]["vsurge-overview.json"]) == _dashboard()


def _rules(renders: dict[str, Rendered]) -> list[dict[str, Any]]:
    rule = renders["all-options"].get("PrometheusRule", "vsurge")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def test_alerts_use_exported_metrics(renders: dict[str, Rendered], exported) -> None:
    rules = _rules(renders)
    assert {r["alert"] for r in rules} == {
        "VSurgeNoReadyReplica",
        "VSurgeHighErrorRate",
        "VSurgeQueueGrowing",
        "VSurgeTTFTHigh",
        "VSurgeOperatorNotReconciling",
        "VSurgeOperatorNotScraped",
        "VSurgeOperatorReconcileErrors",
        "VSurgeRouterRetryingOften",
        "VSurgeRouterPodUnreachable",
    }
    problems = []
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical") and r["for"] and r["annotations"]["summary"]
        problems += _check(r["expr"], exported, f"alert {r['alert']}")
    assert problems == []
    # The thresholds come from the values.
    by_name = {r["alert"]: r["expr"] for r in rules}
    assert "> 3" in by_name["VSurgeTTFTHigh"] and "> 0.02" in by_name["VSurgeHighErrorRate"]
    assert "> 16" in by_name["VSurgeQueueGrowing"]
    assert "> 0.2" in by_name["VSurgeRouterRetryingOften"]


def test_the_check_fails_on_a_name_or_label_the_code_does_not_export(exported) -> None:
    assert _check("rate(vsurge_tokens_per_second[5m])", exported, "x") == [
        "x: vsurge_tokens_per_second is not exported by the server, the router or the operator"
    ]
    # vsurge_http_requests has model, route and status: no "code" label (that is the router's)
    (problem,) = _check('sum(rate(vsurge_http_requests_total{code="500"}[5m]))', exported, "y")
    assert "no label(s) ['code']" in problem
    # A histogram's family name alone is not a series.
    assert _check("vsurge_time_to_first_token_seconds", exported, "z")
