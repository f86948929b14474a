"""Scale from zero: wake a model that has no ready replica and hold its requests until one is ready.

A request for a model without ready upstreams asks `Waker.upstreams_for`. If the model is an
InferenceModel whose replicas are 0, the router patches its scale subresource to 1 (one patch for all
the requests that arrive meanwhile); if it already wants replicas (it is starting), nothing is patched.
Either way the request waits for the table to change (discovery sees `status.readyReplicas` go up) and
gets the upstreams, or gives up after the timeout (the app answers 503 with Retry-After). A model known
only from the static file cannot be woken: it fails at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from .metrics import RouterMetrics
from .table import EndpointTable, ModelView, WakeTarget

log = logging.getLogger(__name__)

Scaler = Callable[[WakeTarget, int], Awaitable[None]]


class UnknownModel(LookupError):
    pass


class WakeError(Exception):
    """The model has no ready upstream and will not get one in time; the message says why."""

    code = "model_unavailable"


class NotServable(WakeError):
    code = "no_upstreams"


class WakeTimeout(WakeError):
    code = "model_wake_timeout"


class WakeFailed(WakeError):
    code = "model_wake_failed"


def wake_target(view: ModelView) -> WakeTarget | None:
    """The InferenceModel to scale to one replica, or None when there is nothing to patch.

    Nothing when the model has ready upstreams, when none of its backends is scalable, or when one of
    them already wants replicas (it is starting: patching could only lower a higher count).
    """
    if view.upstreams:
        return None
    scalable = [b for b in view.backends if b.wake is not None]
    if not scalable or any(b.desired_replicas != 0 for b in scalable):
        return None
    return scalable[0].wake


def can_become_ready(view: ModelView) -> bool:
    """Whether waiting can help: only InferenceModels get replicas by themselves (or by a patch)."""
    return any(b.wake is not None for b in view.backends)


def describe(exc: BaseException | None) -> str:
    """A one-line reason: the client's ApiException text carries headers and the whole body."""
    status = getattr(exc, "status", None)
    if status is not None:
        return f"Kubernetes API answered {status} {getattr(exc, 'reason', '') or ''}".strip()
    return f"{type(exc).__name__}: {exc}"


def _consume(task: asyncio.Task[None]) -> None:
    # Read the outcome so that asyncio does not log "exception never retrieved" when no request waits.
    if not task.cancelled():
        task.exception()


class Waker:
    def __init__(
        self,
        table: EndpointTable,
        scaler: Scaler | None,
        timeout_s: float,
        metrics: RouterMetrics | None = None,
        *,
        repatch_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.scaler = scaler
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.repatch_after_s = repatch_after_s
        self.clock = clock
        self._patches: dict[WakeTarget, tuple[asyncio.Task[None], float]] = {}

    async def upstreams_for(self, model: str) -> tuple[str, ...]:
        """The model's ready upstreams, waking it and waiting if there are none.

        Raises UnknownModel, NotServable (static model without upstreams, or no Kubernetes access),
        WakeFailed (the scale patch was refused) or WakeTimeout.
        """
        view = self.table.lookup(model)
        if view is None:
            raise UnknownModel(model)
        if view.upstreams:
            return view.upstreams
        if self.scaler is None or not can_become_ready(view):
            raise NotServable(f"The model `{model}` has no upstream to serve it.")
        deadline = self.clock() + self.timeout_s
        joined: asyncio.Task[None] | None = None
        log.info("model %s has no ready replica: holding the request", model)
        while True:
            changed = self.table.changed_event()  # taken before reading, so no change goes unseen
            view = self.table.lookup(model)
            if view is None:
                raise UnknownModel(model)
            if view.upstreams:
                self._count(model, "ready")
                return view.upstreams
            target = wake_target(view)
            if target is not None and joined is None:
                joined = self._patch(target, model)
            if joined is not None and joined.done() and not joined.cancelled() and joined.exception():
                self._count(model, "error")
                raise WakeFailed(f"Could not scale up the model `{model}`: {describe(joined.exception())}")
            remaining = deadline - self.clock()
            if remaining <= 0:
                self._count(model, "timeout")
                raise WakeTimeout(
                    f"The model `{model}` has no ready replica after {self.timeout_s:g}s; try again later."
                )
            waiter = asyncio.ensure_future(changed.wait())
            pending: set[asyncio.Future[object]] = {waiter}
            if joined is not None and not joined.done():
                pending.add(joined)  # type: ignore[arg-type]
            try:
                # Capped so that a clock-driven deadline is noticed even if nothing changes.
                await asyncio.wait(pending, timeout=min(remaining, 1.0), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()

    def _patch(self, target: WakeTarget, model: str) -> asyncio.Task[None]:
        """One patch per target: join the one in flight, or one that succeeded recently."""
        existing = self._patches.get(target)
        if existing is not None:
            task, started = existing
            if not task.done():
                return task
            if (
                not task.cancelled()
                and task.exception() is None
                and self.clock() - started < self.repatch_after_s
            ):
                return task
        task = asyncio.create_task(self._do_patch(target, model), name=f"vsurge-router-wake-{target}")
        task.add_done_callback(_consume)
        self._patches[target] = (task, self.clock())
        return task

    async def _do_patch(self, target: WakeTarget, model: str) -> None:
        assert self.scaler is not None
        try:
            await self.scaler(target, 1)
        except Exception as e:
            log.warning("waking %s: scaling InferenceModel %s to 1 failed: %s", model, target, describe(e))
            if self.metrics is not None:
                self.metrics.scale_patches.labels(model, "error").inc()
            raise
        log.info("waking %s: scaled InferenceModel %s to 1 replica", model, target)
        if self.metrics is not None:
            self.metrics.scale_patches.labels(model, "ok").inc()

    def _count(self, model: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.wakeups.labels(model, outcome).inc()
