"""Lifecycle and drain of the server: which models it serves, readiness, draining, stopping the engines."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from . import errors
from .logprob_shapes import TokenDecoder
from .served_model import ServedModel, _vocab_size, public_root

log = logging.getLogger(__name__)

STARTING, READY, DRAINING, STOPPED = "starting", "ready", "draining", "stopped"


class Lifecycle:
    """Models, readiness and drain: the server's state machine (starting -> ready -> draining -> stopped).

    A mixin of vSurgeApiServer; expects `models`, `metrics`, `state`, `state_reason`, `in_flight`,
    `drain_started_at`, `drain_timeout_s`, `fatal` and `owns_engines` set by its __init__.
    """

    def add_model(
        self, name: str, surge: Any, *, load_seconds: float | None = None, root: str | None = None
    ) -> ServedModel:
        """Serve `surge` as `name`; it answers requests once the server is ready. `root`: where the weights
        came from (a path or hub id), shown as the model card's `root`."""
        if name in self.models:
            raise ValueError(f"a model named {name!r} is already served")
        entry = ServedModel(
            name=name,
            surge=surge,
            processor=surge.processor,
            max_length=int(surge.max_length),
            vocab_size=_vocab_size(surge),
            decode=TokenDecoder(surge.processor),
            load_seconds=load_seconds,
            root=public_root(root),
        )
        self.models[name] = entry
        self.metrics.add_model(name, surge)
        if load_seconds is not None:
            self.metrics.load_seconds.labels(name, "total").set(load_seconds)
        return entry

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile every shape of every model (blocking), start the engines, then report ready; a model
        already running (compiled and started by the caller) is left as it is."""
        say = progress or (lambda msg: None)
        for name, entry in list(self.models.items()):
            if entry.surge.live:  # compiled and started by the caller (the seed's compile(); start(); fire())
                say(f"{name} is already running")
                seconds = getattr(entry.surge, "compile_seconds", None)
            else:
                say(f"compiling {name}")
                t0 = time.perf_counter()
                entry.surge.compile(progress)
                seconds = time.perf_counter() - t0
                say(f"compiled {name} in {seconds:.1f}s")
                entry.surge.start()
            if seconds is not None:
                self.metrics.compile_seconds.labels(name).set(seconds)
                self.metrics.load_seconds.labels(name, "compile").set(seconds)
            if hasattr(entry.surge, "pooler"):  # /v1/embeddings' programs, so no request compiles one
                t0 = time.perf_counter()
                try:
                    entry.surge.pooler().compile()
                    say(f"compiled {name}'s pooling programs in {time.perf_counter() - t0:.1f}s")
                except Exception as e:  # noqa: BLE001 - generation is served anyway; /v1/embeddings says why not
                    log.warning("no embeddings for %s: %s", name, e)
        self.mark_ready()

    def mark_ready(self) -> None:
        """For engines compiled and started by the caller: open for traffic."""
        if self.state == STARTING:
            self.state, self.state_reason = READY, ""

    # Set by a pod's preStop hook (SIGUSR1, see runner.serve): readiness answers 503 so the pod leaves its
    # Service's endpoints, while requests that still arrive meanwhile are served as usual.
    stop_announced: str = ""

    def announce_stop(self, reason: str = "the pod is stopping (preStop)") -> None:
        """Readiness goes false; generations are still accepted until the drain begins (SIGTERM)."""
        if not self.stop_announced:
            log.info("stop announced: %s; readiness now fails, still serving", reason)
            self.stop_announced = reason

    def begin_drain(self, reason: str = "the server is shutting down") -> None:
        """Readiness goes false and new generations get 503; requests in flight run to the end."""
        if self.state in (DRAINING, STOPPED):
            return
        log.info("draining: %d request(s) in flight", self.in_flight)
        self.state, self.state_reason = DRAINING, reason
        self.drain_started_at = time.monotonic()

    def drain_complete(self) -> bool:
        """True once a drain has no request left in flight (or its timeout passed)."""
        if self.fatal is not None:
            return True
        if self.state != DRAINING or self.drain_started_at is None:
            return False
        if self.in_flight == 0:
            return True
        return time.monotonic() - self.drain_started_at > self.drain_timeout_s

    def stop_engines(self) -> None:
        self.state = STOPPED
        if not self.owns_engines:
            return
        for entry in self.models.values():
            try:
                entry.surge.stop()
            except Exception:
                log.exception("stopping %s failed", entry.name)

    def _check_ready(self) -> None:
        if self.state != READY:
            raise errors.not_ready(self.state_reason or self.state)

    def _dead_engines(self) -> list[str]:
        if self.state != READY:
            return []
        out = []
        for name, entry in self.models.items():
            live = getattr(entry.surge, "live", True)
            if not live:
                out.append(name)
        return out
