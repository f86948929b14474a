"""Pure computation of an InferenceModel's ``.status`` and its conditions.

Conditions follow the Kubernetes conventions: ``type``, ``status`` ("True"/"False"), a CamelCase
``reason``, a human ``message``, ``observedGeneration``, and ``lastTransitionTime`` that only moves
when ``status`` flips. ``status_patch`` returns only what changed, so an unchanged model causes no write.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from vsurge_operator import lane, manifests
from vsurge_operator.spec import ModelSpec

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED)


def now_rfc3339(now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.UTC)
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def merge_conditions(
    previous: Sequence[Mapping[str, Any]] | None, new: Sequence[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    """New conditions in a fixed order, keeping ``lastTransitionTime`` when the status did not flip,
    and keeping conditions of other types we did not compute this time."""
    old = {c.get("type"): c for c in previous or []}
    fresh = {c["type"]: dict(c) for c in new}
    for type_, cond in fresh.items():
        before = old.get(type_)
        if before and before.get("status") == cond["status"] and before.get("lastTransitionTime"):
            cond["lastTransitionTime"] = before["lastTransitionTime"]
        else:
            cond["lastTransitionTime"] = now
    merged = {**{t: dict(c) for t, c in old.items() if t is not None}, **fresh}
    order = list(CONDITION_TYPES) + sorted(t for t in merged if t not in CONDITION_TYPES)
    return [merged[t] for t in order if t in merged]


def workload_counts(workload: Mapping[str, Any] | None) -> tuple[int, int, int]:
    """(replicas, readyReplicas, updatedReplicas) from a Deployment's or LeaderWorkerSet's status."""
    ws = (workload or {}).get("status") or {}
    return (
        int(ws.get("replicas") or 0),
        int(ws.get("readyReplicas") or 0),
        int(ws.get("updatedReplicas") or 0),
    )


MODEL_SOURCE_ERROR = "ModelSourceError"
_SOURCE_ERROR_PREFIX = f"{MODEL_SOURCE_ERROR}: "


def source_error(pods: Sequence[Mapping[str, Any]] | None) -> str | None:
    """The message of a model-source failure reported by a pod that is not ready, else None.

    ``vsurge serve`` exits non-zero when its model cannot be fetched or read and writes
    ``ModelSourceError: <source>: <cause>`` to its termination log; the kubelet publishes it as the
    container's ``state.terminated.message`` (or ``lastState`` once it restarts, in CrashLoopBackOff).
    """
    for pod in sorted(pods or [], key=lambda p: (p.get("metadata") or {}).get("name", "")):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if cs.get("ready"):
                continue  # it recovered; an old lastState is history
            for state in (cs.get("state") or {}, cs.get("lastState") or {}):
                message = str((state.get("terminated") or {}).get("message") or "").strip()
                if message.startswith(_SOURCE_ERROR_PREFIX):
                    name = (pod.get("metadata") or {}).get("name", "")
                    return f"pod {name}: {message[len(_SOURCE_ERROR_PREFIX) :]}"[:1024]
    return None


def reconciled(
    model: ModelSpec,
    workload: Mapping[str, Any] | None,
    previous: Mapping[str, Any] | None,
    now: str,
    pods: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Status after a successful reconcile: counts from the workload, the endpoint, and conditions
    (Degraded/ModelSourceError when one of ``pods`` could not load its model)."""
    previous = previous or {}
    desired = model.desired_replicas()
    replicas, ready, updated = workload_counts(workload)
    gen = model.generation
    kind = "LeaderWorkerSet" if model.multi_host else "Deployment"

    if desired == 0:
        ready_cond = condition(
            READY, False, "ScaledToZero", "0 replicas requested; a request wakes the model", gen
        )
    elif ready > 0:
        ready_cond = condition(READY, True, "Serving", f"{ready}/{desired} replicas ready", gen)
    else:
        ready_cond = condition(READY, False, "NoReplicasReady", f"0/{desired} replicas ready", gen)

    if ready < desired or updated < desired:
        progressing = condition(
            PROGRESSING, True, "RollingOut", f"{ready} ready, {updated} updated of {desired} desired", gen
        )
    elif replicas > desired:
        progressing = condition(
            PROGRESSING, True, "ScalingDown", f"{replicas} replicas, {desired} desired", gen
        )
    else:
        progressing = condition(PROGRESSING, False, "Stable", f"{kind} has {desired} ready replicas", gen)

    bad_source = source_error(pods)
    group_failed = lane.group_failure(pods) if model.multi_host else None
    if bad_source:
        degraded = condition(DEGRADED, True, MODEL_SOURCE_ERROR, bad_source, gen)
    elif group_failed and ready < desired:
        degraded = condition(DEGRADED, True, lane.GROUP_FAILED, group_failed, gen)
    else:
        degraded = condition(DEGRADED, False, "AsExpected", "", gen)
    out = {
        "observedGeneration": gen,
        "replicas": replicas,
        "readyReplicas": ready,
        "desiredReplicas": desired,
        "selector": manifests.selector_string(model),
        "endpoint": manifests.endpoint(model),
        "workloadKind": kind,
        "conditions": merge_conditions(previous.get("conditions"), [ready_cond, progressing, degraded], now),
    }
    if group_failed:  # kept once seen: LeaderWorkerSet recreates the group, and the pod's message with it
        out["lastGroupFailure"] = {"message": group_failed, "observedAt": now}
        if (previous.get("lastGroupFailure") or {}).get("message") == group_failed:
            out["lastGroupFailure"] = previous["lastGroupFailure"]
    return out


def failed(
    previous: Mapping[str, Any] | None, generation: int, reason: str, message: str, now: str, *, invalid: bool
) -> dict[str, Any]:
    """Status when reconciling failed. An invalid spec also makes the model not Ready (nothing was
    created for it); an API error only marks Degraded and leaves the serving conditions as they were."""
    previous = previous or {}
    new = [condition(DEGRADED, True, reason, message, generation)]
    if invalid:
        new += [
            condition(READY, previous.get("readyReplicas", 0) > 0, reason, message, generation),
            condition(PROGRESSING, False, reason, message, generation),
        ]
    out: dict[str, Any] = {"conditions": merge_conditions(previous.get("conditions"), new, now)}
    if invalid:
        out["observedGeneration"] = generation
    return out


def status_patch(previous: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any] | None:
    """The keys of ``new`` whose values differ from ``previous``; None when there is nothing to write."""
    previous = previous or {}
    patch = {k: v for k, v in new.items() if previous.get(k) != v}
    return patch or None
