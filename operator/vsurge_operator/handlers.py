"""kopf handlers: fetch (kopf hands us the body), call the pure core via Reconciler/ModelAutoscaler, apply.

``register`` binds the handlers to a registry with a given configuration, because kopf reads timer
intervals at registration time. ``python -m vsurge_operator`` registers into its own registry;
``kopf run -m vsurge_operator.kopf_app`` registers into kopf's default one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import kopf
import urllib3

from vsurge_operator import apply, crd, kube, lane, manifests, metrics, reconcile, scaling, status, tracing
from vsurge_operator import spec as specmod
from vsurge_operator.config import OperatorConfig

logger = logging.getLogger(__name__)

RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)

# Kubernetes caps an Event message at 1 KiB of meaningful text.
_EVENT_MESSAGE_LIMIT = 1024


def post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:_EVENT_MESSAGE_LIMIT])


class _State:
    """Process-wide objects, created once the client is configured (in the startup handler)."""

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self._api: kube.Kube | None = None
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    @property
    def api(self) -> kube.Kube:
        if self._api is None:
            self._api = kube.Kube(timeout=self.config.api_timeout_seconds)
        return self._api

    def lock(self, uid: str) -> threading.Lock:
        # The timer and the event handlers of one model run in different threads; serialize them so two
        # passes never race to create the same object.
        with self._locks_guard:
            return self._locks.setdefault(uid, threading.Lock())

    def forget(self, uid: str) -> None:
        with self._locks_guard:
            self._locks.pop(uid, None)


def _retriable(exc: BaseException) -> bool:
    return kube.is_retriable(exc) or isinstance(exc, apply.OwnershipConflict | urllib3.exceptions.HTTPError)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Attach every handler of the operator to ``registry``."""
    state = _State(config)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        kube.load_config()
        tracing.configure()
        settings.posting.reporting_component = "vsurge-operator"
        settings.posting.event_name_prefix = "vsurge-"
        # Handler failures are retried by our own TemporaryError delays, not kopf's 60 s default.
        settings.execution.default_backoff = config.retry_delay_seconds
        settings.networking.error_backoffs = (0.5, 1, 2, 4, 8)
        # Several replicas, one active (kopf peering, when the chart's KopfPeering object exists).
        settings.peering.lifetime = config.peering_lifetime_seconds
        # A deletion that lands while the resync timer runs waits for the timer to exit before the finalizer
        # goes; kopf rechecks an exiting timer every 60 s by default, which held a deleted model that long.
        settings.background.cancellation_polling = 1.0
        if config.metrics_port:
            metrics.serve(config.metrics_port)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf and our REST layer share the kubernetes client's configuration: in-cluster service
        # account first, then the standard kubeconfig.
        return kopf.login_via_client(**kwargs)

    @kopf.on.cleanup(registry=registry)
    def cleanup(**_: Any) -> None:
        tracing.shutdown()

    def run_reconcile(body: Mapping[str, Any], trigger: str) -> None:
        uid = body.get("metadata", {}).get("uid", "")
        reconciler = reconcile.Reconciler(state.api, config, post_event)
        with state.lock(uid):
            started = time.monotonic()
            try:
                outcome = reconciler.reconcile(body, trigger=trigger)
                result = "invalid" if outcome.errors else "ok"
                metrics.observe_reconcile(trigger, result, time.monotonic() - started)
            except Exception as e:
                metrics.observe_reconcile(trigger, "error", time.monotonic() - started)
                reconciler.report_failure(body, e)
                message = reconcile.describe(e)
                if trigger == "timer":  # the next tick retries
                    logger.warning("resync of %s failed: %s", body["metadata"].get("name"), message)
                    return
                if _retriable(e):
                    raise kopf.TemporaryError(message, delay=config.retry_delay_seconds) from e
                # Not retried by kopf for this generation; the resync timer still tries again.
                raise kopf.PermanentError(message) from e
        # Nothing is returned: kopf would store a handler's result in the object's status.
        logger.debug("reconciled: %s", {a.kind: a.action for a in outcome.applied} or outcome.errors)

    def on_change(body: kopf.Body, **_: Any) -> None:
        run_reconcile(body, "event")

    for decorator in (kopf.on.resume, kopf.on.create, kopf.on.update):
        decorator(*RESOURCE, id="reconcile", registry=registry)(on_change)

    @kopf.timer(
        *RESOURCE,
        id="resync",
        interval=config.resync_seconds,
        initial_delay=config.resync_seconds,
        registry=registry,
    )
    def resync(body: kopf.Body, **_: Any) -> None:
        # Drift repair: a deleted or hand-edited workload, Service or PDB is put back; no write otherwise.
        run_reconcile(body, "timer")

    @kopf.on.event("v1", "pods", labels={manifests.LABEL_MANAGED_BY: manifests.MANAGER}, registry=registry)
    def pod_event(body: kopf.Body, **_: Any) -> None:
        # a multi-host group's failure, recorded before the LeaderWorkerSet recreates the pod (lane.py)
        try:
            recorded = lane.record_failure(state.api, body, status.now_rfc3339())
        except Exception as e:  # noqa: BLE001 - advisory: the resync still reads the pods
            logger.warning("could not record a group failure: %s", reconcile.describe(e))
            return
        if recorded:
            post_event(recorded[0], "Warning", lane.GROUP_FAILED, recorded[1])

    @kopf.on.delete(*RESOURCE, id="forget", optional=True, registry=registry)
    def forget(body: kopf.Body, **_: Any) -> None:
        # optional=True: this handler adds no finalizer of its own (kopf keeps one for the timer and the
        # daemon); owned objects are garbage-collected through their owner references.
        state.forget(body.get("metadata", {}).get("uid", ""))

    @kopf.daemon(*RESOURCE, id="autoscaler", cancellation_timeout=1.0, registry=registry)
    async def autoscaler(stopped: kopf.DaemonStopped, body: kopf.Body, **_: Any) -> None:
        # `body` is a live view: every iteration sees the latest spec and status.
        scaler = scaling.ModelAutoscaler(state.api, config, post_event)
        last_error = ""
        while not stopped:
            interval = config.autoscaler_idle_poll_seconds
            try:
                decision = await scaler.step(body)
                last_error = ""
                if decision is not None and decision.scaled:
                    meta = body.get("metadata", {})
                    direction = "up" if decision.replicas > decision.current else "down"
                    metrics.SCALE_EVENTS.labels(
                        meta.get("namespace", ""), meta.get("name", ""), direction
                    ).inc()
                if decision is not None:
                    interval = specmod.autoscaling_from(
                        body.get("spec", {}).get("autoscaling")
                    ).interval_seconds
            except Exception as e:
                metrics.AUTOSCALER_ERRORS.inc()
                message = f"autoscaler pass failed: {reconcile.describe(e)}"
                logger.warning("%s: %s", body.get("metadata", {}).get("name"), message)
                if message != last_error:  # one Event per distinct failure, not one per interval
                    post_event(body, "Warning", "AutoscalerError", message)
                    last_error = message
            await stopped.wait(interval)
