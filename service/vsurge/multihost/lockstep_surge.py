"""The leader's vSurge over the lane, and what a failed group means for the server.

``leader_surge`` builds the driver config.driver names on a ``LeaderEngine`` (every engine call goes down
the lane first). ``LockstepSurge`` wraps the vSurge: once the lane fails, ``live`` turns False (readiness
and liveness answer 503) and every stream, new or in flight, ends with EngineUnavailableError, which the
server answers with 503 + Retry-After (a stream: an error event, then the end). ``exit_on_failure`` then
ends the process with status 1 (LeaderWorkerSet recreates the group), writing the reason to the pod's
termination message for the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..contracts.request import EngineUnavailableError, RequestFailedError
from . import channel as ch
from .engine_proxy import LeaderEngine, build_engine, engine_setup
from .lane_leader import LeaderLane
from .process_exit import GroupFailedError, exit_process


class LockstepSurge:
    """The leader's vSurge, unavailable (503) from the moment the lane fails."""

    def __init__(self, surge: Any, lane: LeaderLane):
        self._surge = surge
        self._lane = lane

    def __getattr__(self, name: str) -> Any:
        return getattr(self._surge, name)

    @property
    def live(self) -> bool:
        return self._lane.failure is None and self._surge.live

    def compile(self, progress: Callable[[str], None] | None = None) -> float:
        return self._surge.compile(progress)

    def stop(self) -> None:
        try:
            if self._lane.failure is None:
                self._surge.stop()
        finally:
            self._lane.close()

    def _unavailable(self) -> EngineUnavailableError:
        return GroupFailedError(f"the multi-host group failed ({self._lane.failure})")

    async def complete(self, request: Any):
        if self._lane.failure is not None:
            raise self._unavailable()
        loop = asyncio.get_running_loop()
        failed = asyncio.Event()
        forget = self._lane.on_failure(lambda _reason: loop.call_soon_threadsafe(failed.set))
        agen = self._surge.complete(request)
        waiter = asyncio.ensure_future(failed.wait())
        try:
            while True:
                step = asyncio.ensure_future(agen.__anext__())
                await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # the group failed while this request waited for tokens
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
                    raise self._unavailable()
                try:
                    item = step.result()
                except StopAsyncIteration:
                    return
                except (RequestFailedError, EngineUnavailableError):
                    # a device step failed because a peer went away: say so, not "request failed"
                    if await asyncio.to_thread(self._lane.wait_failed, 2.0):
                        raise self._unavailable() from None
                    raise
                yield item
        finally:
            forget()
            waiter.cancel()
            await agen.aclose()


def leader_surge(
    model: Any, processor: Any, config: Any, lane: LeaderLane, *, name: str | None = None
) -> LockstepSurge:
    """The leader's vSurge over a LeaderEngine; the workers get the engine's setup first."""
    from ..drivers.dense.vdriver import vDriver
    from ..surge import Surge

    engine = build_engine(model, processor, config)
    spec = config.mesh if isinstance(config.mesh, str) else None
    lane.send_control(ch.ENGINE, engine_setup(engine, config.replace(mesh=spec)))
    proxy = LeaderEngine(engine, lane)
    if config.driver == "odriver":
        from ..drivers.paged.odriver import oDriver

        driver = oDriver(
            proxy, detokenizing_blocks=config.detokenizing_blocks, max_queue_size=config.max_queue_size
        )
    else:
        driver = vDriver(
            proxy,
            proxy,
            interleaved_mode=config.interleaved_mode,
            detokenizing_blocks=config.detokenizing_blocks,
            max_queue_size=config.max_queue_size,
        )
    return LockstepSurge(Surge(driver, name), lane)


def exit_on_failure(
    lane: LeaderLane, api: Any, grace: float, exit: Callable[[int, str], Any] = exit_process
) -> None:
    """Once the lane fails: in-flight requests get their 503 at once, new ones too; ``grace`` seconds later
    the process exits with status 1 and the reason (even if a device call still waits for the dead peer)."""

    def stop(reason: str) -> None:
        def later() -> None:
            t0 = time.monotonic()
            lane.wait_gone(grace)  # the workers were told to abort: they go before the coordinator does
            time.sleep(max(0.0, grace - (time.monotonic() - t0)))  # the 503s reach their clients
            api.fatal = GroupFailedError(f"the multi-host group failed ({reason})")
            print("[vsurge] exiting: the multi-host group failed", file=sys.stderr, flush=True)
            exit(1, reason)

        threading.Thread(target=later, name="vsurge-lane-exit", daemon=True).start()

    lane.on_failure(stop)
