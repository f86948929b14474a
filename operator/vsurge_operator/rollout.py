"""How model pods are replaced and stopped: rollout strategies and the drain.

A pod being removed (scale-down, rollout, node drain) goes through three steps:

1. **preStop** sends SIGUSR1 to the server (PID 1 of the container): its readiness turns 503 while it
   keeps serving, and the hook waits ``PRESTOP_SECONDS`` so that endpoints, kube-proxy and the router
   stop sending before anything is refused;
2. the kubelet's **SIGTERM** starts the drain: new generations get 503, those in flight run on for up to
   ``VSURGE_DRAIN_TIMEOUT`` = ``spec.drainSeconds``;
3. the grace period (preStop + drain + ``DRAIN_MARGIN_SECONDS`` for the engines to stop) ends in SIGKILL
   only if the drain overran.
"""

from __future__ import annotations

from typing import Any

from vsurge_operator.spec import ModelSpec

PRESTOP_SECONDS = 5
DRAIN_MARGIN_SECONDS = 15
# The hook runs in the server's container, whose images all carry Python (a shell may be missing).
PRESTOP_COMMAND = [
    "python",
    "-c",
    f"import os, signal, time; os.kill(1, signal.SIGUSR1); time.sleep({PRESTOP_SECONDS})",
]


def termination_grace_seconds(model: ModelSpec) -> int:
    return PRESTOP_SECONDS + model.drain_seconds + DRAIN_MARGIN_SECONDS


def lifecycle() -> dict[str, Any]:
    """The container's lifecycle hooks (only pods that answer HTTP get them)."""
    return {"preStop": {"exec": {"command": list(PRESTOP_COMMAND)}}}


def deployment_strategy(model: ModelSpec) -> dict[str, Any]:
    """``surge`` new pods above the replica count, ``maxUnavailable`` old ones below it.

    The default (1, 0) never drops below the serving capacity but needs one spare slice; ``surge: 0``
    replaces pods in place, ``maxUnavailable`` at a time, so a rollout fits a full node pool at the cost
    of that much capacity while it runs."""
    r = model.rollout
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": r.surge, "maxUnavailable": r.max_unavailable},
    }


def lws_rollout_strategy(model: ModelSpec) -> dict[str, Any]:
    """The same for a LeaderWorkerSet, counted in groups (one group is one replica: a whole slice)."""
    r = model.rollout
    return {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxSurge": r.surge, "maxUnavailable": r.max_unavailable},
    }
