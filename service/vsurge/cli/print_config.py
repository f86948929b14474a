"""`vsurge serve --print-config`: the engine configuration this machine would run, and why, without serving."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


def local_model_config(model: str) -> Any:
    """The ModelConfig of a local Hugging Face directory (its config.json alone, no weights) or a local
    GGUF file (its header; the default model once cached), else None: a remote model is not fetched
    just to print a configuration."""
    from vsurge.models.config import ModelConfig

    if model == "default":
        from vsurge.models.default_model import DEFAULT_MODEL_FILE, cache_dir

        model = str(cache_dir() / DEFAULT_MODEL_FILE)
    if model.endswith(".gguf") and os.path.isfile(model):
        from vsurge.models.gguf.checkpoint import read_gguf

        return ModelConfig.from_hf(read_gguf(model).config, source=model)
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return ModelConfig.from_hf(json.load(f), source=path)


def sizing_rows(cfg: Any, model_config: Any, devices: list[Any], rows: list[Any]) -> tuple[list[Any], str]:
    """``rows`` with slots and context as serve sizes them (vsurge/cli/sizing.py), and the line saying why."""
    from vsurge.cli import sizing

    if model_config is None:
        backend, memory = sizing.device_memory_bytes(devices)
        cap = sizing.slot_cap(backend, sizing.cpu_count())
        return rows, (
            f"sizing: at start, from the loaded weights ({backend} memory {memory / (1 << 30):.1f} GiB, "
            f"x {cfg.engine.hbm_utilization:g} of what the weights leave; cap {cap} slots)"
        )
    sized = sizing.estimate(cfg.engine, cfg.set_knobs, model_config, cfg.dtype, devices)
    values = {"max_concurrent_decodes": sized.slots, "max_length": sized.context}
    out = [
        dataclasses.replace(r, value=values[r.name], source="sized", why=sized.why)
        if r.name in values and r.name not in cfg.set_knobs
        else r
        for r in rows
    ]
    return out, f"sizing (weights estimated from the model's shapes): {sized.describe()}"


def print_config(cfg: Any) -> int:
    """Print `cfg`'s engine knobs resolved for this machine's backend (vsurge.engines.resolved_config), with the
    slots and context serve sizes from the device's memory."""
    import jax

    from vsurge.engines.resolved_config import Resolved, format_resolved, resolve

    backend = jax.default_backend()
    devices = jax.devices()
    model_config = local_model_config(cfg.model)
    print(f"backend {backend}: {len(devices)} x {devices[0].device_kind}; model {cfg.model}")
    if model_config is None:
        print(
            "(model shapes not read: not a local Hugging Face directory or GGUF file; the attention path "
            "assumes they fit)"
        )
    rows: list[Resolved] = resolve(cfg.engine, backend, model_config, explicit=set(cfg.set_knobs))
    rows, why = sizing_rows(cfg, model_config, devices if cfg.engine.mesh else devices[:1], rows)
    print(format_resolved(rows))
    print(why)
    return 0
