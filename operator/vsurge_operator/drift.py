"""Pure comparison of what we want against what the API server has, and the merge patch that fixes it.

The API server adds defaults (``protocol: TCP``, ``imagePullPolicy``, ``clusterIP``...), so "unchanged"
means every field we set is present with the same value (a recursive subset), not equality. Fields we set
earlier but no longer want are remembered in an annotation and removed with ``null`` in a JSON merge
patch (RFC 7386) — the same three-way idea as ``kubectl apply``, without a PUT.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

LAST_APPLIED_ANNOTATION = "vsurge.io/last-applied"


def is_subset(want: Any, have: Any) -> bool:
    """True when every field of ``want`` is in ``have`` with an equal value.

    Lists must have the same length and match item by item (order matters for containers, env and
    ports), each item compared as a subset so that server defaults inside list items are tolerated.
    """
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            return False
        return all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        if not isinstance(have, list) or len(want) != len(have):
            return False
        return all(is_subset(w, h) for w, h in zip(want, have, strict=True))
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have
    return bool(want == have)


def merge_patch(want: Mapping[str, Any], last_applied: Mapping[str, Any] | None) -> dict[str, Any]:
    """A merge patch that sets everything in ``want`` and deletes keys we applied before but dropped."""
    last_applied = last_applied or {}
    patch: dict[str, Any] = {}
    for key, value in want.items():
        previous = last_applied.get(key)
        if isinstance(value, Mapping) and isinstance(previous, Mapping):
            patch[key] = merge_patch(value, previous)
        else:
            patch[key] = copy.deepcopy(value)
    for key in last_applied:
        if key not in want:
            patch[key] = None
    return patch


def _without_annotation(obj: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(obj))
    annotations = out.get("metadata", {}).get("annotations")
    if annotations:
        annotations.pop(LAST_APPLIED_ANNOTATION, None)
        if not annotations:
            del out["metadata"]["annotations"]
    return out


def with_last_applied(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object plus an annotation recording exactly what we applied (sorted JSON, stable)."""
    out = _without_annotation(obj)
    recorded = json.dumps(out, sort_keys=True, separators=(",", ":"))
    out.setdefault("metadata", {}).setdefault("annotations", {})[LAST_APPLIED_ANNOTATION] = recorded
    return out


def last_applied(live: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What we applied last time, from the live object's annotation (None if absent or unreadable)."""
    if not live:
        return None
    raw = (live.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED_ANNOTATION)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def plan(want: Mapping[str, Any], live: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The merge patch to send, or None when the live object already matches (no write needed).

    ``want`` must already carry the last-applied annotation (see :func:`with_last_applied`).
    """
    if live is None:
        raise ValueError("nothing to patch: the object does not exist")
    previous = last_applied(live)
    if is_subset(want, live) and not _removed_fields(want, previous, live):
        return None
    return merge_patch(want, previous)


def _removed_fields(want: Mapping[str, Any], previous: Mapping[str, Any] | None, live: Any) -> bool:
    """True when a key we applied before, and no longer want, is still present in the live object."""
    if not previous or not isinstance(live, Mapping):
        return False
    for key, value in previous.items():
        if key not in want:
            if key in live:
                return True
        elif (
            isinstance(value, Mapping)
            and isinstance(want[key], Mapping)
            and _removed_fields(want[key], value, live.get(key))
        ):
            return True
    return False
