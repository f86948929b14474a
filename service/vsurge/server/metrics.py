"""Prometheus metrics of one server: engine figures read at scrape time, latency histograms fed by vSurge.

Names are a contract: the operator's autoscaler reads `vsurge_slot_occupancy` and
`vsurge_prefill_queue_size` exactly as spelled here. Every series carries a `model` label (the served
model name), so one scrape of a multi-model pod tells the models apart.

Each server owns its own CollectorRegistry, so several servers in one process (tests) never collide.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from .load_report import model_load

log = logging.getLogger(__name__)

PREFIX = "vsurge_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets sized for LLM serving: TTFT from a cached-prefix millisecond to a long queued prompt, TPOT
# around a decode step (a few ms on TPU, tens on CPU), e2e up to long generations.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# One engine step: a TPU decode step of a small model takes ~1 ms, a CPU one or a long prefill seconds.
STEP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

# DriverMetrics field -> (metric name, help). Gauges are sampled at scrape time.
_GAUGES = (
    ("slots_used", "vsurge_slots_used", "Decode slots holding a running sample."),
    ("slots_total", "vsurge_slots_total", "Decode slots in total (max concurrent decodes)."),
    (
        "slot_occupancy",
        "vsurge_slot_occupancy",
        "Fraction of decode slots in use, 0-1 (the autoscaling signal).",
    ),
    ("prefill_queue_size", "vsurge_prefill_queue_size", "Requests waiting for prefill."),
    ("requests_running", "vsurge_requests_running", "Requests being prefilled or decoded."),
    ("requests_waiting", "vsurge_requests_waiting", "Requests queued, not yet decoding."),
)
_PAGE_GAUGES = (
    ("pages_used", "vsurge_kv_pages_used", "KV-cache pages in use (paged driver)."),
    ("pages_total", "vsurge_kv_pages_total", "KV-cache pages in total (paged driver)."),
)
_SPEC_COUNTERS = (
    (
        "spec_decode_draft_tokens_total",
        "vsurge_spec_decode_draft_tokens",
        "Draft tokens verified by speculative decoding.",
    ),
    (
        "spec_decode_accepted_tokens_total",
        "vsurge_spec_decode_accepted_tokens",
        "Draft tokens accepted by speculative decoding.",
    ),
)
_COUNTERS = (
    ("prompt_tokens_total", "vsurge_prompt_tokens", "Prompt tokens accepted."),
    ("generation_tokens_total", "vsurge_generation_tokens", "Tokens generated."),
    ("preemptions_total", "vsurge_preemptions", "Requests preempted to free KV pages."),
    ("prefix_cache_hits_total", "vsurge_prefix_cache_hits", "Prefills that reused cached prefix pages."),
)


class _DownloadCollector(Collector):
    """vsurge_model_download_bytes_total{store}: bytes fetched from each model store by this process."""

    def collect(self) -> Iterator[Metric]:
        from vsurge.models.sources.progress import download_bytes

        fam = CounterMetricFamily(
            "vsurge_model_download_bytes", "Bytes of model files downloaded, by store.", labels=["store"]
        )
        for store, n in sorted(download_bytes().items()):
            fam.add_metric([store], n)
        yield fam


class _EngineCollector(Collector):
    """Reads every model's DriverMetrics when Prometheus scrapes; nothing is stored between scrapes."""

    def __init__(self, owner: ServerMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        snapshots = []
        for name, surge in self._owner.models():
            try:
                snapshots.append((name, surge.metrics()))
            except Exception:  # a scrape must never fail because one engine is mid-shutdown
                log.debug("metrics() failed for %s", name, exc_info=True)
        for field, metric, doc in _GAUGES:
            g = GaugeMetricFamily(metric, doc, labels=["model"])
            for name, m in snapshots:
                g.add_metric([name], float(getattr(m, field, 0) or 0))
            yield g
        for field, metric, doc in _PAGE_GAUGES:
            g = GaugeMetricFamily(metric, doc, labels=["model"])
            for name, m in snapshots:
                value = getattr(m, field, None)
                if value is not None:  # the slot-per-row driver has no pages; absent beats a fake zero
                    g.add_metric([name], float(value))
            yield g
        for field, metric, doc in _COUNTERS:
            c = CounterMetricFamily(metric, doc, labels=["model"])
            for name, m in snapshots:
                c.add_metric([name], float(getattr(m, field, 0) or 0))
            yield c
        yield from self._speculative(snapshots)
        yield from gateway_metrics(snapshots)
        fin = CounterMetricFamily(
            "vsurge_requests_finished",
            "Finished samples by finish reason.",
            labels=["model", "finish_reason"],
        )
        for name, m in snapshots:
            for reason, count in sorted((getattr(m, "finished_total", None) or {}).items()):
                fin.add_metric([name, reason], float(count))
        yield fin
        ready = GaugeMetricFamily(
            "vsurge_ready", "1 when the model is compiled and serving.", labels=["model"]
        )
        for name, _ in snapshots:
            ready.add_metric([name], 1.0 if self._owner.is_ready() else 0.0)
        yield ready

    @staticmethod
    def _speculative(snapshots: list[tuple[str, Any]]) -> Iterator[Metric]:
        """Speculative decoding's counters and acceptance rate, for the models that run it."""
        spec = [
            (n, m) for n, m in snapshots if getattr(m, "spec_decode_draft_tokens_total", None) is not None
        ]
        for field, metric, doc in _SPEC_COUNTERS:
            c = CounterMetricFamily(metric, doc, labels=["model"])
            for name, m in spec:
                c.add_metric([name], float(getattr(m, field) or 0))
            yield c
        rate = GaugeMetricFamily(
            "vsurge_spec_decode_acceptance_rate",
            "Accepted / verified draft tokens since start, 0-1 (speculative decoding).",
            labels=["model"],
        )
        for name, m in spec:
            drafted = m.spec_decode_draft_tokens_total
            rate.add_metric([name], (m.spec_decode_accepted_tokens_total or 0) / drafted if drafted else 0.0)
        yield rate


def gateway_metrics(snapshots: list[tuple[str, Any]]) -> Iterator[Metric]:
    """The Gateway API Inference Extension's model-server protocol, under the names its endpoint picker
    reads by default (vLLM's, label `model_name`): queued and running requests, KV-cache use as a 0-1
    fraction (pages on odriver, decode slots on vdriver, as /load reports it), and LoRA adapters when the
    engine reports them (`max_loras`, `running_loras`, `waiting_loras` on its metrics)."""
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting",
        "Requests queued, not yet decoding (GIE TotalQueuedRequests).",
        labels=["model_name"],
    )
    running = GaugeMetricFamily(
        "vllm:num_requests_running",
        "Requests being prefilled or decoded (GIE TotalRunningRequests).",
        labels=["model_name"],
    )
    kv = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc", "KV-cache use, 0-1 (GIE KVCacheUtilization).", labels=["model_name"]
    )
    kv_v0 = GaugeMetricFamily(
        "vllm:gpu_cache_usage_perc",
        "KV-cache use, 0-1 (the name of older endpoint pickers).",
        labels=["model_name"],
    )
    lora = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "LoRA adapters: the value is the time of the report; labels list the adapters (GIE LoRA affinity).",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    now = time.time()
    for name, m in snapshots:
        waiting.add_metric([name], float(getattr(m, "requests_waiting", 0) or 0))
        running.add_metric([name], float(getattr(m, "requests_running", 0) or 0))
        try:
            usage = model_load(m)["kv_usage"]
        except (TypeError, ValueError, AttributeError):
            usage = 0.0
        kv.add_metric([name], usage)
        kv_v0.add_metric([name], usage)
        max_loras = getattr(m, "max_loras", None)
        if max_loras is not None:
            lora.add_metric(
                [
                    str(max_loras),
                    ",".join(getattr(m, "running_loras", None) or ()),
                    ",".join(getattr(m, "waiting_loras", None) or ()),
                ],
                now,
            )
    yield from (waiting, running, kv, kv_v0, lora)


class ServerMetrics:
    """All metrics of one vSurgeApiServer, in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._models: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._ready = lambda: False
        r = self.registry
        self.ttft = Histogram(
            "vsurge_time_to_first_token_seconds",
            "Time from queueing to the first token.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vsurge_time_per_output_token_seconds",
            "Mean time per output token after the first, per sample.",
            ["model"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vsurge_e2e_request_latency_seconds",
            "Time from queueing to the last token.",
            ["model"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vsurge_request_queue_time_seconds",
            "Time from queueing to the start of prefill.",
            ["model"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        # per engine step, by program kind (drivers/step_timing.py says how each is taken)
        self.step_seconds = {
            what: Histogram(
                f"vsurge_step_{what}_seconds",
                help,
                ["model", "kind"],
                buckets=STEP_BUCKETS,
                registry=r,
            )
            for what, help in (
                ("device", "Seconds from a step's dispatch until its results are ready, by program kind."),
                (
                    "host",
                    "Seconds of the driver's Python time per step (planning, dispatch), by program kind.",
                ),
            )
        }
        self.load_seconds = Gauge(
            "vsurge_model_load_seconds",
            "Seconds spent loading the model, by phase: download, place (on devices), compile, total.",
            ["model", "phase"],
            registry=r,
        )
        self.compile_seconds = Gauge(
            "vsurge_compile_seconds", "Seconds spent compiling every shape at warm-up.", ["model"], registry=r
        )
        self.http_requests = Counter(
            "vsurge_http_requests",
            "HTTP requests answered, by route and status.",
            ["model", "route", "status"],
            registry=r,
        )
        # what each model's engine resolved to run (vsurge/engines/resolved_config.py): the operator copies it into
        # the InferenceModel's status.engine
        self.engine_info = Gauge(
            "vsurge_engine_info",
            "1, labelled with what the model's engine runs: driver, attention path, decode steps, backend.",
            ["model", "driver", "attention", "decode_steps", "backend"],
            registry=r,
        )
        self.lora_requests = Counter(
            "vsurge_lora_requests_total",
            "Finished samples of requests for a LoRA adapter, by base model and adapter.",
            ["model", "adapter"],
            registry=r,
        )
        self.lora_tokens = Counter(
            "vsurge_lora_generation_tokens_total",
            "Tokens generated for requests of a LoRA adapter, by base model and adapter.",
            ["model", "adapter"],
            registry=r,
        )
        self.in_flight = Gauge(
            "vsurge_http_requests_in_flight", "Generation requests the server is answering now.", registry=r
        )
        r.register(_EngineCollector(self))
        r.register(_DownloadCollector())

    # ------------------------------------------------------------------ wiring
    def add_model(self, name: str, surge: Any) -> None:
        """Export `surge`'s figures under model=`name` and feed its finished samples to the histograms."""
        with self._lock:
            self._models[name] = surge
        try:
            from vsurge.engines.resolved_config import running_info

            info = running_info(surge)
        except (AttributeError, IndexError):  # a stand-in without a driver's engines (tests)
            info = None
        if info is not None:
            self.engine_info.labels(
                name, info["driver"], info["attention"], str(info["decode_steps"]), info["backend"]
            ).set(1)
        add_observer = getattr(surge, "add_observer", None)
        if add_observer is not None:
            add_observer(lambda stats, _name=name: self.observe(_name, stats))
        # each engine step's device and host seconds (drivers/step_timing.py); a driver of the seed's own
        # has no step clock and reports none
        clock = getattr(getattr(getattr(surge, "driver", None), "pipeline", None), "clock", None)
        if clock is not None:
            clock.observers.append(
                lambda what, kind, s, _n=name: self.step_seconds[what].labels(_n, kind).observe(s)
            )

    def models(self) -> list[tuple[str, Any]]:
        with self._lock:
            return list(self._models.items())

    def set_ready_probe(self, fn: Any) -> None:
        self._ready = fn

    def is_ready(self) -> bool:
        return bool(self._ready())

    # ------------------------------------------------------------------ observations
    def observe(self, model: str, stats: Any) -> None:
        """Called from a driver thread once per finished sample; prometheus_client is thread-safe."""
        adapter = getattr(stats, "adapter", None)
        if adapter:  # a LoRA adapter's request: counted per adapter too
            self.lora_requests.labels(model, adapter).inc()
            self.lora_tokens.labels(model, adapter).inc(stats.generated_tokens)
        if stats.ttft is not None:
            self.ttft.labels(model).observe(stats.ttft)
        if stats.tpot is not None:
            self.tpot.labels(model).observe(stats.tpot)
        if stats.e2e_latency is not None:
            self.e2e.labels(model).observe(stats.e2e_latency)
        if stats.queue_time is not None:
            self.queue_time.labels(model).observe(stats.queue_time)

    def record_http(self, model: str, route: str, status: int) -> None:
        self.http_requests.labels(model, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, threading.Thread]:
    """Serve /metrics on its own port from a thread, so scrapes never wait behind the event loop."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=host, registry=registry)
