"""vSurge: a JAX inference engine for the Llama family with an OpenAI-compatible server.

Every name of the seed's API imports from here (`from vsurge import vSurge, oEngine, vSurgeApiServer`),
loaded on first use.
"""

from __future__ import annotations

from typing import Any

from vsurge.version import __version__

_LAZY = {
    "load_model": "vsurge.models.loader",
    "vSurge": "vsurge.seed_api.surge",
    "vSurgeRequest": "vsurge.seed_api.request",
    "vSurgeMetadata": "vsurge.contracts.request",
    "ReturnSample": "vsurge.contracts.request",
    "SamplingParams": "vsurge.contracts.sampling_params",
    "EngineConfig": "vsurge.contracts.engine_config",
    "ActiveRequest": "vsurge.drivers.active_request",
    "vDriver": "vsurge.drivers.dense.vdriver",
    "oDriver": "vsurge.drivers.paged.odriver",
    "vEngine": "vsurge.seed_api.engines",
    "oEngine": "vsurge.seed_api.engines",
    "GenerationState": "vsurge.engines.dense.vengine",
    "HBMPageManager": "vsurge.engines.paged.paging",
    "PagedAttentionCache": "vsurge.engines.paged.paging",
    "ResultTokens": "vsurge.seed_api.types",
    "SlotData": "vsurge.seed_api.types",
    "NextIterationPlan": "vsurge.seed_api.types",
    "ModelOutputBatch": "vsurge.seed_api.types",
    "ActiveSequenceBatch": "vsurge.seed_api.paged",
    "AbstractDriver": "vsurge.seed_api.protocols",
    "AbstractInferenceEngine": "vsurge.seed_api.protocols",
    "vSurgeApiServer": "vsurge.server.app",
    "ChatCompletionRequest": "vsurge.server.schemas",
    "CompletionRequest": "vsurge.server.schemas",
    "CountTokenRequest": "vsurge.server.schemas",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    # jax and transformers load only when used, so `vsurge --help` and the operator stay light
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vsurge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
