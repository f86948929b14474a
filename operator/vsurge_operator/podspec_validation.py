"""Validation of the pod-level fields of an InferenceModel: scheduling, pod template metadata, pull
secrets, drain, rollout and the compile cache.

Called by :func:`vsurge_operator.validation.validate` with its checker (anything with ``fail``,
``mapping``, ``string`` and ``integer``), so the errors land in the same list. Patterns and ranges here are
kept equal to the CRD's by tests, as the rest of validation's are.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

from vsurge_operator import tpu

DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A label or annotation key: an optional DNS subdomain prefix and a name of up to 63 characters.
QUALIFIED_NAME = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
WHEN_UNSATISFIABLE = ("DoNotSchedule", "ScheduleAnyway")
ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod")
# Labels the operator's selectors and the LeaderWorkerSet controller rely on: a pod template may not set them.
RESERVED_LABELS = ("app.kubernetes.io/name", "vsurge.io/model")
RESERVED_LABEL_PREFIXES = ("leaderworkerset.sigs.k8s.io/",)

RANGES: dict[str, tuple[int, int]] = {
    "spec.drainSeconds": (0, 86400),
    "spec.rollout.surge": (0, 100),
    "spec.rollout.maxUnavailable": (0, 100),
    "spec.scheduling.topologySpreadConstraints[].maxSkew": (1, 1000),
}


class Checker(Protocol):
    def fail(self, path: str, message: str) -> None: ...
    def mapping(self, value: Any, path: str) -> Mapping[str, Any]: ...
    def string(
        self, value: Any, path: str, pattern: str | None = None, choices: tuple[str, ...] = ()
    ) -> None: ...
    def integer(self, value: Any, path: str, range_key: str | None = None) -> None: ...


def _int_in(c: Checker, value: Any, path: str, key: str | None = None) -> None:
    c.integer(value, path, "-")  # type check only ("-" names no range of the main checker)
    if isinstance(value, int) and not isinstance(value, bool):
        lo, hi = RANGES[key or path]
        if not lo <= value <= hi:
            c.fail(path, f"must be between {lo} and {hi} (got {value})")


def validate(c: Checker, spec: Mapping[str, Any], placement: tpu.TpuPlacement | None) -> None:
    """Every check of the fields this module owns; absent fields pass."""
    _scheduling(c, c.mapping(spec.get("scheduling"), "spec.scheduling"), placement)
    _pod_template(c, c.mapping(spec.get("podTemplate"), "spec.podTemplate"))
    _pull_secrets(c, spec.get("imagePullSecrets"))
    if spec.get("drainSeconds") is not None:
        _int_in(c, spec["drainSeconds"], "spec.drainSeconds")
    _rollout(c, c.mapping(spec.get("rollout"), "spec.rollout"))
    _compile_cache(c, spec.get("compileCache"))


def tolerations(c: Checker, value: Any, path: str) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        c.fail(path, "must be a list of objects")
        return
    for i, t in enumerate(value):
        c.string(t.get("operator"), f"{path}[{i}].operator", choices=TOLERATION_OPERATORS)
        c.string(t.get("effect"), f"{path}[{i}].effect", choices=TAINT_EFFECTS)
        c.string(t.get("key"), f"{path}[{i}].key")
        c.string(t.get("value"), f"{path}[{i}].value")
        c.integer(t.get("tolerationSeconds"), f"{path}[{i}].tolerationSeconds")


def _scheduling(c: Checker, s: Mapping[str, Any], placement: tpu.TpuPlacement | None) -> None:
    for key, value in c.mapping(s.get("nodeSelector"), "spec.scheduling.nodeSelector").items():
        path = f"spec.scheduling.nodeSelector.{key}"
        if not isinstance(value, str):
            c.fail(path, "must be a string")
        elif placement is not None and placement.node_selector().get(key, value) != value:
            c.fail(path, f"conflicts with spec.tpu ({placement.node_selector()[key]!r})")
    tolerations(c, s.get("tolerations"), "spec.scheduling.tolerations")
    c.mapping(s.get("affinity"), "spec.scheduling.affinity")
    c.string(s.get("priorityClassName"), "spec.scheduling.priorityClassName", DNS1123_SUBDOMAIN)
    spread = s.get("topologySpreadConstraints")
    if spread is None:
        return
    if not isinstance(spread, list) or not all(isinstance(t, Mapping) for t in spread):
        c.fail("spec.scheduling.topologySpreadConstraints", "must be a list of objects")
        return
    for i, t in enumerate(spread):
        path = f"spec.scheduling.topologySpreadConstraints[{i}]"
        for required in ("maxSkew", "topologyKey", "whenUnsatisfiable"):
            if t.get(required) is None:
                c.fail(f"{path}.{required}", "is required")
        if t.get("maxSkew") is not None:
            _int_in(c, t["maxSkew"], f"{path}.maxSkew", "spec.scheduling.topologySpreadConstraints[].maxSkew")
        c.string(t.get("topologyKey"), f"{path}.topologyKey")
        c.string(t.get("whenUnsatisfiable"), f"{path}.whenUnsatisfiable", choices=WHEN_UNSATISFIABLE)


def _pod_template(c: Checker, template: Mapping[str, Any]) -> None:
    meta = c.mapping(template.get("metadata"), "spec.podTemplate.metadata")
    for kind in ("labels", "annotations"):
        for key, value in c.mapping(meta.get(kind), f"spec.podTemplate.metadata.{kind}").items():
            path = f"spec.podTemplate.metadata.{kind}.{key}"
            if not re.fullmatch(QUALIFIED_NAME, key):
                c.fail(path, f"{key!r} is not a valid {kind[:-1]} key")
            elif not isinstance(value, str):
                c.fail(path, "must be a string")
            elif kind == "labels" and not re.fullmatch(LABEL_VALUE, value):
                c.fail(path, f"{value!r} is not a valid label value")
            if kind == "labels" and (key in RESERVED_LABELS or key.startswith(RESERVED_LABEL_PREFIXES)):
                c.fail(path, "is set by the operator (it selects the model's pods)")


def _pull_secrets(c: Checker, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(s, Mapping) for s in value):
        c.fail("spec.imagePullSecrets", "must be a list of objects ({name: ...})")
        return
    for i, s in enumerate(value):
        if s.get("name") is None:
            c.fail(f"spec.imagePullSecrets[{i}].name", "is required")
        c.string(s.get("name"), f"spec.imagePullSecrets[{i}].name", DNS1123_SUBDOMAIN)


def _rollout(c: Checker, r: Mapping[str, Any]) -> None:
    for key in ("surge", "maxUnavailable"):
        if r.get(key) is not None:
            _int_in(c, r[key], f"spec.rollout.{key}")
    # Both 0 could never make progress (Kubernetes refuses such a Deployment): one must give room.
    if r.get("surge", 1) == 0 and r.get("maxUnavailable", 0) == 0:
        c.fail(
            "spec.rollout", "surge and maxUnavailable cannot both be 0 (set maxUnavailable: 1 with surge: 0)"
        )


def _compile_cache(c: Checker, raw: Any) -> None:
    if raw is None:
        return
    cc = c.mapping(raw, "spec.compileCache")
    c.string(cc.get("claimName"), "spec.compileCache.claimName", DNS1123_SUBDOMAIN)
    c.string(cc.get("storageClassName"), "spec.compileCache.storageClassName", DNS1123_SUBDOMAIN)
    c.string(cc.get("accessMode"), "spec.compileCache.accessMode", choices=ACCESS_MODES)
    size = cc.get("size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int | str)):
        c.fail("spec.compileCache.size", "must be a quantity (a string, or an integer)")
    elif isinstance(size, str) and not re.fullmatch(QUANTITY_PATTERN, size):
        c.fail("spec.compileCache.size", f"{size!r} is not a Kubernetes quantity")
    has_claim, has_size = cc.get("claimName") is not None, size is not None
    if has_claim == has_size:
        c.fail(
            "spec.compileCache",
            "set claimName (an existing claim) or size (a claim the operator creates), exactly one",
        )
    elif has_claim and (cc.get("storageClassName") is not None or cc.get("accessMode") is not None):
        c.fail("spec.compileCache", "storageClassName and accessMode apply only to a claim of the given size")
