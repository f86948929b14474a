"""Operator-wide settings: environment variables, overridden by command-line flags in ``__main__``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    # Image for models whose spec has none, per accelerator (the chart's images.model.{tpu,gpu,cpu}); an
    # accelerator without one falls back to default_image.
    default_image: str | None = None
    image_tpu: str | None = None
    image_gpu: str | None = None
    image_cpu: str | None = None
    # How often every model is re-reconciled to repair drift (an edited or deleted Deployment).
    resync_seconds: float = 30.0
    # Delay before retrying a reconcile that failed on a retriable API error (409, 429, 5xx).
    retry_delay_seconds: float = 5.0
    # Per-pod /metrics timeout; a slow pod counts as "metrics missing".
    scrape_timeout_seconds: float = 2.0
    # Timeout of one Kubernetes API request made by the operator's own client.
    api_timeout_seconds: float = 30.0
    # How often a model with autoscaling disabled is checked for it being enabled (no API calls).
    autoscaler_idle_poll_seconds: float = 2.0
    # How often status.adapters (LoRA) is refreshed from the ready pods' /v1/models, at most.
    adapter_status_seconds: float = 15.0
    # kopf peering: a peer silent for this long is dead, and a standby replica takes over (kopf's own
    # default is 60 s; a shorter one bounds the failover, at one keep-alive patch every 5-10 s).
    peering_lifetime_seconds: int = 15
    # Port of the operator's /metrics (None: not served).
    metrics_port: int | None = None
    # spec.compileCache.accessMode when unset: ReadWriteOnce (a claim per pod, any storage class has it) or
    # ReadWriteMany (one claim shared by the model's pods: the class must offer it, or the pods stay Pending).
    compile_cache_access_mode: str = "ReadWriteOnce"
    # spec.gateway defaults (gateway.py): an InferencePool per model, and the endpoint picker it names.
    inference_pool: bool = False
    endpoint_picker: str = "vsurge-epp"
    endpoint_picker_port: int = 9002
    endpoint_picker_failure_mode: str = "FailClose"
    # The model pods' NetworkPolicy (access.py): on/off, and who may reach the serving and metrics ports.
    network_policy: bool = False
    serving_from_namespaces: tuple[str, ...] = ()
    serving_from_cidrs: tuple[str, ...] = ()
    metrics_from_namespaces: tuple[str, ...] = ()
    # The operator's own namespace: it reads the pods' /metrics and /v1/models.
    namespace: str | None = None

    def model_images(self) -> dict[str, str | None]:
        """The image of a model without spec.image, by its accelerator (tpu, gpu, cpu)."""
        return {
            "tpu": self.image_tpu or self.default_image,
            "gpu": self.image_gpu or self.default_image,
            "cpu": self.image_cpu or self.default_image,
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        d = cls()

        def num(key: str, default: float) -> float:
            raw = env.get(key)
            return float(raw) if raw not in (None, "") else default

        return cls(
            default_image=env.get("VSURGE_OPERATOR_DEFAULT_IMAGE") or None,
            image_tpu=env.get("VSURGE_OPERATOR_IMAGE_TPU") or None,
            image_gpu=env.get("VSURGE_OPERATOR_IMAGE_GPU") or None,
            image_cpu=env.get("VSURGE_OPERATOR_IMAGE_CPU") or None,
            resync_seconds=num("VSURGE_OPERATOR_RESYNC_SECONDS", d.resync_seconds),
            retry_delay_seconds=num("VSURGE_OPERATOR_RETRY_DELAY_SECONDS", d.retry_delay_seconds),
            scrape_timeout_seconds=num("VSURGE_OPERATOR_SCRAPE_TIMEOUT_SECONDS", d.scrape_timeout_seconds),
            api_timeout_seconds=num("VSURGE_OPERATOR_API_TIMEOUT_SECONDS", d.api_timeout_seconds),
            autoscaler_idle_poll_seconds=num(
                "VSURGE_OPERATOR_AUTOSCALER_IDLE_POLL_SECONDS", d.autoscaler_idle_poll_seconds
            ),
            adapter_status_seconds=num("VSURGE_OPERATOR_ADAPTER_STATUS_SECONDS", d.adapter_status_seconds),
            peering_lifetime_seconds=int(
                num("VSURGE_OPERATOR_PEERING_LIFETIME_SECONDS", d.peering_lifetime_seconds)
            ),
            metrics_port=int(env["VSURGE_OPERATOR_METRICS_PORT"])
            if env.get("VSURGE_OPERATOR_METRICS_PORT")
            else None,
            compile_cache_access_mode=env.get("VSURGE_OPERATOR_COMPILE_CACHE_ACCESS_MODE")
            or d.compile_cache_access_mode,
            inference_pool=_flag(env.get("VSURGE_OPERATOR_INFERENCE_POOL"), d.inference_pool),
            endpoint_picker=env.get("VSURGE_OPERATOR_ENDPOINT_PICKER") or d.endpoint_picker,
            endpoint_picker_port=int(num("VSURGE_OPERATOR_ENDPOINT_PICKER_PORT", d.endpoint_picker_port)),
            endpoint_picker_failure_mode=env.get("VSURGE_OPERATOR_ENDPOINT_PICKER_FAILURE_MODE")
            or d.endpoint_picker_failure_mode,
            network_policy=_flag(env.get("VSURGE_OPERATOR_NETWORK_POLICY"), d.network_policy),
            serving_from_namespaces=_names(env.get("VSURGE_OPERATOR_SERVING_FROM_NAMESPACES")),
            serving_from_cidrs=_names(env.get("VSURGE_OPERATOR_SERVING_FROM_CIDRS")),
            metrics_from_namespaces=_names(env.get("VSURGE_OPERATOR_METRICS_FROM_NAMESPACES")),
            namespace=env.get("VSURGE_OPERATOR_NAMESPACE") or None,
        )


def _flag(raw: str | None, default: bool) -> bool:
    if raw in (None, ""):
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def _names(raw: str | None) -> tuple[str, ...]:
    """A comma-separated list (namespaces, CIDRs), blanks dropped, order kept."""
    return tuple(dict.fromkeys(p.strip() for p in (raw or "").split(",") if p.strip()))
