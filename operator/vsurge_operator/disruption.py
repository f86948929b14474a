"""PodDisruptionBudgets: how many of a model's pods a voluntary eviction (a node drain) may take at once.

- One host per replica: ``<model>``, one pod at a time.
- Several hosts per replica (a LeaderWorkerSet group is one engine: evicting any of its pods restarts the
  whole group): ``<model>`` still allows one pod at a time over every group, and each group has its own
  ``<model>-group-<i>`` (selector ``leaderworkerset.sigs.k8s.io/group-index: "<i>"``), one pod. The
  eviction API books an eviction in the budget at once, so a drain cannot take one pod from each of
  several groups between two updates of the budget: the first eviction spends the model's budget, the
  group it hit restarts (its pods, unready, stay evictable: ``unhealthyPodEvictionPolicy: AlwaysAllow``),
  and no pod of another group goes until it is back. The group budgets follow the replica count; those of
  removed groups are deleted (``stale``).

Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vsurge_operator import labels
from vsurge_operator.spec import ModelSpec

GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
GROUP_BUDGET_LABEL = "vsurge.io/disruption-group"


def _budget(model: ModelSpec, name: str, selector: dict[str, str], extra: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": labels.owned_metadata(model, name, extra),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector},
            # A pod stuck loading (or a group restarting) must not block node drains.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def pod_disruption_budget(model: ModelSpec) -> dict[str, Any]:
    """The model's budget: one pod at a time, over all its pods."""
    return _budget(model, model.name, labels.selector_labels(model), {})


def group_name(model: ModelSpec, index: int) -> str:
    return f"{model.name}-group-{index}"


def group_budget(model: ModelSpec, index: int) -> dict[str, Any]:
    """One LeaderWorkerSet group's budget: one of its pods at a time."""
    selector = {**labels.selector_labels(model), GROUP_INDEX_LABEL: str(index)}
    return _budget(model, group_name(model, index), selector, {GROUP_BUDGET_LABEL: str(index)})


def budgets(model: ModelSpec) -> list[dict[str, Any]]:
    out = [pod_disruption_budget(model)]
    if model.multi_host:
        out += [group_budget(model, i) for i in range(model.desired_replicas())]
    return out


def stale(model: ModelSpec, live: Sequence[Mapping[str, Any]]) -> list[str]:
    """Names of the model's group budgets (among ``live``, the PDBs of its namespace labelled as its own)
    that no group needs any more: the groups were scaled away, or the model is single-host now."""
    wanted = {b["metadata"]["name"] for b in budgets(model)}
    out = []
    for pdb in live:
        meta = pdb.get("metadata") or {}
        refs = meta.get("ownerReferences") or []
        ours = any(r.get("uid") == model.uid and r.get("controller") for r in refs)
        if ours and GROUP_BUDGET_LABEL in (meta.get("labels") or {}) and meta.get("name") not in wanted:
            out.append(meta["name"])
    return sorted(out)
