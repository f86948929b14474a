"""Validation of an InferenceModel body, returning errors that name the offending field.

The CRD schema rejects most bad input at the API server, but not everything: cross-field rules (a
topology the accelerator does not offer, a mesh that does not cover the slice, prefill buckets longer
than ``maxLength``) and objects stored before the schema tightened. The operator re-checks everything
here so that a bad spec sets ``Degraded`` with a clear message instead of creating half a deployment.
Patterns are shared with the CRD (a test keeps them equal).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vsurge_operator import adapters, engine_options, gpu, podspec_validation, tpu
from vsurge_operator import spec as specmod

# Keep in sync with helm/vsurge/crds/inferencemodels.vsurge.io.yaml (tests compare them).
SOURCE_PATTERN = (
    r"^(default|hf://[^\s]+|gs://[^\s]+|s3://[^\s]+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?|/[^\s]*)$"
)
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
TOPOLOGY_PATTERN = r"^[1-9][0-9]*x[1-9][0-9]*(x[1-9][0-9]*)?$"
MESH_AXES = ("dp", "tp")  # the engine's mesh axes (vsurge.models.sharding.AXES; a test compares them)
_AXIS = "|".join(MESH_AXES)
MESH_PATTERN = rf"^({_AXIS})=[1-9][0-9]*(,({_AXIS})=[1-9][0-9]*)*$"
TRACING_ENDPOINT_PATTERN = r"^(https?|grpc)://[^\s]+$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MESH_MAX_LENGTH = 64  # the CRD's maxLength (it bounds the cost of the mesh's CEL rule)
PREFILL_LENGTHS_MAX_ITEMS = 32  # the CRD's maxItems (it bounds the cost of the buckets' CEL rule)
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"

GPU_TYPE_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"  # a label value (<= 63 characters)
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")

# Ranges shared with the CRD schema: (minimum, maximum); spec.engine's are in engine_options.OPTIONS.
RANGES: dict[str, tuple[float, float]] = {
    "spec.replicas": (0, 1000),
    "spec.autoscaling.minReplicas": (0, 1000),
    "spec.autoscaling.maxReplicas": (1, 1000),
    "spec.autoscaling.tolerance": (0, 0.5),
    "spec.autoscaling.intervalSeconds": (1, 3600),
    "spec.autoscaling.scaleUpStabilizationSeconds": (0, 3600),
    "spec.autoscaling.scaleDownStabilizationSeconds": (0, 3600),
    "spec.autoscaling.scaleUpPercent": (1, 1000),
    "spec.autoscaling.scaleUpPods": (1, 1000),
    "spec.autoscaling.scaleDownPercent": (1, 100),
    "spec.autoscaling.policyPeriodSeconds": (1, 1800),
    "spec.tracing.samplingRatio": (0, 1),
    "spec.gpu.count": (1, gpu.MAX_GPUS),
}


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def format_errors(errors: list[FieldError]) -> str:
    return "; ".join(str(e) for e in errors)


class _Checker:
    """Collects errors while walking the body; each check is a no-op when the value is absent."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def mapping(self, value: Any, path: str) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.fail(path, "must be an object")
            return {}
        return value

    def string(
        self, value: Any, path: str, pattern: str | None = None, choices: tuple[str, ...] = ()
    ) -> None:
        if value is None:
            return
        if not isinstance(value, str):
            self.fail(path, "must be a string")
        elif choices and value not in choices:
            self.fail(path, f"must be one of {', '.join(choices)} (got {value!r})")
        # fullmatch: Go's regexp (the API server's) has no "$ before a trailing newline" as re.match has.
        elif pattern and not re.fullmatch(pattern, value):
            self.fail(path, f"{value!r} does not match {pattern}")

    def integer(
        self, value: Any, path: str, range_key: str | None = None, bounds: tuple[Any, Any] | None = None
    ) -> bool:
        """Whether ``value`` is an integer in range (None: nothing to check, False)."""
        if value is None:
            return False
        # bool is an int in Python but never a valid replica count or length.
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, "must be an integer")
            return False
        return self._range(value, path, range_key or path, bounds)

    def number(
        self, value: Any, path: str, range_key: str | None = None, exclusive_min: bool = False
    ) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.fail(path, "must be a number")
            return
        if exclusive_min and value <= 0:
            self.fail(path, f"must be > 0 (got {value})")
            return
        self._range(value, path, range_key or path)

    def _range(self, value: float, path: str, range_key: str, bounds: tuple[Any, Any] | None = None) -> bool:
        lo, hi = bounds or RANGES.get(range_key, (None, None))
        if lo is not None and hi is not None and not lo <= value <= hi:
            self.fail(path, f"must be between {lo:g} and {hi:g} (got {value})")
        elif lo is not None and value < lo:
            self.fail(path, f"must be >= {lo:g} (got {value})")
        elif hi is not None and value > hi:
            self.fail(path, f"must be <= {hi:g} (got {value})")
        else:
            return True
        return False


def validate(
    body: Mapping[str, Any], *, default_image: str | Mapping[str, str | None] | None = None
) -> list[FieldError]:
    """All problems of an InferenceModel body, in field order; empty when it can be reconciled."""
    c = _Checker()
    meta = c.mapping(body.get("metadata"), "metadata")
    name = meta.get("name")
    # The Service is named after the model, and Service names are DNS-1035 labels.
    if not isinstance(name, str) or not re.fullmatch(DNS1035_LABEL, name) or len(name) > 63:
        c.fail(
            "metadata.name", f"{name!r} must be a DNS-1035 label (a-z, 0-9, '-', start with a letter, <= 63)"
        )

    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        c.fail("spec", "is required and must be an object")
        return c.errors

    model = spec.get("model")
    if not isinstance(model, Mapping):
        c.fail("spec.model", "is required and must be an object")
    else:
        if model.get("source") is None:
            c.fail("spec.model.source", "is required")
        c.string(model.get("source"), "spec.model.source", SOURCE_PATTERN)
        c.string(model.get("servedName"), "spec.model.servedName", SERVED_NAME_PATTERN)
        c.string(model.get("credentialsSecret"), "spec.model.credentialsSecret", DNS1123_SUBDOMAIN)

    c.string(spec.get("image"), "spec.image")
    if spec.get("image") == "":
        c.fail("spec.image", "must not be empty (omit it to use the operator's default image)")
    elif not specmod.pick_image(spec, default_image):
        c.fail(
            "spec.image",
            f"is required (the operator has no default image for {specmod.accelerator_of(spec)} models)",
        )
    c.string(spec.get("imagePullPolicy"), "spec.imagePullPolicy", choices=PULL_POLICIES)
    c.integer(spec.get("replicas"), "spec.replicas")

    _validate_engine(c, c.mapping(spec.get("engine"), "spec.engine"))
    served = (model.get("servedName") or name) if isinstance(model, Mapping) else name
    adapters.validate(c, spec, served)
    placement = _validate_tpu(c, spec.get("tpu"))
    gpus = _validate_gpu(c, spec.get("gpu"))
    if spec.get("tpu") is not None and spec.get("gpu") is not None:
        c.fail("spec.gpu", "set spec.tpu or spec.gpu, not both")
    _validate_mesh(c, spec, placement, gpus)
    _validate_autoscaling(c, c.mapping(spec.get("autoscaling"), "spec.autoscaling"))
    _validate_tracing(c, spec.get("tracing"))
    _validate_pod_overrides(c, spec, placement)
    podspec_validation.validate(c, spec, placement)
    return c.errors


def _validate_engine(c: _Checker, engine: Mapping[str, Any]) -> None:
    # each option as engine_options.OPTIONS says (generated from EngineConfig, as the CRD is)
    driver = engine.get("driver") or engine_options.DEFAULT_DRIVER
    for o in engine_options.OPTIONS:
        value, path = engine.get(o.key), f"spec.engine.{o.key}"
        if value is None:
            continue
        if o.kind == "integers":
            _integers(c, value, path, o)
        elif o.kind == "integer":
            if c.integer(value, path, bounds=(o.minimum, o.maximum)) and o.choices and value not in o.choices:
                c.fail(path, f"must be one of {', '.join(map(str, o.choices))} (got {value})")
        elif o.kind == "number":
            _number(c, value, path, o)
        else:
            c.string(value, path, choices=o.choices)
        if o.only and value not in o.idle and driver != o.only:
            c.fail(path, f"{o.key} applies to driver {o.only}'s {o.what}")
    # Kubernetes' own rules (the CRD's too: tools/docgen/engine_crd.py writes them from these constants)
    mesh = engine.get("mesh")
    if isinstance(mesh, str):
        c.string(mesh, "spec.engine.mesh", MESH_PATTERN)
        if len(mesh) > MESH_MAX_LENGTH:
            c.fail("spec.engine.mesh", f"must be at most {MESH_MAX_LENGTH} characters")
    lengths = engine.get("prefillLengths")
    ints = [n for n in lengths if _is_int(n)] if isinstance(lengths, list) else []
    if ints and len(ints) == len(lengths):
        if len(ints) > PREFILL_LENGTHS_MAX_ITEMS:
            c.fail("spec.engine.prefillLengths", f"must have at most {PREFILL_LENGTHS_MAX_ITEMS} buckets")
        if any(b <= a for a, b in zip(ints, ints[1:], strict=False)):
            c.fail("spec.engine.prefillLengths", f"must be strictly increasing (got {ints})")
        max_length = engine.get("maxLength")
        if _is_int(max_length) and ints[-1] > max_length:
            c.fail(
                "spec.engine.prefillLengths",
                f"longest bucket {ints[-1]} exceeds spec.engine.maxLength {max_length}",
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integers(c: _Checker, value: Any, path: str, o: engine_options.EngineOption) -> None:
    if not isinstance(value, list) or not value:
        c.fail(path, "must be a non-empty list of integers")
        return
    for i, n in enumerate(value):
        c.integer(n, f"{path}[{i}]", bounds=(o.minimum, o.maximum))


def _number(c: _Checker, value: Any, path: str, o: engine_options.EngineOption) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        c.fail(path, "must be a number")
    elif o.minimum is not None and o.exclusive_minimum and value <= o.minimum:
        c.fail(path, f"must be > {o.minimum:g} (got {value})")
    elif o.minimum is not None and value < o.minimum:
        c.fail(path, f"must be >= {o.minimum:g} (got {value})")
    elif o.maximum is not None and value > o.maximum:
        c.fail(path, f"must be <= {o.maximum:g} (got {value})")


def _validate_tpu(c: _Checker, raw: Any) -> tpu.TpuPlacement | None:
    if raw is None:
        return None
    t = c.mapping(raw, "spec.tpu")
    if not t:
        return None
    ok = True
    for key in ("accelerator", "topology"):
        if not isinstance(t.get(key), str):
            c.fail(f"spec.tpu.{key}", "is required and must be a string")
            ok = False
    if not ok:
        return None
    if not re.fullmatch(TOPOLOGY_PATTERN, t["topology"]):
        c.fail("spec.tpu.topology", f"{t['topology']!r} does not match {TOPOLOGY_PATTERN}")
        return None
    try:
        return tpu.placement(t["accelerator"], t["topology"])
    except tpu.PlacementError as e:
        c.fail(e.field, e.message)
        return None


def _validate_gpu(c: _Checker, raw: Any) -> gpu.GpuPlacement | None:
    if raw is None:
        return None
    g = c.mapping(raw, "spec.gpu")
    n_errors = len(c.errors)
    if isinstance(raw, Mapping) and g.get("count") is None:
        c.fail("spec.gpu.count", "is required")
    c.integer(g.get("count"), "spec.gpu.count")
    c.string(g.get("type"), "spec.gpu.type", GPU_TYPE_PATTERN)
    if isinstance(g.get("type"), str) and len(g["type"]) > 63:
        c.fail("spec.gpu.type", "must be at most 63 characters (a node label value)")
    if len(c.errors) > n_errors or not isinstance(raw, Mapping):
        return None
    return gpu.placement(dict(g))


def _mesh_devices(mesh: str) -> int:
    return math.prod(int(part.split("=", 1)[1]) for part in mesh.split(","))


def _validate_mesh(
    c: _Checker,
    spec: Mapping[str, Any],
    placement: tpu.TpuPlacement | None,
    gpus: gpu.GpuPlacement | None = None,
) -> None:
    engine = spec.get("engine")
    mesh = engine.get("mesh") if isinstance(engine, Mapping) else None
    if not isinstance(mesh, str) or not re.fullmatch(MESH_PATTERN, mesh):
        return
    axes = [part.split("=", 1)[0] for part in mesh.split(",")]
    if len(set(axes)) != len(axes):
        c.fail("spec.engine.mesh", f"{mesh!r} repeats an axis")
    if placement is not None and _mesh_devices(mesh) != placement.chips:
        c.fail(
            "spec.engine.mesh",
            f"{mesh!r} spans {_mesh_devices(mesh)} devices but {placement.accelerator} {placement.topology} "
            f"has {placement.chips} chips",
        )
    if gpus is not None and _mesh_devices(mesh) != gpus.count:
        c.fail(
            "spec.engine.mesh",
            f"{mesh!r} spans {_mesh_devices(mesh)} devices but spec.gpu.count is {gpus.count}",
        )


def _validate_autoscaling(c: _Checker, a: Mapping[str, Any]) -> None:
    if not a:
        return
    p = "spec.autoscaling"
    enabled = a.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        c.fail(f"{p}.enabled", "must be a boolean")
    for key in (
        "minReplicas",
        "maxReplicas",
        "intervalSeconds",
        "scaleUpStabilizationSeconds",
        "scaleDownStabilizationSeconds",
        "scaleUpPercent",
        "scaleUpPods",
        "scaleDownPercent",
        "policyPeriodSeconds",
    ):
        c.integer(a.get(key), f"{p}.{key}")
    c.string(a.get("metric"), f"{p}.metric", choices=specmod.METRICS)
    c.number(a.get("target"), f"{p}.target", exclusive_min=True)
    c.number(a.get("tolerance"), f"{p}.tolerance")
    defaults = specmod.AutoscalingSpec()
    lo = a.get("minReplicas", defaults.min_replicas)
    hi = a.get("maxReplicas", defaults.max_replicas)
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        c.fail(f"{p}.maxReplicas", f"must be >= minReplicas ({hi} < {lo})")
    metric = a.get("metric", defaults.metric)
    target = a.get("target")
    if metric == specmod.METRIC_SLOT_OCCUPANCY and isinstance(target, int | float) and target > 1:
        c.fail(f"{p}.target", f"slotOccupancy is a fraction; target must be <= 1 (got {target})")


def _validate_tracing(c: _Checker, raw: Any) -> None:
    if raw is None:
        return
    t = c.mapping(raw, "spec.tracing")
    if not t.get("endpoint"):
        c.fail("spec.tracing.endpoint", "is required when spec.tracing is set")
    c.string(t.get("endpoint"), "spec.tracing.endpoint", TRACING_ENDPOINT_PATTERN)
    c.number(t.get("samplingRatio"), "spec.tracing.samplingRatio")
    c.string(t.get("serviceName"), "spec.tracing.serviceName")


def _validate_pod_overrides(c: _Checker, spec: Mapping[str, Any], placement: tpu.TpuPlacement | None) -> None:
    resources = c.mapping(spec.get("resources"), "spec.resources")
    for kind in ("requests", "limits"):
        amounts = c.mapping(resources.get(kind), f"spec.resources.{kind}")
        for key, value in amounts.items():
            path = f"spec.resources.{kind}.{key}"
            # int-or-string, as the API server checks it: 1.5 must be written "1.5" (or 1500m).
            if isinstance(value, bool) or not isinstance(value, int | str):
                c.fail(path, "must be a quantity (a string, or an integer)")
            elif isinstance(value, str) and not re.fullmatch(QUANTITY_PATTERN, value):
                c.fail(path, f"{value!r} is not a Kubernetes quantity")
            elif (
                key == tpu.TPU_RESOURCE
                and placement is not None
                and str(value) != str(placement.chips_per_host)
            ):
                c.fail(path, f"must be {placement.chips_per_host} (chips per host of the slice) or omitted")

    env = spec.get("env")
    if env is not None:
        if not isinstance(env, list):
            c.fail("spec.env", "must be a list")
        else:
            seen: set[str] = set()
            for i, item in enumerate(env):
                if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
                    c.fail(f"spec.env[{i}]", "must be an object with a string name")
                    continue
                c.string(item["name"], f"spec.env[{i}].name", ENV_NAME_PATTERN)
                # A list keyed by name (x-kubernetes-list-type: map): the API server refuses duplicates.
                if item["name"] in seen:
                    c.fail(f"spec.env[{i}].name", f"duplicate name {item['name']!r}")
                seen.add(item["name"])
                c.string(item.get("value"), f"spec.env[{i}].value")
                if item.get("valueFrom") is not None and not isinstance(item["valueFrom"], Mapping):
                    c.fail(f"spec.env[{i}].valueFrom", "must be an object")

    selector = c.mapping(spec.get("nodeSelector"), "spec.nodeSelector")
    for key, value in selector.items():
        if not isinstance(value, str):
            c.fail(f"spec.nodeSelector.{key}", "must be a string")
        elif (
            placement is not None
            and key in placement.node_selector()
            and placement.node_selector()[key] != value
        ):
            c.fail(
                f"spec.nodeSelector.{key}", f"conflicts with spec.tpu ({placement.node_selector()[key]!r})"
            )

    tolerations = spec.get("tolerations")
    if tolerations is not None:
        if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
            c.fail("spec.tolerations", "must be a list of objects")
        else:
            for i, t in enumerate(tolerations):
                c.string(t.get("operator"), f"spec.tolerations[{i}].operator", choices=TOLERATION_OPERATORS)
                c.string(t.get("effect"), f"spec.tolerations[{i}].effect", choices=TAINT_EFFECTS)
                c.string(t.get("key"), f"spec.tolerations[{i}].key")
                c.string(t.get("value"), f"spec.tolerations[{i}].value")
                c.integer(t.get("tolerationSeconds"), f"spec.tolerations[{i}].tolerationSeconds")
    c.string(spec.get("serviceAccountName"), "spec.serviceAccountName", DNS1123_SUBDOMAIN)
    cache = c.mapping(spec.get("cache"), "spec.cache")
    limit = cache.get("sizeLimit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | str)):
        c.fail("spec.cache.sizeLimit", "must be a quantity (a string, or an integer)")
    elif isinstance(limit, str) and not re.fullmatch(QUANTITY_PATTERN, limit):
        c.fail("spec.cache.sizeLimit", f"{limit!r} is not a Kubernetes quantity")
    c.string(cache.get("claimName"), "spec.cache.claimName", DNS1123_SUBDOMAIN)
    if limit is not None and cache.get("claimName") is not None:
        c.fail("spec.cache", "set cache.sizeLimit (an emptyDir) or cache.claimName (a PVC), not both")
