"""LoRA adapters on the pods: which pod lists which adapter, which has it in use, and the pick that follows.

A `vsurge serve --lora NAME=SOURCE` pod lists each adapter in `GET /v1/models` as a model object whose
`parent` is the base model, and reports the adapters its running and waiting requests use in the gauge
`vllm:lora_requests_info{running_lora_adapters="a,b",waiting_lora_adapters="",max_lora="8"}` (the Gateway
API Inference Extension's LoRA-affinity signal). `AdapterPoller` reads both from every upstream of the
table, every `interval` seconds, beside the `/load` poll:

- the listings make adapters routable by name (table aliases, group `pods`), including adapters loaded at
  run time (`POST /v1/load_lora_adapter`) that no InferenceModel or static file names;
- the gauge says where an adapter's weights are in the device bank now.

The pod's metrics are on its metrics port: `vsurge serve` puts them on the HTTP port + 1 (the operator's
pods: 11556 and 11557), other servers (vLLM) on the HTTP port itself; both are tried, and the one that
answered is kept for the pod. /metrics is read only from pods that list an adapter.

`adapter_candidates` (pure) narrows a request's candidates to the pods that have its adapter, best first:
in use there (running or waiting), else listed with a free adapter slot, else listed; only pods under the
bounded-load limit ((1 + eps) x the mean load) qualify, so affinity never piles requests on one pod. When no
pod qualifies, every candidate stays, and the routing policy picks among them as for any model.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from .hashring import load_bound
from .table import EndpointTable
from .upstream_polls import UpstreamPollers

log = logging.getLogger(__name__)

ALIAS_GROUP = "pods"
LORA_INFO = "vllm:lora_requests_info"
_SAMPLE = re.compile(r"^vllm:lora_requests_info\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class PodAdapters:
    """What one pod reported. `listed` is None when its /v1/models did not answer; `max_lora` is None
    when its metrics have no LoRA gauge (the in-use sets are then empty)."""

    at: float
    listed: frozenset[str] | None = None
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int | None = None

    @property
    def active(self) -> frozenset[str]:
        return self.running | self.waiting


def parse_models(body: Any) -> dict[str, str] | None:
    """A `/v1/models` answer -> {adapter: parent} (model objects with a `parent`); None if not one."""
    if not isinstance(body, Mapping) or not isinstance(body.get("data"), list):
        return None
    out = {}
    for m in body["data"]:
        if isinstance(m, Mapping) and isinstance(m.get("id"), str) and isinstance(m.get("parent"), str):
            out[m["id"]] = m["parent"]
    return out


def _names(text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.split(",") if n.strip())


def parse_lora_info(text: str) -> tuple[frozenset[str], frozenset[str], int] | None:
    """(running, waiting, max_lora) of the newest `vllm:lora_requests_info` sample (its value is the time
    of the report, as vLLM writes it); None when the text has none. Scans lines: a pod's whole /metrics
    is not worth a full Prometheus parse every second."""
    best: tuple[float, dict[str, str]] | None = None
    for line in text.splitlines():
        if not line.startswith(LORA_INFO + "{"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group("labels")))
        if best is None or value >= best[0]:
            best = (value, labels)
    if best is None:
        return None
    labels = best[1]
    try:
        max_lora = max(0, int(labels.get("max_lora", "0")))
    except ValueError:
        max_lora = 0
    return (
        _names(labels.get("running_lora_adapters", "")),
        _names(labels.get("waiting_lora_adapters", "")),
        max_lora,
    )


def metrics_urls(upstream: str) -> list[str]:
    """Where a pod's /metrics may be: the HTTP port itself (vLLM; `vsurge serve` answers 404 there unless
    its metrics port is off), then the HTTP port + 1 (`vsurge serve`'s metrics port). The one that answers
    is remembered, so the first costs one request once."""
    parts = urlsplit(upstream)
    out = [f"{upstream}/metrics"]
    if parts.port is not None and parts.port < 65535 and parts.hostname:
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        out.append(urlunsplit((parts.scheme, f"{host}:{parts.port + 1}", "/metrics", "", "")))
    return out


def adapter_candidates(
    adapter: str,
    candidates: Sequence[str],
    pods: Mapping[str, PodAdapters],
    loads: Mapping[str, int],
    eps: float,
) -> tuple[list[str], str]:
    """The candidates to pick from for a request for `adapter`, and how they were found: `in_use`,
    `listed` (a free adapter slot first, then any), or `any` (no pod qualifies: every candidate)."""
    if not candidates:
        return [], "any"
    bound = load_bound(sum(loads.get(c, 0) for c in candidates), len(candidates), eps)

    def tier(pod: str) -> int:
        p = pods.get(pod)
        if p is None:
            return 3
        if adapter in p.active:
            return 0
        if p.listed is not None and adapter in p.listed:
            full = p.max_lora is not None and p.max_lora > 0 and len(p.active) >= p.max_lora
            return 2 if full else 1
        return 3

    tiers = {c: tier(c) for c in candidates}
    for level, how in ((0, "in_use"), (1, "listed"), (2, "listed")):
        chosen = [c for c in candidates if tiers[c] == level and loads.get(c, 0) + 1 <= bound]
        if chosen:
            return chosen, how
    return list(candidates), "any"


class AdapterBook:
    """The latest adapter report of each upstream."""

    def __init__(self, stale_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after = stale_after
        self.clock = clock
        self._pods: dict[str, PodAdapters] = {}

    def put(self, upstream: str, report: PodAdapters) -> None:
        self._pods[upstream] = report

    def drop(self, upstream: str) -> None:
        self._pods.pop(upstream, None)

    def fresh(self, upstreams: Iterable[str]) -> dict[str, PodAdapters]:
        now = self.clock()
        return {
            u: r for u in upstreams if (r := self._pods.get(u)) is not None and now - r.at <= self.stale_after
        }


def aliases_from(table: EndpointTable, book: AdapterBook) -> dict[str, str]:
    """Adapter -> the model whose pods list it, for every adapter a fresh report lists."""
    out: dict[str, str] = {}
    for view in table.models():
        for report in book.fresh(view.upstreams).values():
            for adapter in report.listed or ():
                if adapter != view.name:
                    out.setdefault(adapter, view.name)
    return out


class AdapterPoller(UpstreamPollers):
    """Polls every upstream's `/v1/models` and LoRA gauge; plugs into the app like a discovery source. It
    re-syncs every interval too: the aliases are republished as reports arrive and go stale."""

    name = "vsurge-router-lora"

    def __init__(
        self, client: httpx.AsyncClient, book: AdapterBook, *, interval: float = 1.0, timeout: float = 1.0
    ) -> None:
        super().__init__()
        self.client = client
        self.book = book
        self.interval = self.resync_every = interval
        self.timeout = timeout
        self._metrics_url: dict[str, str] = {}

    def synced(self, table: EndpointTable) -> None:
        table.set_aliases(ALIAS_GROUP, aliases_from(table, self.book))

    async def _poll(self, upstream: str) -> None:
        while True:
            report = await self.read(upstream)
            if report is None:
                self.book.drop(upstream)
            else:
                self.book.put(upstream, report)
            await asyncio.sleep(self.interval)

    async def read(self, upstream: str) -> PodAdapters | None:
        """One pod's report; None when its /v1/models did not answer with a model list."""
        try:
            response = await self.client.get(f"{upstream}/v1/models", timeout=self.timeout)
            parents = parse_models(response.json()) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            parents = None
        if parents is None:
            return None
        running: frozenset[str] = frozenset()
        waiting: frozenset[str] = frozenset()
        max_lora = None
        if parents:  # no adapter listed: nothing to ask the metrics
            info = await self._lora_info(upstream)
            if info is not None:
                running, waiting, max_lora = info
        return PodAdapters(
            at=self.book.clock(),
            listed=frozenset(parents),
            running=running,
            waiting=waiting,
            max_lora=max_lora,
        )

    async def _lora_info(self, upstream: str) -> tuple[frozenset[str], frozenset[str], int] | None:
        known = self._metrics_url.get(upstream)
        for url in [known] if known else metrics_urls(upstream):
            try:
                response = await self.client.get(url, timeout=self.timeout)
            except httpx.HTTPError:
                continue
            if response.status_code != 200:
                continue
            info = parse_lora_info(response.text)
            if info is not None:
                self._metrics_url[upstream] = url
                return info
        if known:  # it moved (a restarted pod on another server): look again next time
            self._metrics_url.pop(upstream, None)
        return None
