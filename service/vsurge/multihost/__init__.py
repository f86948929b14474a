"""Multi-host slices: one engine over the processes of a group, in lockstep over an authenticated step lane.

Above the drivers: it imports engines, drivers and surge; nothing below imports it; the command line calls
it (``start_group``, ``run_worker``, ``Leader``) and it never calls back into the command line.

    group.py          where the group comes from (options, LeaderWorkerSet, TPU), joining it
    cpu_programs.py   CPU groups: programs run to their end, first runs meet at a barrier
    wire.py           the lane's value format: explicit, versioned, decoded without running code
    channel.py        one connection: HMAC challenge-response on connect, then MAC'd, sequenced frames
    handles.py        device arrays named across the lane (result leaf i of call n)
    engine_proxy.py   the leader's engine behind the lane: what is sent, what is local, what is refused
    lane_leader.py    the leader's end: admitting workers, sending calls, deciding the group failed
    lane_worker.py    a worker's end: connect, beat, replay
    lockstep_surge.py the leader's vSurge over the lane; 503s and the exit once the group fails
    process_exit.py   ending a process of the group (never through JAX's shutdown barrier)
    serve.py          `vsurge serve`'s multi-host start: leader and worker
"""

from __future__ import annotations

from typing import Any

__all__ = ["Leader", "run_worker", "start_group"]


def __getattr__(name: str) -> Any:
    # `vsurge serve` reaches these through the package; importing it stays free of jax until then
    if name in __all__:
        from . import serve

        return getattr(serve, name)
    raise AttributeError(name)
