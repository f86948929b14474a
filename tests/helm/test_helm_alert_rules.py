"""The chart's operator alerts evaluated by Prometheus' own rule engine (`promtool test rules`, from the
Debian package `prometheus`, which `make test-deps` installs when missing) on recorded series: they stay
quiet while the operator is healthy, whatever series are absent, and fire when it is not.

Issue 53: `VSurgeOperatorNotReconciling` used `absent(...)`, and nothing scraped the operator, so it fired
for ever once alerts were on. Now the chart scrapes every operator replica (templates/operator/metrics.yaml),
the reconcile alert reads only series that exist, and the one alert about absence
(`VSurgeOperatorNotScraped`) is rendered only with a monitor that scrapes the operator.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartkit import Rendered

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool (Debian package prometheus) is not installed"
)

# Series as the scrapes record them, every minute for 20 minutes (promtool's expanding notation).
MODELS_RUN = {"series": 'vsurge_ready{namespace="team-a", model="llama", pod="llama-0"}', "values": "1+0x20"}


def _operator(replica: str, values: str) -> dict[str, str]:
    return {
        "series": f'vsurge_operator_last_reconcile_timestamp_seconds{{pod="{replica}"}}',
        "values": values,
    }


# A healthy operator: the active replica reconciles every 30 s (its gauge is the time of the last pass, within
# the minute), the standby exports 0. Minutes in seconds: 60, 120, ...
HEALTHY_ACTIVE = _operator("op-a", "60+60x20")
STANDBY = _operator("op-b", "0+0x20")


def _alert_rules(r: Rendered) -> dict[str, Any]:
    rule = r.get("PrometheusRule", "vsurge")
    return {"groups": rule["spec"]["groups"]}


def _case(series: list[dict[str, str]], at: str, firing: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    names = ("VSurgeOperatorNotReconciling", "VSurgeOperatorNotScraped")
    return {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": at, "alertname": n, "exp_alerts": firing.get(n, [])} for n in names
        ],
    }


CRITICAL_NOT_SCRAPED = [
    {
        "exp_labels": {"severity": "critical"},
        "exp_annotations": {
            "summary": "No vSurge operator replica has been scraped for 10 minutes while models run"
        },
    }
]
CRITICAL_STUCK = [
    {
        "exp_labels": {"severity": "critical"},
        "exp_annotations": {"summary": "The vSurge operator has not reconciled any model for 5 minutes"},
    }
]


def run_promtool(
    tmp_path: Path, rules: dict[str, Any], cases: list[dict[str, Any]]
) -> subprocess.CompletedProcess:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": cases})
    )
    return subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_operator_alerts_quiet_while_healthy_fire_when_not(
    renders: dict[str, Rendered], tmp_path: Path
) -> None:
    rules = _alert_rules(renders["all-options"])  # alerts, and the operator's monitors, on
    cases = [
        # healthy: models run, the active replica reconciles, the standby exports 0: nothing fires
        _case([MODELS_RUN, HEALTHY_ACTIVE, STANDBY], "20m", {}),
        # no model at all and no operator series: nothing to say
        _case([], "20m", {}),
        # an operator without models (no vsurge_ready series at all): nothing fires on that absence
        _case([HEALTHY_ACTIVE, STANDBY], "20m", {}),
        # models run and no operator replica is scraped: the operator is down
        _case([MODELS_RUN], "20m", {"VSurgeOperatorNotScraped": CRITICAL_NOT_SCRAPED}),
        # scraped, but its last pass is stuck at minute 2: no reconcile for 5 minutes
        _case(
            [MODELS_RUN, _operator("op-a", "60 120 120x18"), STANDBY],
            "20m",
            {"VSurgeOperatorNotReconciling": CRITICAL_STUCK},
        ),
    ]
    out = run_promtool(tmp_path, rules, cases)
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_sees_a_wrong_expectation(renders: dict[str, Rendered], tmp_path: Path) -> None:
    """Control: a healthy operator expected to alert fails the run."""
    rules = _alert_rules(renders["all-options"])
    wrong = _case(
        [MODELS_RUN, HEALTHY_ACTIVE, STANDBY], "20m", {"VSurgeOperatorNotReconciling": CRITICAL_STUCK}
    )
    out = run_promtool(tmp_path, rules, [wrong])
    assert out.returncode != 0 and "FAILED" in (out.stdout + out.stderr)


def test_no_absence_alert_without_an_operator_monitor(renders: dict[str, Rendered], chart) -> None:
    """Alerts on without a monitor for the operator: the absence alert is not rendered (it could only ever
    fire), and the remaining operator alert has no absent()."""
    from chartkit import load_values, render

    values = load_values("all-options-values.yaml")
    values["monitoring"]["serviceMonitor"]["enabled"] = False
    values["monitoring"]["podMonitoring"]["enabled"] = False
    r = render(chart, values, "vsurge-system")
    rules = [rule for g in _alert_rules(r)["groups"] for rule in g["rules"]]
    names = {rule["alert"] for rule in rules}
    assert "VSurgeOperatorNotReconciling" in names and "VSurgeOperatorNotScraped" not in names
    assert not any("absent(" in rule["expr"] for rule in rules if rule["alert"].startswith("VSurgeOperator"))
