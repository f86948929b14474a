"""One autoscaler pass for one model: find its pods, scrape them, decide, scale, report.

The decision history (recent recommendations and scale events, like the HPA controller's) is kept in
the model's ``status.autoscaler.history`` as well as in memory, with wall-clock times: when another
operator replica takes over (kopf peering), it reads the history back and makes the same decisions
(the same stabilization windows and rate limits) instead of starting blind. A model with no history at
all starts with :func:`~vsurge_operator.autoscaler.decide`'s cautious default (no scale-down before a
full scale-down window).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from vsurge_operator import adapters, kube, manifests, scraper, status, tracing, validation
from vsurge_operator import spec as specmod
from vsurge_operator.autoscaler import (
    Decision,
    History,
    Policy,
    decide,
    history_from_status,
    history_to_status,
    merge,
    without_last_event,
)
from vsurge_operator.config import OperatorConfig
from vsurge_operator.reconcile import EventSink

logger = logging.getLogger(__name__)

OCCUPANCY_SERIES = specmod.PROMETHEUS_SERIES[specmod.METRIC_SLOT_OCCUPANCY]
QUEUE_SERIES = specmod.PROMETHEUS_SERIES[specmod.METRIC_PREFILL_QUEUE]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class ModelAutoscaler:
    """Autoscaler state of one InferenceModel; call :meth:`step` every ``intervalSeconds``."""

    def __init__(self, api: kube.Kube, config: OperatorConfig, events: EventSink) -> None:
        self.api = api
        self.config = config
        self.events = events
        self.history = History()
        self._adapters_read_at: float | None = None

    def reset(self) -> None:
        self.history = History()

    async def step(self, body: Mapping[str, Any], now: float | None = None) -> Decision | None:
        """Returns the decision, or None when the model is not autoscaled or its spec is invalid.

        ``now`` is Unix time (the history in the status must mean the same to every replica)."""
        now = time.time() if now is None else now
        if validation.validate(body, default_image=self.config.model_images()):
            return None  # the reconciler reports invalid specs
        model = specmod.parse(body, default_image=self.config.model_images())
        generation = (body.get("metadata") or {}).get("generation")
        if not model.autoscaling.enabled:
            self.reset()
            # no scaling; still read once per spec generation what the pods' engines run (status.engine)
            if ((body.get("status") or {}).get("engine") or {}).get("generation") != generation:
                await self._read_engine(body, model, generation)
            await self._read_adapters(body, model)
            return None
        pods = await asyncio.to_thread(
            self.api.list, kube.POD, model.namespace, manifests.selector_string(model)
        )
        await self._read_adapters(body, model, pods)
        targets = scraper.scrape_targets(
            pods, manifests.selector_labels(model), leaders_only=model.multi_host
        )
        results = await scraper.scrape(
            targets,
            [OCCUPANCY_SERIES, QUEUE_SERIES],
            model=model.served_name,
            timeout=self.config.scrape_timeout_seconds,
        )
        # What an earlier leader (or this process, before the last status write came back) remembered.
        stored = ((body.get("status") or {}).get("autoscaler") or {}).get("history")
        self.history = merge(self.history, history_from_status(stored))
        series = specmod.PROMETHEUS_SERIES[model.autoscaling.metric]
        samples = [r.sample(series) for r in results]
        policy = Policy.from_spec(model.autoscaling)
        current = model.desired_replicas()

        with tracing.span(
            "vsurge.autoscale",
            {
                "k8s.namespace.name": model.namespace,
                "vsurge.model": model.name,
                "vsurge.autoscale.metric": policy.metric,
                "vsurge.autoscale.target": policy.target,
                "vsurge.autoscale.pods": len(samples),
                "vsurge.autoscale.current_replicas": current,
            },
        ) as span:
            decision = decide(current=current, samples=samples, policy=policy, history=self.history, now=now)
            span.set_attribute("vsurge.autoscale.desired_replicas", decision.replicas)
            span.set_attribute("vsurge.autoscale.recommended_replicas", decision.recommended)
            span.set_attribute("vsurge.autoscale.reason", decision.reason)
            if decision.value is not None:
                span.set_attribute("vsurge.autoscale.value", decision.value)
            if decision.scaled:
                try:
                    # Through the scale subresource, like any HPA: the reconciler carries spec.replicas
                    # to the workload on the update event that follows.
                    await asyncio.to_thread(
                        self.api.patch,
                        kube.INFERENCE_MODEL,
                        model.namespace,
                        model.name,
                        {"spec": {"replicas": decision.replicas}},
                        "scale",
                    )
                except Exception:
                    self.history = without_last_event(decision.history)
                    raise
                verb = "ScaledUp" if decision.replicas > current else "ScaledDown"
                self.events(
                    body,
                    "Normal",
                    verb,
                    f"{current} -> {decision.replicas} replicas ({decision.reason}): {decision.message}",
                )
            self.history = decision.history

        await asyncio.to_thread(self._write_status, body, decision, results, policy)
        return decision

    async def _read_engine(self, body: Mapping[str, Any], model: Any, generation: Any) -> None:
        pods = await asyncio.to_thread(
            self.api.list, kube.POD, model.namespace, manifests.selector_string(model)
        )
        targets = scraper.scrape_targets(
            pods, manifests.selector_labels(model), leaders_only=model.multi_host
        )
        results = await scraper.scrape(
            targets, [], model=model.served_name, timeout=self.config.scrape_timeout_seconds
        )
        engine = scraper.engine_status(results)
        if engine is not None:
            await asyncio.to_thread(self._write_engine, body, {**engine, "generation": generation})

    async def _read_adapters(
        self, body: Mapping[str, Any], model: Any, pods: list[Any] | None = None, now: float | None = None
    ) -> None:
        """status.adapters from the ready pods' /v1/models, for a model with spec.adapters (or that had
        them: the list empties when they are removed), every config.adapter_status_seconds at most (a pod
        list and one GET /v1/models per ready pod)."""
        previous = (body.get("status") or {}).get("adapters")
        if not model.adapters and not previous:
            return
        now = time.monotonic() if now is None else now
        if (
            self._adapters_read_at is not None
            and now - self._adapters_read_at < self.config.adapter_status_seconds
        ):
            return
        self._adapters_read_at = now
        if pods is None:
            pods = await asyncio.to_thread(
                self.api.list, kube.POD, model.namespace, manifests.selector_string(model)
            )
        by_name = {(p.get("metadata") or {}).get("name"): p for p in pods}
        targets = scraper.scrape_targets(
            pods, manifests.selector_labels(model), leaders_only=model.multi_host
        )
        urls = [
            adapters.models_url(t.url, adapters.http_port(by_name.get(t.pod) or {}, specmod.HTTP_PORT))
            for t in targets
            if t.ready and t.url
        ]
        listings = await adapters.read_pods(urls, timeout=self.config.scrape_timeout_seconds)
        entries = adapters.status_entries(model.adapters, listings)
        if entries != previous:
            await asyncio.to_thread(self._patch_status, body, {"adapters": entries})

    def _patch_status(self, body: Mapping[str, Any], patch: dict[str, Any]) -> None:
        namespace, name = body["metadata"].get("namespace", "default"), body["metadata"]["name"]
        try:
            self.api.patch(kube.INFERENCE_MODEL, namespace, name, {"status": patch}, subresource="status")
        except ApiException as e:
            if e.status != 404:
                raise

    def _write_engine(self, body: Mapping[str, Any], engine: dict[str, Any] | None) -> None:
        previous = body.get("status") or {}
        if engine is None or engine == previous.get("engine"):
            return
        namespace, name = body["metadata"].get("namespace", "default"), body["metadata"]["name"]
        try:
            self.api.patch(
                kube.INFERENCE_MODEL, namespace, name, {"status": {"engine": engine}}, subresource="status"
            )
        except ApiException as e:
            if e.status != 404:
                raise

    def _write_status(
        self, body: Mapping[str, Any], decision: Decision, results: list[scraper.PodMetrics], policy: Policy
    ) -> None:
        previous = body.get("status") or {}
        block: dict[str, Any] = {
            "metric": policy.metric,
            "target": policy.target,
            "currentValue": _round(decision.value),
            "recommendedReplicas": decision.recommended,
            "desiredReplicas": decision.replicas,
            "reason": decision.reason,
            "message": decision.message,
            "history": history_to_status(decision.history),
        }
        old_block = previous.get("autoscaler") or {}
        if decision.scaled:
            block["lastScaleTime"] = status.now_rfc3339()
        elif old_block.get("lastScaleTime"):
            block["lastScaleTime"] = old_block["lastScaleTime"]
        new = {
            "engine": (
                {**e, "generation": (body.get("metadata") or {}).get("generation")}
                if (e := scraper.engine_status(results))
                else previous.get("engine")
            ),
            "occupancy": _round(scraper.mean_over_ready(results, OCCUPANCY_SERIES)),
            "prefillQueue": _round(scraper.mean_over_ready(results, QUEUE_SERIES)),
            "autoscaler": block,
        }
        patch = status.status_patch(previous, new)
        if patch is None:
            return
        namespace, name = body["metadata"].get("namespace", "default"), body["metadata"]["name"]
        try:
            self.api.patch(kube.INFERENCE_MODEL, namespace, name, {"status": patch}, subresource="status")
        except ApiException as e:
            if e.status != 404:
                raise
