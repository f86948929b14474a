"""vSurge: a JAX inference engine for the Llama family with an OpenAI-compatible server."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_model": "vsurge.models.loader",
    "vSurge": "vsurge.surge",
    "vSurgeRequest": "vsurge.surge",
    "SamplingParams": "vsurge.sampling_params",
    "EngineConfig": "vsurge.engine_config",
}


def __getattr__(name: str) -> Any:
    # jax and transformers load only when used, so `vsurge --help` and the operator stay light
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vsurge' has no attribute {name!r}")
