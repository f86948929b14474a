"""Pure builders: a :class:`~vsurge_operator.spec.ModelSpec` -> the Kubernetes objects that serve it.

Everything a model needs is named after the model: the workload (a Deployment, or a LeaderWorkerSet when
one replica spans several TPU hosts), a Service with ports ``http`` and ``metrics``, and a
PodDisruptionBudget. Every object carries a controller owner reference to the InferenceModel so that
deleting the model garbage-collects them. Quantities are written as strings because that is how the API
server returns them, which keeps the drift check free of false positives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vsurge_operator import (
    access,
    adapters,
    compile_cache,
    disruption,
    engine_options,
    gateway,
    gpu,
    lane,
    model_secrets,
    podsecurity,
    rollout,
    tpu,
)

# re-exported: the labels and owner reference every object carries live in labels.py (lane.py stamps them too)
from vsurge_operator.labels import (  # noqa: F401
    APP_NAME,
    ENGINE_TYPE_LABELS,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_MODEL,
    LABEL_NAME,
    LABEL_PART_OF,
    LWS_API_VERSION,
    LWS_WORKER_INDEX_LABEL,
    MANAGER,
    endpoint,
    labels,
    owner_reference,
    selector_labels,
    selector_string,
    serving_selector,
)
from vsurge_operator.spec import HTTP_PORT, METRICS_PORT, ModelSpec

CONTAINER_NAME = "server"
CACHE_DIR = "/var/cache/vsurge"
MODEL_MOUNT = "/mnt/models"
CREDENTIALS_DIR = "/var/run/secrets/vsurge/model-credentials"
IMAGE_GID = podsecurity.IMAGE_GID  # the vsurge user's group in the service image

# Loading weights and compiling every bucket takes minutes on a large slice; the startup probe gives the
# server up to 30 minutes before the liveness probe takes over.
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURE_THRESHOLD = 180
PROGRESS_DEADLINE_SECONDS = 3600


def _metadata(model: ModelSpec) -> dict[str, Any]:
    return {
        "name": model.name,
        "namespace": model.namespace,
        "labels": labels(model),
        "ownerReferences": [owner_reference(model)],
    }


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def _value_env(name: str, value: Any) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def model_path(source: str) -> str:
    """What ``VSURGE_MODEL`` gets: the source as is, except ``pvc://claim/path`` becomes the mounted path."""
    if source.startswith("pvc://"):
        _claim, _, path = source[len("pvc://") :].partition("/")
        return f"{MODEL_MOUNT}/{path}".rstrip("/") if path else MODEL_MOUNT
    return source


def pvc_claim(source: str) -> str | None:
    if source.startswith("pvc://"):
        return source[len("pvc://") :].partition("/")[0]
    return None


def mesh(model: ModelSpec) -> str | None:
    """The engine mesh: as set in the spec, else one covering the whole slice; CPU pods use the server default."""
    if model.engine.mesh:
        return model.engine.mesh
    if model.gpu is not None:
        return model.gpu.mesh()
    return model.placement.mesh() if model.placement else None


# The order in which pods of operators before the generated table (issue 31) carry these: drift compares env
# lists in order, so keeping it spares every model a rollout when the operator is upgraded. Options added
# since follow in the table's order.
_ENV_ORDER = (
    "VSURGE_DRIVER",
    "VSURGE_MAX_CONCURRENT_DECODES",
    "VSURGE_MAX_LENGTH",
    "VSURGE_PREFILL_LENGTHS",
    "VSURGE_PAGE_SIZE",
    "VSURGE_HBM_UTILIZATION",
    "VSURGE_MESH",
    "VSURGE_DTYPE",
    "VSURGE_QUANTIZATION",
    "VSURGE_SPECULATIVE",
    "VSURGE_NUM_SPECULATIVE_TOKENS",
    "VSURGE_KV_CACHE_DTYPE",
    "VSURGE_PREFILL_DTYPE",
    "VSURGE_DECODE_DTYPE",
)


def engine_env(model: ModelSpec) -> list[tuple[str, str]]:
    """(variable, text) of every spec.engine option that is set (engine_options.OPTIONS), and the mesh,
    which defaults to one covering the slice; as `vsurge serve` parses them (a list comma-separated)."""
    values = {
        o.env: mesh(model) if o.field == "mesh" else getattr(model.engine, o.field)
        for o in engine_options.OPTIONS
        if o.env
    }
    known = len(_ENV_ORDER)
    names = sorted(values, key=lambda n: _ENV_ORDER.index(n) if n in _ENV_ORDER else known)
    return [(n, _env_text(values[n])) for n in names if values[n] is not None]


def _env_text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def env(model: ModelSpec) -> list[dict[str, Any]]:
    """Container environment: downward API first (later values expand ``$(POD_NAME)`` etc.), then the
    ``VSURGE_*`` configuration of ``vsurge serve``, OpenTelemetry, and the user's overrides last."""
    out: list[dict[str, Any]] = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("NODE_NAME", "spec.nodeName"),
        _value_env("VSURGE_HOST", "0.0.0.0"),
        _value_env("VSURGE_PORT", HTTP_PORT),
        _value_env("VSURGE_METRICS_PORT", METRICS_PORT),
        _value_env("VSURGE_MODEL", model_path(model.source)),
        _value_env("VSURGE_SERVED_MODEL_NAME", model.served_name),
    ]
    out += [_value_env(k, v) for k, v in engine_env(model)]
    out.append(_value_env("VSURGE_CACHE_DIR", CACHE_DIR))
    # The image's HF_HOME is under its root filesystem, which is read-only here: keep it in the cache.
    out.append(_value_env("HF_HOME", f"{CACHE_DIR}/huggingface"))
    # SIGTERM waits this long for generations in flight; the grace period leaves room for it.
    out.append(_value_env("VSURGE_DRAIN_TIMEOUT", model.drain_seconds))
    # the compile cache's signing key and the model's own API key, from their Secrets (model_secrets.py)
    out += model_secrets.env(model)
    if model.credentials_secret:
        out.append(_value_env("VSURGE_CREDENTIALS_DIR", CREDENTIALS_DIR))
    if model.tracing is not None:
        t = model.tracing
        out += [
            _value_env("OTEL_SERVICE_NAME", t.service_name or f"vsurge-{model.name}"),
            _value_env("OTEL_EXPORTER_OTLP_ENDPOINT", t.endpoint),
            _value_env("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
            _value_env("OTEL_TRACES_SAMPLER_ARG", f"{t.sampling_ratio:g}"),
            _value_env("OTEL_PROPAGATORS", "tracecontext,baggage"),
            _value_env(
                "OTEL_RESOURCE_ATTRIBUTES",
                "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME),k8s.node.name=$(NODE_NAME)",
            ),
        ]
    # A user entry replaces ours in place (keeping the order that $(VAR) expansion relies on).
    index = {item["name"]: i for i, item in enumerate(out)}
    for item in model.env:
        if item["name"] in index:
            out[index[item["name"]]] = dict(item)
        else:
            index[item["name"]] = len(out)
            out.append(dict(item))
    return out


def _quantities(amounts: Mapping[str, Any] | None) -> dict[str, str]:
    return {k: str(v) for k, v in (amounts or {}).items()}


def resources(model: ModelSpec) -> dict[str, Any]:
    """User resources plus the TPU chips of one host, or the GPUs of spec.gpu, as both request and limit
    (extended resources are never overcommitted)."""
    requests = _quantities(model.resources.get("requests"))
    limits = _quantities(model.resources.get("limits"))
    if model.placement is not None:
        chips = str(model.placement.chips_per_host)
        requests[tpu.TPU_RESOURCE] = chips
        limits[tpu.TPU_RESOURCE] = chips
    if model.gpu is not None:  # an extended resource: request == limit
        requests[gpu.GPU_RESOURCE] = limits[gpu.GPU_RESOURCE] = str(model.gpu.count)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def container(model: ModelSpec, *, probes: bool = True) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": model.image,
        "command": ["vsurge", "serve"],
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "env": env(model),
        "resources": resources(model),
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR}, podsecurity.tmp_mount()],
        # `vsurge serve` writes why it stopped (e.g. "ModelSourceError: s3://...: access denied") to
        # /dev/termination-log; without it the log tail stands in. The operator reads it into status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": podsecurity.container_security_context(),
    }
    # LoRA adapters as flags (spec.adapters; adapters.py says why args and why a change rolls the pods).
    lora_args = adapters.args(
        model.adapters, model.source, MODEL_MOUNT, model.engine.max_loras, model.engine.max_lora_rank
    )
    if lora_args:
        c["args"] = lora_args
    if model.compile_cache is not None:
        c["volumeMounts"].append(compile_cache.mount(CACHE_DIR))
    if model.image_pull_policy:
        c["imagePullPolicy"] = model.image_pull_policy
    if pvc_claim(model.source):
        c["volumeMounts"].append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    c["volumeMounts"] += adapters.mounts(model.adapters, model.source)
    if model.credentials_secret:
        # Every key of the Secret that is a valid variable name becomes one (AWS_*, HF_TOKEN, ...); the
        # files (a GCS key.json) are mounted too.
        c["envFrom"] = [{"secretRef": {"name": model.credentials_secret}}]
        c["volumeMounts"].append(
            {"name": "model-credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True}
        )
    if probes:
        c["startupProbe"] = _probe("/liveness", STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD)
        c["livenessProbe"] = _probe("/liveness", 10, 6)
        c["readinessProbe"] = _probe("/readiness", 5, 3)
        # Only a pod that answers HTTP drains; multi-host workers follow their leader.
        c["lifecycle"] = rollout.lifecycle()
    return c


def cache_volume(model: ModelSpec) -> dict[str, Any]:
    """The model cache (VSURGE_CACHE_DIR): an existing PVC, or an emptyDir capped at spec.cache.sizeLimit."""
    if model.cache_claim:
        return {"name": "cache", "persistentVolumeClaim": {"claimName": model.cache_claim}}
    return {
        "name": "cache",
        "emptyDir": {"sizeLimit": model.cache_size_limit} if model.cache_size_limit else {},
    }


def pod_volumes(model: ModelSpec) -> list[dict[str, Any]]:
    vols = [cache_volume(model), podsecurity.tmp_volume()]
    cc = compile_cache.volume(model)
    if cc is not None:
        vols.append(cc)
    return vols


def node_selector(model: ModelSpec) -> dict[str, str]:
    sel = dict(model.node_selector)
    if model.placement is not None:
        sel.update(model.placement.node_selector())
    if model.gpu is not None:
        sel.update(model.gpu.node_selector())
    return sel


def tolerations(model: ModelSpec) -> list[dict[str, Any]]:
    tol = [dict(t) for t in model.tolerations]
    # GKE taints TPU node pools with google.com/tpu; tolerate it explicitly rather than relying on the
    # ExtendedResourceToleration admission plugin being enabled.
    tpu_toleration = {"key": tpu.TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    if model.placement is not None and tpu_toleration not in tol:
        tol.append(tpu_toleration)
    gpu_toleration = {"key": gpu.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    if model.gpu is not None and gpu_toleration not in tol:
        tol.append(gpu_toleration)
    return tol


def pod_template(model: ModelSpec, *, probes: bool = True) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "containers": [container(model, probes=probes)],
        "terminationGracePeriodSeconds": rollout.termination_grace_seconds(model),
        # Pod Security Standard "restricted"; fsGroup makes claims writable for the image's user.
        "securityContext": podsecurity.pod_security_context(),
        "volumes": pod_volumes(model),
    }
    if model.credentials_secret:
        pod_spec["volumes"].append(
            {
                "name": "model-credentials",
                "secret": {"secretName": model.credentials_secret, "defaultMode": 0o440},
            }
        )
    claim = pvc_claim(model.source)
    if claim:
        pod_spec["volumes"].append(
            {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
    pod_spec["volumes"] += adapters.volumes(model.adapters, model.source)
    sel = node_selector(model)
    if sel:
        pod_spec["nodeSelector"] = sel
    tol = tolerations(model)
    if tol:
        pod_spec["tolerations"] = tol
    if model.service_account_name:
        pod_spec["serviceAccountName"] = model.service_account_name
    sched = model.scheduling
    if sched.affinity:
        pod_spec["affinity"] = dict(sched.affinity)
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    if sched.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [dict(t) for t in sched.topology_spread_constraints]
    if model.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in model.image_pull_secrets]
    # The user's pod labels and annotations first: ours (the selector's) win.
    return {
        "metadata": {
            # the engine-type labels tell llm-d's endpoint picker which metric names the pods speak (vLLM's)
            "labels": {**model.pod_labels, **labels(model), **ENGINE_TYPE_LABELS},
            "annotations": {
                **model.pod_annotations,
                "kubectl.kubernetes.io/default-container": CONTAINER_NAME,
            },
        },
        "spec": pod_spec,
    }


def deployment(model: ModelSpec) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(model),
        "spec": {
            "replicas": model.desired_replicas(),
            "selector": {"matchLabels": selector_labels(model)},
            # spec.rollout: by default a new pod is ready before an old one goes (needs a spare slice).
            "strategy": rollout.deployment_strategy(model),
            "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "template": pod_template(model),
        },
    }


# What `vsurge serve` reads to join a multi-host group (vsurge/multihost/group.py). The LeaderWorkerSet
# controller prepends LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX to each container's
# environment, so these expand them. The step lane listens on the coordinator port + 1.
COORDINATOR_PORT = 8476
STEP_LANE_PORT = COORDINATOR_PORT + 1
GROUP_ENV = {
    "VSURGE_COORDINATOR_ADDRESS": f"$(LWS_LEADER_ADDRESS):{COORDINATOR_PORT}",
    "VSURGE_NUM_PROCESSES": "$(LWS_GROUP_SIZE)",
    "VSURGE_PROCESS_ID": "$(LWS_WORKER_INDEX)",
}


def group_pod_template(model: ModelSpec, *, leader: bool, lane_version: str | None = None) -> dict[str, Any]:
    """A LeaderWorkerSet pod: the pod template plus the process group's variables and ports, and the step
    lane's secret (lane.py; ``lane_version`` its digest). Only the leader answers HTTP, so only it has
    probes; a worker exits when its leader is gone."""
    template = pod_template(model, probes=leader)
    lane.mount(template, model, lane_version)
    c = template["spec"]["containers"][0]
    names = {e["name"] for e in c["env"]}
    c["env"] += [_value_env(k, v) for k, v in GROUP_ENV.items() if k not in names]
    c["ports"] += [
        {"name": "coordinator", "containerPort": COORDINATOR_PORT, "protocol": "TCP"},
        {"name": "step-lane", "containerPort": STEP_LANE_PORT, "protocol": "TCP"},
    ]
    return template


def leader_worker_set(model: ModelSpec, lane_version: str | None = None) -> dict[str, Any]:
    assert model.placement is not None
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": _metadata(model),
        "spec": {
            "replicas": model.desired_replicas(),
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": rollout.lws_rollout_strategy(model),
            "leaderWorkerTemplate": {
                # One pod per TPU host of the slice; a failed host restarts the whole group because a
                # JAX program cannot continue with a missing process.
                "size": model.placement.hosts,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": group_pod_template(model, leader=True, lane_version=lane_version),
                "workerTemplate": group_pod_template(model, leader=False, lane_version=lane_version),
            },
        },
    }


def workload(model: ModelSpec, lane_version: str | None = None) -> dict[str, Any]:
    return leader_worker_set(model, lane_version) if model.multi_host else deployment(model)


def service(model: ModelSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(model),
        "spec": {
            "type": "ClusterIP",
            "selector": serving_selector(model),
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


pod_disruption_budget = disruption.pod_disruption_budget  # re-exported: the tests' name for it


def desired_objects(
    model: ModelSpec,
    lane_version: str | None = None,
    *,
    reach: access.Access | None = None,
    pool: gateway.PoolDefaults | None = None,
) -> list[dict[str, Any]]:
    """Everything the model needs, workload first (a multi-host model's lane Secret is made apart, once:
    ``lane.ensure_secret``; ``lane_version`` is its digest). ``reach``: the pods' NetworkPolicy settings
    (access.py); ``pool``: the InferencePool defaults (gateway.py)."""
    reach = reach or access.Access()
    objects = [workload(model, lane_version), service(model), *disruption.budgets(model)]
    claim = compile_cache.claim(model, _metadata(model))
    if claim is not None:
        objects.append(claim)
    if model.multi_host:  # its own pods on any port; anyone on http/metrics unless the model policy decides
        objects.append(lane.network_policy(model, open_ports=not reach.enabled))
    for extra in (
        access.network_policy(model, reach),
        gateway.inference_pool(model, pool or gateway.PoolDefaults()),
    ):
        if extra is not None:
            objects.append(extra)
    return objects
