"""Typed view of an InferenceModel with the operator's defaults applied.

``parse`` assumes the body already passed :func:`vsurge_operator.validation.validate`; it never
raises on a valid body and never looks at the cluster. Defaults here must match the ``default:``
values in the CRD schema (a test checks that), because a real API server applies the CRD's defaults
while the operator must also cope with objects stored before a default existed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from vsurge_operator import adapters as adaptersmod
from vsurge_operator import engine_options, gpu, tpu

HTTP_PORT = 11556
METRICS_PORT = 11557

METRIC_SLOT_OCCUPANCY = "slotOccupancy"
METRIC_PREFILL_QUEUE = "prefillQueueSize"
METRICS = (METRIC_SLOT_OCCUPANCY, METRIC_PREFILL_QUEUE)

# Prometheus series served by `vsurge serve` on its metrics port, per autoscaling metric.
PROMETHEUS_SERIES = {
    METRIC_SLOT_OCCUPANCY: "vsurge_slot_occupancy",
    METRIC_PREFILL_QUEUE: "vsurge_prefill_queue_size",
}


# spec.engine: one attribute per key of engine_options.OPTIONS (generated from vsurge's EngineConfig), named
# as EngineConfig's field; None means "not set": the server's own default applies. Built from the table so
# that a new serve knob needs no edit here.
EngineSpec = make_dataclass(
    "EngineSpec",
    [(o.field, Any, field(default=None)) for o in engine_options.OPTIONS],
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": "spec.engine's options by EngineConfig field name; None: not set (the server's default).",
    },
)


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    metric: str = METRIC_SLOT_OCCUPANCY
    target: float = 0.7
    tolerance: float = 0.1
    interval_seconds: int = 15
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    scale_up_percent: int = 100
    scale_up_pods: int = 4
    scale_down_percent: int = 100
    policy_period_seconds: int = 15


@dataclass(frozen=True)
class TracingSpec:
    endpoint: str
    sampling_ratio: float = 0.1
    service_name: str | None = None


DEFAULT_DRAIN_SECONDS = 120
DEFAULT_SURGE = 1
DEFAULT_MAX_UNAVAILABLE = 0
ACCELERATORS = ("tpu", "gpu", "cpu")


@dataclass(frozen=True)
class RolloutSpec:
    """spec.rollout: pods added above, and taken below, the replica count during a rollout.

    ``surge: 0`` replaces pods in place (``maxUnavailable`` of them at a time) for a node pool with no
    spare slice; the default (1, 0) never drops below the serving capacity but needs room for one more."""

    surge: int = DEFAULT_SURGE
    max_unavailable: int = DEFAULT_MAX_UNAVAILABLE


@dataclass(frozen=True)
class CompileCacheSpec:
    """spec.compileCache: a PersistentVolumeClaim for the JAX compile cache (``$VSURGE_CACHE_DIR/jax``).

    ``claim_name`` names an existing claim; otherwise the operator creates ``<model>-compile-cache``
    of ``size`` (ReadWriteMany by default, so every replica reads what the first one compiled)."""

    claim_name: str | None = None
    size: str | None = None
    storage_class_name: str | None = None
    access_mode: str | None = None  # None: the operator's default (OperatorConfig.compile_cache_access_mode)


@dataclass(frozen=True)
class GatewaySpec:
    """spec.gateway: the model's InferencePool; None fields take the operator's defaults (gateway.py)."""

    inference_pool: bool | None = None
    picker_name: str | None = None
    picker_port: int | None = None
    failure_mode: str | None = None


@dataclass(frozen=True)
class ApiKeySecret:
    """spec.apiKeySecret: the Secret key the pods require as a bearer key (VSURGE_API_KEY)."""

    name: str
    key: str = "api-key"


@dataclass(frozen=True)
class SchedulingSpec:
    """spec.scheduling: where the pods may run, merged with what the accelerator needs."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """Everything the manifest builders need, with defaults resolved."""

    name: str
    namespace: str
    uid: str
    generation: int
    source: str
    served_name: str
    image: str
    engine: EngineSpec = field(default_factory=EngineSpec)
    placement: tpu.TpuPlacement | None = None
    gpu: gpu.GpuPlacement | None = None  # spec.gpu (never together with spec.tpu)
    replicas: int | None = None
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    tracing: TracingSpec | None = None
    image_pull_policy: str | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    env: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    service_account_name: str | None = None
    credentials_secret: str | None = None  # spec.model.credentialsSecret
    cache_size_limit: str | None = None  # spec.cache.sizeLimit (emptyDir)
    cache_claim: str | None = None  # spec.cache.claimName (PVC)
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec)
    pod_labels: Mapping[str, str] = field(default_factory=dict)  # spec.podTemplate.metadata.labels
    pod_annotations: Mapping[str, str] = field(default_factory=dict)
    image_pull_secrets: tuple[str, ...] = ()
    drain_seconds: int = DEFAULT_DRAIN_SECONDS
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    compile_cache: CompileCacheSpec | None = None
    adapters: tuple[adaptersmod.AdapterSpec, ...] = ()  # spec.adapters (LoRA)
    gateway: GatewaySpec = field(default_factory=GatewaySpec)
    api_key_secret: ApiKeySecret | None = None
    admin_key_secret: ApiKeySecret | None = None  # spec.adminKeySecret (key default admin-key)

    @property
    def accelerator(self) -> str:
        """tpu, gpu or cpu: picks the default image (the chart's images.model.<accelerator>)."""
        return "tpu" if self.placement is not None else "gpu" if self.gpu is not None else "cpu"

    @property
    def multi_host(self) -> bool:
        return self.placement is not None and self.placement.multi_host

    def desired_replicas(self) -> int:
        """Replicas the workload should run now.

        ``spec.replicas`` is the source of truth (the scale subresource writes it, by hand, by an
        external HPA/KEDA, by the router waking a model, or by our autoscaler). When it is unset the
        model starts at ``minReplicas`` if autoscaled, else 1. The autoscaler's min/max clamp is its
        own business; a replica count set by hand is never overwritten here.
        """
        if self.replicas is not None:
            return self.replicas
        return self.autoscaling.min_replicas if self.autoscaling.enabled else 1


_AUTOSCALING_KEYS = {
    "enabled": "enabled",
    "minReplicas": "min_replicas",
    "maxReplicas": "max_replicas",
    "metric": "metric",
    "target": "target",
    "tolerance": "tolerance",
    "intervalSeconds": "interval_seconds",
    "scaleUpStabilizationSeconds": "scale_up_stabilization_seconds",
    "scaleDownStabilizationSeconds": "scale_down_stabilization_seconds",
    "scaleUpPercent": "scale_up_percent",
    "scaleUpPods": "scale_up_pods",
    "scaleDownPercent": "scale_down_percent",
    "policyPeriodSeconds": "policy_period_seconds",
}


def autoscaling_from(raw: Mapping[str, Any] | None) -> AutoscalingSpec:
    raw = raw or {}
    kwargs = {py: raw[k] for k, py in _AUTOSCALING_KEYS.items() if raw.get(k) is not None}
    return AutoscalingSpec(**kwargs)


def engine_from(raw: Mapping[str, Any] | None) -> Any:
    """spec.engine -> EngineSpec; a list becomes a tuple (the spec is frozen and hashable)."""
    raw = raw or {}
    values = {o.field: raw[o.key] for o in engine_options.OPTIONS if raw.get(o.key) is not None}
    return EngineSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def accelerator_of(spec: Mapping[str, Any]) -> str:
    """tpu, gpu or cpu, from a (raw) InferenceModel spec."""
    return "tpu" if spec.get("tpu") else "gpu" if spec.get("gpu") else "cpu"


def pick_image(spec: Mapping[str, Any], default_image: str | Mapping[str, str] | None) -> str | None:
    """spec.image, else the operator's image for the spec's accelerator (a mapping tpu/gpu/cpu), else
    its single default image."""
    if spec.get("image"):
        return str(spec["image"])
    if isinstance(default_image, Mapping):
        return default_image.get(accelerator_of(spec)) or None
    return default_image or None


def scheduling_from(spec: Mapping[str, Any]) -> SchedulingSpec:
    """spec.scheduling, with the older flat spec.nodeSelector / spec.tolerations merged in."""
    raw = spec.get("scheduling") or {}
    selector = {**(spec.get("nodeSelector") or {}), **(raw.get("nodeSelector") or {})}
    tolerations = [*(spec.get("tolerations") or ()), *(raw.get("tolerations") or ())]
    unique: list[Mapping[str, Any]] = []
    for t in tolerations:
        if t not in unique:
            unique.append(t)
    return SchedulingSpec(
        node_selector=selector,
        tolerations=tuple(unique),
        affinity=raw.get("affinity") or None,
        priority_class_name=raw.get("priorityClassName") or None,
        topology_spread_constraints=tuple(raw.get("topologySpreadConstraints") or ()),
    )


def compile_cache_from(raw: Mapping[str, Any] | None) -> CompileCacheSpec | None:
    if not raw:
        return None
    return CompileCacheSpec(
        claim_name=raw.get("claimName") or None,
        size=None if raw.get("size") is None else str(raw["size"]),
        storage_class_name=raw.get("storageClassName") or None,
        access_mode=raw.get("accessMode") or None,
    )


def gateway_from(raw: Mapping[str, Any] | None) -> GatewaySpec:
    raw = raw or {}
    picker = raw.get("endpointPicker") or {}
    pool = raw.get("inferencePool")
    return GatewaySpec(
        inference_pool=None if pool is None else bool(pool),
        picker_name=picker.get("name") or None,
        picker_port=int(picker["port"]) if picker.get("port") else None,
        failure_mode=picker.get("failureMode") or None,
    )


def api_key_secret_from(raw: Mapping[str, Any] | None, default_key: str = "api-key") -> ApiKeySecret | None:
    if not raw or not raw.get("name"):
        return None
    return ApiKeySecret(name=raw["name"], key=raw.get("key") or default_key)


def parse(body: Mapping[str, Any], *, default_image: str | Mapping[str, str] | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from a validated InferenceModel body.

    ``default_image`` is the operator's image for models without spec.image: one for all, or one per
    accelerator (``{"tpu": ..., "gpu": ..., "cpu": ...}``)."""
    meta = body.get("metadata", {})
    spec = body.get("spec", {})
    model = spec.get("model", {})
    name = meta["name"]
    tpu_raw = spec.get("tpu")
    placement = tpu.placement(tpu_raw["accelerator"], tpu_raw["topology"]) if tpu_raw else None
    scheduling = scheduling_from(spec)
    template_meta = (spec.get("podTemplate") or {}).get("metadata") or {}
    rollout = spec.get("rollout") or {}
    tracing_raw = spec.get("tracing")
    tracing = None
    if tracing_raw and tracing_raw.get("endpoint"):
        tracing = TracingSpec(
            endpoint=tracing_raw["endpoint"],
            sampling_ratio=float(tracing_raw.get("samplingRatio", 0.1)),
            service_name=tracing_raw.get("serviceName"),
        )
    return ModelSpec(
        name=name,
        namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation", 0) or 0),
        source=model["source"],
        served_name=model.get("servedName") or name,
        image=pick_image(spec, default_image) or "",
        engine=engine_from(spec.get("engine")),
        placement=placement,
        gpu=gpu.placement(spec["gpu"]) if spec.get("gpu") else None,
        replicas=spec.get("replicas"),
        autoscaling=autoscaling_from(spec.get("autoscaling")),
        tracing=tracing,
        image_pull_policy=spec.get("imagePullPolicy"),
        resources=spec.get("resources") or {},
        env=tuple(spec.get("env") or ()),
        node_selector=scheduling.node_selector,
        tolerations=scheduling.tolerations,
        service_account_name=spec.get("serviceAccountName"),
        credentials_secret=model.get("credentialsSecret"),
        cache_size_limit=None
        if (spec.get("cache") or {}).get("sizeLimit") is None
        else str(spec["cache"]["sizeLimit"]),
        cache_claim=(spec.get("cache") or {}).get("claimName"),
        scheduling=scheduling,
        pod_labels=dict(template_meta.get("labels") or {}),
        pod_annotations=dict(template_meta.get("annotations") or {}),
        image_pull_secrets=tuple(s["name"] for s in spec.get("imagePullSecrets") or () if s.get("name")),
        drain_seconds=int(spec.get("drainSeconds", DEFAULT_DRAIN_SECONDS)),
        rollout=RolloutSpec(
            surge=int(rollout.get("surge", DEFAULT_SURGE)),
            max_unavailable=int(rollout.get("maxUnavailable", DEFAULT_MAX_UNAVAILABLE)),
        ),
        compile_cache=compile_cache_from(spec.get("compileCache")),
        adapters=adaptersmod.adapters_from(spec.get("adapters")),
        gateway=gateway_from(spec.get("gateway")),
        api_key_secret=api_key_secret_from(spec.get("apiKeySecret")),
        admin_key_secret=api_key_secret_from(spec.get("adminKeySecret"), "admin-key"),
    )
