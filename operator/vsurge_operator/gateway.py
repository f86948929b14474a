"""spec.gateway: the model's InferencePool (Gateway API Inference Extension, ``inference.networking.k8s.io/v1``).

A Gateway routes a model's requests to an InferencePool; the pool names the pods (a label selector and a
port) and the endpoint picker the Gateway's proxy asks, per request, which pod (the picker's Service, in
the pool's namespace: ``endpointPickerRef`` has no namespace). The operator renders one pool per
InferenceModel that asks for one (``spec.gateway.inferencePool``, default the operator's
``--inference-pool``, the chart's ``gateway.inferencePool``), named after the model and owned by it:

- the selector is the model's serving pods only: every pod of a Deployment, the leaders of a
  LeaderWorkerSet (``leaderworkerset.sigs.k8s.io/worker-index: "0"``; the workers serve no HTTP);
- the target port is ``http`` (11556);
- the picker is ``spec.gateway.endpointPicker`` or the operator's default: the router's endpoint picker
  (`vsurge route --ext-proc-port`, the chart's ``<release>-epp`` Service) or llm-d's, by the chart's
  ``gateway.endpointPicker.type``; ``{model}`` in the default's name stands for the model's name (llm-d's
  picker serves one pool, so the chart runs one per model, ``<model>-epp``).

Pure: ``inference_pool`` returns the object or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vsurge_operator import labels
from vsurge_operator.spec import HTTP_PORT, ModelSpec

API_VERSION = "inference.networking.k8s.io/v1"
KIND = "InferencePool"


@dataclass(frozen=True)
class PoolDefaults:
    """The operator's defaults for spec.gateway (OperatorConfig)."""

    enabled: bool = False
    picker: str = "vsurge-epp"
    port: int = 9002
    failure_mode: str = "FailClose"


def wanted(model: ModelSpec, defaults: PoolDefaults) -> bool:
    g = model.gateway
    return defaults.enabled if g.inference_pool is None else g.inference_pool


def inference_pool(model: ModelSpec, defaults: PoolDefaults) -> dict[str, Any] | None:
    if not wanted(model, defaults):
        return None
    g = model.gateway
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": labels.owned_metadata(model),
        "spec": {
            "selector": {"matchLabels": labels.serving_selector(model)},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {
                "name": g.picker_name or defaults.picker.replace("{model}", model.name),
                "port": {"number": g.picker_port or defaults.port},
                "failureMode": g.failure_mode or defaults.failure_mode,
            },
        },
    }
