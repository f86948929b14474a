"""The router's own Prometheus metrics (prefix `vsurge_router_`), in a registry of its own.

A registry per router (not the process-global one) keeps several routers in one test process apart.
The `model` label only takes names the table knows (or `""` for requests that named none / an unknown
one), so a client cannot grow the series without bound; `upstream` is bounded by the replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from .table import EndpointTable

# Upstream latency spans a fast tokenize (ms) to a long non-streamed generation (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _TableCollector:
    """Ready upstreams per model, read from the table at scrape time (nothing to keep in sync)."""

    def __init__(self, table: Callable[[], EndpointTable | None]) -> None:
        self._table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "vsurge_router_model_upstreams", "Ready upstreams the router knows per model", labels=["model"]
        )
        table = self._table()
        for view in table.models() if table is not None else ():
            family.add_metric([view.name], len(view.upstreams))
        yield family


class RouterMetrics:
    def __init__(self, table: EndpointTable | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "vsurge_router_requests",
            "Requests answered by the router, by model and HTTP status",
            ["model", "code"],
            registry=r,
        )
        self.in_flight = Gauge(
            "vsurge_router_requests_in_flight",
            "Requests being proxied (streams until their last byte)",
            ["model"],
            registry=r,
        )
        self.upstream_latency = Histogram(
            "vsurge_router_upstream_latency_seconds",
            "From sending a request upstream to its response headers (for a stream: its first event)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            "vsurge_router_request_duration_seconds",
            "From the request's arrival to the last byte of its answer, wake-up waits included",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_requests = Counter(
            "vsurge_router_upstream_requests",
            "Attempts sent upstream, by outcome: the HTTP status, or connect_error",
            ["model", "upstream", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "vsurge_router_retries",
            "Requests retried on another upstream, by reason",
            ["model", "reason"],
            registry=r,
        )
        self.wakeups = Counter(
            "vsurge_router_wakeups",
            "Scale-from-zero waits, by outcome: ready, timeout, error",
            ["model", "outcome"],
            registry=r,
        )
        self.scale_patches = Counter(
            "vsurge_router_scale_patches",
            "Scale subresource patches sent to wake a model, by outcome",
            ["model", "outcome"],
            registry=r,
        )
        self.picks = Counter(
            "vsurge_router_picks",
            "Pods picked, by routing policy and how: prefix_match (the pod that served the prompt's longest "
            "prefix), prefix_hash (the prefix's place on the bounded-load ring), least_load, round_robin",
            ["model", "policy", "how"],
            registry=r,
        )
        self.adapter_picks = Counter(
            "vsurge_router_adapter_picks",
            "Pods picked for a LoRA adapter's request, by how: in_use (the pod runs the adapter now), listed "
            "(the pod lists it), any (no pod with it was under the load bound)",
            ["model", "how"],
            registry=r,
        )
        self.load_polls = Counter(
            "vsurge_router_load_polls",
            "GET /load polls of the pods, by outcome: ok, unreachable, error, not_a_report",
            ["outcome"],
            registry=r,
        )
        # Tenants (--api-keys-file): the tenant label only takes names from that file.
        self.tenant_requests = Counter(
            "vsurge_router_tenant_requests",
            "Requests of each tenant, by model and HTTP status (429: over a limit)",
            ["tenant", "model", "code"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "vsurge_router_tenant_tokens",
            "Tokens each tenant used, from the answers' usage: prompt or completion",
            ["tenant", "model", "kind"],
            registry=r,
        )
        self.rate_limited = Counter(
            "vsurge_router_rate_limited",
            "Requests refused with 429 by a tenant's limit: requests (per second) or tokens (per minute)",
            ["tenant", "limit"],
            registry=r,
        )
        self.auth_failures = Counter(
            "vsurge_router_auth_failures",
            "Requests refused with 401: missing or invalid API key",
            ["reason"],
            registry=r,
        )
        self._table = table
        r.register(_TableCollector(lambda: self._table))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
