"""Make one object in the cluster match what we want: create it, patch it, or leave it alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from vsurge_operator import drift
from vsurge_operator.kube import Kube, Resource, resource_of

Action = Literal["created", "patched", "unchanged", "deleted"]


@dataclass(frozen=True)
class Applied:
    kind: str
    name: str
    action: Action
    live: dict[str, Any]


class OwnershipConflict(Exception):
    """An object with the model's name exists but belongs to someone else; we never take it over."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(f"{kind} {name!r} exists and is not controlled by this InferenceModel")
        self.kind = kind
        self.name = name


def controlled_by(obj: dict[str, Any], owner_uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == owner_uid and r.get("controller") for r in refs)


def ensure(kube: Kube, want: dict[str, Any], owner_uid: str) -> Applied:
    """Create or merge-patch ``want``; no request beyond the GET when nothing changed."""
    res = resource_of(want)
    meta = want["metadata"]
    want = drift.with_last_applied(want)
    live = kube.get(res, meta["namespace"], meta["name"])
    if live is None:
        created = kube.create(res, meta["namespace"], want)
        return Applied(want["kind"], meta["name"], "created", created)
    if not controlled_by(live, owner_uid):
        raise OwnershipConflict(want["kind"], meta["name"])
    patch = drift.plan(want, live)
    if patch is None:
        return Applied(want["kind"], meta["name"], "unchanged", live)
    patched = kube.patch(res, meta["namespace"], meta["name"], patch)
    return Applied(want["kind"], meta["name"], "patched", patched)


def remove_if_controlled(kube: Kube, res: Resource, namespace: str, name: str, owner_uid: str) -> bool:
    """Delete a leftover object of ours (e.g. the Deployment after a switch to a LeaderWorkerSet)."""
    live = kube.get(res, namespace, name)
    if live is None or not controlled_by(live, owner_uid):
        return False
    return kube.delete(res, namespace, name)
