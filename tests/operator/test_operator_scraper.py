"""Finding the pods to scrape, parsing Prometheus text, and scraping real servers on loopback."""

from __future__ import annotations

import asyncio
import http.server
import threading
from typing import Any

import pytest
from kmock_harness import free_port
from operator_harness import MetricsBoard, PodMetricsServer

from vsurge_operator import scraper
from vsurge_operator.autoscaler import PodSample

SELECTOR = {"app.kubernetes.io/name": "vsurge-server", "vsurge.io/model": "llama"}

TEXT = """\
# HELP vsurge_slot_occupancy Fraction of decode slots in use
# TYPE vsurge_slot_occupancy gauge
vsurge_slot_occupancy{model="llama"} 0.75
vsurge_slot_occupancy{model="other"} 0.1
# TYPE vsurge_prefill_queue_size gauge
vsurge_prefill_queue_size{model="llama"} 3
# TYPE vsurge_requests_total counter
vsurge_requests_total{model="llama"} 12
"""


def test_parse_value_prefers_the_model_label():
    assert scraper.parse_value(TEXT, "vsurge_slot_occupancy", "llama") == 0.75
    assert scraper.parse_value(TEXT, "vsurge_prefill_queue_size", "llama") == 3
    # Unknown model label: all samples of the series are averaged rather than dropped.
    assert scraper.parse_value(TEXT, "vsurge_slot_occupancy", "nobody") == pytest.approx(0.425)
    assert scraper.parse_value(TEXT, "vsurge_slot_occupancy") == pytest.approx(0.425)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "vsurge_requests_total 1\n",
        "vsurge_slot_occupancy NaN\n",
        "vsurge_slot_occupancy +Inf\n",
        "this is { not prometheus\n",
    ],
)
def test_parse_value_returns_none_when_absent_or_broken(text):
    assert scraper.parse_value(text, "vsurge_slot_occupancy", "llama") is None


def pod(
    name: str,
    *,
    ready: bool = True,
    ip: str | None = "10.0.0.1",
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    port: int | None = 9100,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": dict(SELECTOR if labels is None else labels)}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    ports = [{"name": "http", "containerPort": 11556}]
    if port is not None:
        ports.append({"name": "metrics", "containerPort": port})
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": [{"name": "server", "ports": ports}]}, "status": status}


def test_scrape_targets():
    pods = [
        pod("b-ready"),
        pod("a-not-ready", ready=False),
        pod("c-pending", ip=None, phase="Pending", ready=False),
        pod("d-other-model", labels={**SELECTOR, "vsurge.io/model": "other"}),
        pod("e-finished", phase="Succeeded"),
        pod("f-terminating", deleting=True),
        pod("g-default-port", port=None),
        pod("h-ipv6", ip="fd00::5"),
    ]
    targets = scraper.scrape_targets(pods, SELECTOR)
    assert [(t.pod, t.ready, t.url) for t in targets] == [
        ("a-not-ready", False, "http://10.0.0.1:9100/metrics"),
        ("b-ready", True, "http://10.0.0.1:9100/metrics"),
        ("c-pending", False, None),
        ("f-terminating", False, "http://10.0.0.1:9100/metrics"),
        ("g-default-port", True, "http://10.0.0.1:11557/metrics"),
        ("h-ipv6", True, "http://[fd00::5]:9100/metrics"),
    ]


def test_scrape_targets_leaders_only():
    idx = "leaderworkerset.sigs.k8s.io/worker-index"
    pods = [pod("g0-0", labels={**SELECTOR, idx: "0"}), pod("g0-1", labels={**SELECTOR, idx: "1"})]
    assert [t.pod for t in scraper.scrape_targets(pods, SELECTOR, leaders_only=True)] == ["g0-0"]
    assert len(scraper.scrape_targets(pods, SELECTOR)) == 2


class _Failing(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server API
        self.send_error(500)

    def log_message(self, *args: Any) -> None:
        pass


def test_scrape_real_servers():
    board = MetricsBoard(occupancy=0.6, queue=2)
    good = PodMetricsServer(board, "llama", "good")
    silent = PodMetricsServer(board, "llama", "silent")
    board.silent.add("silent")
    failing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=failing.serve_forever, daemon=True).start()
    dead_port = free_port()
    try:
        targets = [
            scraper.ScrapeTarget("good", True, f"http://127.0.0.1:{good.port}/metrics"),
            scraper.ScrapeTarget("silent", True, f"http://127.0.0.1:{silent.port}/metrics"),
            scraper.ScrapeTarget("failing", True, f"http://127.0.0.1:{failing.server_address[1]}/metrics"),
            scraper.ScrapeTarget("dead", True, f"http://127.0.0.1:{dead_port}/metrics"),
            scraper.ScrapeTarget("unready", False, f"http://127.0.0.1:{good.port}/metrics"),
        ]
        series = ["vsurge_slot_occupancy", "vsurge_prefill_queue_size"]
        results = asyncio.run(scraper.scrape(targets, series, model="llama", timeout=2))
    finally:
        good.close()
        silent.close()
        failing.shutdown()
        failing.server_close()
    by_pod = {r.pod: r for r in results}
    assert by_pod["good"].values == {"vsurge_slot_occupancy": 0.6, "vsurge_prefill_queue_size": 2}
    assert by_pod["silent"].ready and by_pod["silent"].values == {
        "vsurge_slot_occupancy": None,
        "vsurge_prefill_queue_size": None,
    }
    assert by_pod["failing"].ready and by_pod["failing"].values == {}
    assert by_pod["dead"].ready and by_pod["dead"].values == {}
    assert not by_pod["unready"].ready
    samples = [r.sample("vsurge_slot_occupancy") for r in results]
    assert samples[0] == PodSample("good", True, 0.6)
    assert samples[-1] == PodSample("unready", False, None)
    assert scraper.mean_over_ready(results, "vsurge_slot_occupancy") == 0.6
    assert scraper.mean_over_ready([], "vsurge_slot_occupancy") is None


def test_engine_info_labels_become_status_engine():
    text = (
        "# TYPE vsurge_engine_info gauge\n"
        'vsurge_engine_info{model="other",driver="odriver",attention="paged, pure JAX",decode_steps="1",backend="cpu"} 1\n'
        'vsurge_engine_info{model="m",driver="vdriver",attention="dense (flat rows)",decode_steps="4",backend="tpu"} 1\n'
    )
    labels = scraper.parse_labels(text, scraper.ENGINE_INFO_SERIES, "m")
    assert labels["driver"] == "vdriver" and labels["decode_steps"] == "4"
    assert scraper.parse_labels("", scraper.ENGINE_INFO_SERIES) is None
    results = [
        scraper.PodMetrics("a", ready=False, values={}, engine={"driver": "x"}),  # unready pods do not count
        scraper.PodMetrics("b", ready=True, values={}, engine=labels),
    ]
    assert scraper.engine_status(results) == {
        "driver": "vdriver",
        "attention": "dense (flat rows)",
        "backend": "tpu",
        "decodeSteps": 4,
    }
    assert scraper.engine_status([scraper.PodMetrics("c", ready=True, values={})]) is None
