"""Reading the model pods' Prometheus metrics for the autoscaler.

``scrape_targets`` (pure) turns Pod objects into what to scrape; ``scrape`` fetches every ready pod's
``/metrics`` concurrently with a short timeout; ``parse_value`` (pure) reads one gauge out of the
Prometheus text format. A pod that cannot be reached or does not report the series yields a sample with
``value=None``, which the decision treats conservatively.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from vsurge_operator.autoscaler import PodSample
from vsurge_operator.manifests import LWS_WORKER_INDEX_LABEL
from vsurge_operator.spec import METRICS_PORT


@dataclass(frozen=True)
class ScrapeTarget:
    pod: str
    ready: bool
    url: str | None  # None when the pod has no IP yet


def pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _metrics_port(pod: Mapping[str, Any]) -> int:
    # The port named "metrics" in the pod spec; tests and custom images may move it.
    for c in pod.get("spec", {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "metrics" and p.get("containerPort"):
                return int(p["containerPort"])
    return METRICS_PORT


def _host(ip: str) -> str:
    try:
        return f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    except ValueError:
        return ip


def scrape_targets(
    pods: Iterable[Mapping[str, Any]], selector: Mapping[str, str], *, leaders_only: bool = False
) -> list[ScrapeTarget]:
    """The model's pods that count for autoscaling, sorted by name.

    Labels are matched here as well as in the list request (a label selector the API server ignored
    must not make us scrape another model). Finished pods are left out (the HPA ignores them too); for a
    LeaderWorkerSet only the leaders serve requests and export the serving metrics.
    """
    out = []
    for pod in pods:
        meta = pod.get("metadata", {})
        pod_labels = meta.get("labels") or {}
        if any(pod_labels.get(k) != v for k, v in selector.items()):
            continue
        if leaders_only and pod_labels.get(LWS_WORKER_INDEX_LABEL, "0") != "0":
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        ip = (pod.get("status") or {}).get("podIP")
        url = f"http://{_host(ip)}:{_metrics_port(pod)}/metrics" if ip else None
        out.append(ScrapeTarget(pod=meta.get("name", ""), ready=pod_ready(pod) and url is not None, url=url))
    return sorted(out, key=lambda t: t.pod)


ENGINE_INFO_SERIES = "vsurge_engine_info"


def engine_status(results: Iterable[PodMetrics]) -> dict[str, Any] | None:
    """status.engine from the first ready pod that reported what its engine runs."""
    for r in results:
        if r.ready and r.engine:
            e = r.engine
            out: dict[str, Any] = {k: e[k] for k in ("driver", "attention", "backend") if k in e}
            if str(e.get("decode_steps", "")).isdigit():
                out["decodeSteps"] = int(e["decode_steps"])
            return out
    return None


def parse_value(text: str, series: str, model: str | None = None) -> float | None:
    """The value of gauge ``series`` in Prometheus text; prefers the sample labelled with ``model``.

    Returns None when the series is absent, unparsable or not finite.
    """
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError):
        return None
    samples = [s for f in families for s in f.samples if s.name == series]
    if model is not None:
        labelled = [s for s in samples if s.labels.get("model") == model]
        samples = labelled or samples
    values = [float(s.value) for s in samples if math.isfinite(float(s.value))]
    if not values:
        return None
    return sum(values) / len(values)


def parse_labels(text: str, series: str, model: str | None = None) -> dict[str, str] | None:
    """The labels of info series ``series`` (a gauge at 1) in Prometheus text, for ``model`` when labelled
    so; None when absent."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError):
        return None
    samples = [s for f in families for s in f.samples if s.name == series and s.value == 1]
    if model is not None:
        samples = [s for s in samples if s.labels.get("model") == model] or samples
    return dict(samples[0].labels) if samples else None


@dataclass(frozen=True)
class PodMetrics:
    """What one pod reported: ``values[series]`` is None when the series was missing or unreachable."""

    pod: str
    ready: bool
    values: Mapping[str, float | None]
    engine: Mapping[str, str] | None = None  # the labels of vsurge_engine_info

    def sample(self, series: str) -> PodSample:
        return PodSample(self.pod, ready=self.ready, value=self.values.get(series))


async def _fetch(
    client: httpx.AsyncClient, target: ScrapeTarget, series: Sequence[str], model: str | None
) -> PodMetrics:
    if not target.ready or target.url is None:
        return PodMetrics(target.pod, ready=False, values={})
    try:
        response = await client.get(target.url)
        response.raise_for_status()
    except httpx.HTTPError:
        return PodMetrics(target.pod, ready=True, values={})
    return PodMetrics(
        target.pod,
        ready=True,
        values={s: parse_value(response.text, s, model) for s in series},
        engine=parse_labels(response.text, ENGINE_INFO_SERIES, model),
    )


async def scrape(
    targets: Sequence[ScrapeTarget], series: Sequence[str], *, model: str | None = None, timeout: float = 2.0
) -> list[PodMetrics]:
    """One result per target, fetched concurrently; unready pods are not contacted."""
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        return list(await asyncio.gather(*(_fetch(client, t, series, model) for t in targets)))


def mean_over_ready(results: Iterable[PodMetrics], series: str) -> float | None:
    values = [v for r in results if r.ready and (v := r.values.get(series)) is not None]
    return sum(values) / len(values) if values else None
