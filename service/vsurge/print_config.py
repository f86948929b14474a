"""`vsurge serve --print-config`: the engine configuration this machine would run, and why, without serving."""

from __future__ import annotations

import json
import os
from typing import Any


def local_model_config(model: str) -> Any:
    """The ModelConfig of a local Hugging Face directory (its config.json alone, no weights), else None:
    a remote or GGUF model is not fetched just to print a configuration."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    from vsurge.models.config import ModelConfig

    with open(path) as f:
        return ModelConfig.from_hf(json.load(f), source=path)


def print_config(cfg: Any) -> int:
    """Print `cfg`'s engine knobs resolved for this machine's backend (vsurge.resolved_config)."""
    import jax

    from vsurge.resolved_config import format_resolved, resolve

    backend = jax.default_backend()
    devices = jax.devices()
    model_config = local_model_config(cfg.model)
    print(f"backend {backend}: {len(devices)} x {devices[0].device_kind}; model {cfg.model}")
    if model_config is None:
        print(
            "(model shapes not read: not a local Hugging Face directory; the attention path assumes they fit)"
        )
    print(format_resolved(resolve(cfg.engine, backend, model_config)))
    return 0
