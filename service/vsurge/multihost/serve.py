"""`vsurge serve` in a multi-host group: the leader serves through the step lane, a worker only replays.

    run_serve ─ start_group ─► single process: as always
                           └─► every process: the lane secret read (none: refused), the JAX group joined
                           └─► leader (process 0): the lane bound and admitting workers at once; the model
                                loaded (its shards); every worker connected, then loaded; the engine's
                                setup sent; the engine wrapped in a LeaderEngine; HTTP on --port
                           └─► worker: connect to the lane first (backoff, --join-timeout), then load its
                                shards while beating, build the engine, replay until the leader says stop

A start-up error anywhere ends the whole group: a worker's goes to the leader (ERROR), the leader's to every
worker (ABORT), each process prints it and exits 1 at once (``process_exit``), never waiting in JAX's
shutdown barrier. See ``lane_leader.py`` (bounds), ``channel.py`` (authentication), ``wire.py`` (format).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .channel import SecretError, read_secret
from .group import ProcessGroup, check_mesh, join, lane_timeout, resolve
from .process_exit import exit_process

EXIT_GRACE_S = 2.0  # at most: after a failure, in-flight requests get their 503 before the leader exits


@dataclass(frozen=True)
class GroupStart:
    """A joined group and what its lane needs: the secret, the failure bound, the start timeout."""

    group: ProcessGroup
    secret: bytes
    timeout: float
    start_timeout: float


def start_group(cfg: Any, env: Mapping[str, str] | None = None) -> GroupStart | None:
    """Resolve this process's group from the serve options (or the LeaderWorkerSet's variables), check
    its lane settings and join it; None for a single process. Raises ValueError (bad or missing settings:
    nothing was joined) or RuntimeError (could not join)."""
    env = os.environ if env is None else env
    group = resolve(
        cfg.coordinator_address, cfg.num_processes, cfg.process_id, env, join_timeout=cfg.join_timeout
    )
    if group is None:
        return None
    try:
        secret = read_secret(env)
    except SecretError as e:
        raise ValueError(str(e)) from None
    timeout = lane_timeout(env)
    refuse_unsupported(cfg)
    return GroupStart(join(group, timeout), secret, timeout, cfg.start_timeout)


def refuse_unsupported(cfg: Any) -> None:
    """Engine features a multi-host group cannot run in lockstep are refused at start, by name. Every
    feature of both drivers crosses the lane today (mixed steps, in-place prefill, speculative decoding,
    structured output, int8, LoRA adapters), so this only checks what a group needs of its mesh."""
    if not cfg.engine.mesh:
        raise ValueError("a multi-host group needs --mesh / VSURGE_MESH covering every device of the group")


def _mesh(cfg: Any) -> Any:
    from ..models.sharding import make_mesh

    mesh = make_mesh(cfg.engine.mesh) if cfg.engine.mesh else None
    check_mesh(mesh)
    return mesh


def holding(model: Any) -> str:
    """What this process holds of the model (it read only those shards from the checkpoint)."""
    from ..models.loader import held_bytes

    local, total = held_bytes(model)
    return f"holds {local / 2**20:.3f} MiB of the model's {total / 2**20:.3f} MiB (its devices' shards)"


def run_worker(cfg: Any, start: GroupStart) -> None:
    """A worker's whole life: connect to the leader's lane, load the model's shards, replay its engine
    calls; ends the process (0: the leader stopped, 1: an error here or there, 3: the leader is gone)."""
    from ..models.compiled.compilation_cache import enable_compilation_cache
    from ..models.loader import load_model
    from .lane_worker import WorkerLane

    group = start.group
    lane = WorkerLane(group, start.secret, start.timeout, start_timeout=start.start_timeout)
    _defer_sigterm(lane)
    host, port = group.lane_address()
    lane.say(f"connecting to the leader's step lane at {host}:{port}")
    try:
        lane.connect(cfg.join_timeout)
    except Exception as e:  # noqa: BLE001 - a worker's end is a message and a status, never a trace
        lane.say(f"{e}; exiting")
        exit_process(1, str(e))
    try:
        enable_compilation_cache()  # as the leader does: a restart skips most of the compile
        mesh = _mesh(cfg)
        lane.say(f"loading {cfg.model} (mesh {dict(mesh.shape)})")
        model, processor = load_model(
            cfg.model, dtype=cfg.dtype, mesh=mesh, quantization=cfg.engine.quantization
        )
        lane.say(holding(model))
        lane.loaded(mesh)
        code = lane.run(model, processor)
    except Exception as e:  # noqa: BLE001
        lane.abort(f"{type(e).__name__}: {e}", e)
        code = 1
    exit_process(code)


def _defer_sigterm(lane: Any) -> None:
    """A worker outlives a SIGTERM: its group's pods are stopped together, and the leader drains its
    requests first, then tells the workers to stop (a worker gone early would fail them all). A worker
    stopped alone is killed at the end of its grace period, and the group fails then."""
    import signal

    def note(signum: int, frame: Any) -> None:
        lane.say(f"{signal.Signals(signum).name}: waiting for the leader to stop the group (it drains first)")

    signal.signal(signal.SIGTERM, note)


class Leader:
    """The leader's part in `vsurge serve`: the lane (bound and admitting workers before the model loads,
    so they connect and beat while everyone loads) and the surge built over it."""

    def __init__(self, start: GroupStart):
        from .lane_leader import LeaderLane

        self.start = start
        self.lane = LeaderLane(start.group, start.secret, start.timeout)
        self.lane.start()

    def mesh(self, cfg: Any) -> Any:
        return _mesh(cfg)

    def surge(self, cfg: Any, model: Any, processor: Any, mesh: Any, api: Any) -> Any:
        from .lockstep_surge import exit_on_failure, leader_surge

        lane = self.lane
        print(f"[vsurge] {holding(model)}", file=sys.stderr, flush=True)
        exit_on_failure(lane, api, min(EXIT_GRACE_S, 0.2 * self.start.timeout))
        lane.wait_workers("connected", cfg.join_timeout, "connect to the step lane")
        lane.wait_workers("loaded", self.start.start_timeout, "load the model")
        config = cfg.engine.replace(mesh=mesh)
        return leader_surge(model, processor, config, lane, name=cfg.model_name)

    def finish(self, code: int, error: BaseException | None = None) -> None:
        """The server is done: a start-up error ends every worker with it; then this process exits
        (never returns) without JAX's shutdown barrier. The termination message is the group's failure,
        or (written by the caller) this process's own error."""
        failure = self.lane.failure
        if error is not None:
            reason = failure or f"the leader failed to start: {type(error).__name__}: {error}"
            self.lane.abort(reason, min(self.start.group.join_timeout, self.start.timeout))
        self.lane.close()
        exit_process(code, failure)
