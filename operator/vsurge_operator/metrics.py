"""The operator's own Prometheus metrics: reconcile passes, their outcome and time, and scale events.

Served on ``--metrics-port`` (the chart's operator.metricsPort) from one registry per process. Only the
active replica (kopf peering) reconciles, so its series move and a standby's stay flat; the dashboard and
the alerts take the max or the sum over replicas.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()

RECONCILES = Counter(
    "vsurge_operator_reconciles",
    "Reconcile passes, by trigger (event, timer) and result (ok, invalid, error).",
    ["trigger", "result"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "vsurge_operator_reconcile_duration_seconds",
    "Seconds one reconcile pass took.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
LAST_RECONCILE = Gauge(
    "vsurge_operator_last_reconcile_timestamp_seconds",
    "Unix time of the last reconcile pass that succeeded (every model is resynced every 30 s).",
    registry=REGISTRY,
)
SCALE_EVENTS = Counter(
    "vsurge_operator_scale_events",
    "Replica changes made by the autoscaler, by model and direction (up, down).",
    ["namespace", "model", "direction"],
    registry=REGISTRY,
)
AUTOSCALER_ERRORS = Counter(
    "vsurge_operator_autoscaler_errors",
    "Autoscaler passes that failed (scrape, API).",
    registry=REGISTRY,
)


def observe_reconcile(trigger: str, result: str, seconds: float) -> None:
    RECONCILES.labels(trigger, result).inc()
    RECONCILE_SECONDS.observe(seconds)
    if result != "error":
        LAST_RECONCILE.set(time.time())


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Expose /metrics on ``port`` (a daemon thread of prometheus_client)."""
    start_http_server(port, addr=host, registry=REGISTRY)
