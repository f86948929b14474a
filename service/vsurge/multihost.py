"""`vsurge serve` in a multi-host group: the leader serves through the step lane, a worker only replays.

    run_serve ─ join_group ──► single process: as always
                          └──► leader (process 0): LeaderLane bound, model loaded (its shards), the
                                engine wrapped in a LeaderEngine, HTTP on --port
                          └──► worker: model loaded (its shards), connect to the lane, replay until the
                                leader says stop; never binds HTTP

See ``distributed.py`` (where the group comes from) and ``engines/lockstep.py`` (the lane, faults).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .distributed import ProcessGroup, check_mesh, join, resolve


def join_group(cfg: Any, env: Any = None) -> ProcessGroup | None:
    """Resolve this process's group from the serve options (or the LeaderWorkerSet's variables) and join
    it; None for a single process. Raises ValueError (bad settings) or RuntimeError (could not join)."""
    group = resolve(
        cfg.coordinator_address,
        cfg.num_processes,
        cfg.process_id,
        os.environ if env is None else env,
        join_timeout=cfg.join_timeout,
    )
    return None if group is None else join(group)


def _mesh(cfg: Any) -> Any:
    from .models.sharding import make_mesh

    mesh = make_mesh(cfg.mesh) if cfg.mesh else None
    check_mesh(mesh)
    return mesh


def holding(model: Any) -> str:
    """What this process holds of the model (it read only those shards from the checkpoint)."""
    from .models.loader import held_bytes

    local, total = held_bytes(model)
    return f"holds {local / 2**20:.3f} MiB of the model's {total / 2**20:.3f} MiB (its devices' shards)"


def run_worker(cfg: Any, group: ProcessGroup) -> int:
    """A worker's whole life: load the model's shards, connect to the leader, replay its engine calls."""
    from . import load_model
    from .engines.lockstep import Worker

    def say(msg: str) -> None:
        print(f"[vsurge worker {group.process_id}] {msg}", file=sys.stderr, flush=True)

    worker = None
    try:
        from .cli import _enable_compilation_cache

        _enable_compilation_cache()  # as the leader does: a restart skips most of the compile
        mesh = _mesh(cfg)
        say(f"loading {cfg.model} (mesh {dict(mesh.shape)})")
        extra = {"quantization": cfg.quantization} if hasattr(cfg, "quantization") else {}
        model, processor = load_model(cfg.model, dtype=cfg.dtype, mesh=mesh, **extra)
        say(holding(model))
        worker = Worker(group, model, processor, mesh)
        host, port = group.lane_address()
        say(f"connecting to the leader's step lane at {host}:{port}")
        worker.connect(cfg.join_timeout)
        return worker.run()
    except Exception as e:  # noqa: BLE001 - a worker's end is a message and a status, never a trace
        say(f"{type(e).__name__}: {e}; exiting")
        if worker is not None:
            worker.abort(f"{type(e).__name__}: {e}")
        sys.stderr.flush()
        os._exit(1)  # not through JAX's shutdown barrier: the leader is not coming to it


class Leader:
    """The leader's part in `vsurge serve`: the lane (bound before the model loads, so workers that
    finish loading first find it) and the surge built over it."""

    def __init__(self, group: ProcessGroup):
        from .engines.lockstep import LeaderLane

        self.group = group
        self.lane = LeaderLane(group)

    def mesh(self, cfg: Any) -> Any:
        return _mesh(cfg)

    def surge(self, cfg: Any, model: Any, processor: Any, mesh: Any, api: Any) -> Any:
        from .engines.lockstep import exit_on_failure, leader_surge

        print(f"[vsurge] {holding(model)}", file=sys.stderr, flush=True)
        self.lane.accept(cfg.join_timeout)
        exit_on_failure(self.lane, api)
        config = cfg.engine.replace(mesh=mesh)
        surge = leader_surge(model, processor, config, self.lane, name=cfg.model_name)
        return surge
