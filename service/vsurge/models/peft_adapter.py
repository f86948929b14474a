"""PEFT LoRA adapters: read a directory (adapter_config.json + adapter_model.safetensors) and check it
against the base model before it goes near the device.

`read_adapter` returns, per (layer, module), A as [in, r] and B as [r, out] with PEFT's scaling
(lora_alpha / r, or / sqrt(r) with use_rslora) folded into B, so the bank computes x @ A @ B exactly as
PEFT's merged weight W + scaling * B_peft @ A_peft does. Everything the bank cannot express is refused
with an AdapterError naming the field: DoRA, trained biases, modules_to_save, embedding or lm_head
adapters, a rank above the bank's, alpha_pattern, and any tensor whose layer or shape is not the base's.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .lora import TARGETS, target_shape
from .safetensors_io import SafetensorsFile

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT strips its adapter name on save)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served on this base model; the message says why."""


@dataclass
class LoraAdapter:
    """One adapter, ready for a bank slot: (layer, module) -> (A [in, r], B [r, out], B scaled)."""

    path: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.weights})


def _refuse(path: str, why: str) -> AdapterError:
    return AdapterError(f"LoRA adapter {path}: {why}")


def read_config(path: str) -> dict[str, Any]:
    """adapter_config.json of the directory ``path``, checked for what the bank supports."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file) or not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise _refuse(path, f"not a PEFT adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(path, f"{CONFIG_FILE} is not readable JSON ({e})") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise _refuse(path, f"peft_type {cfg.get('peft_type')!r}: only LORA adapters are served")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "modules_to_save (fully trained modules) is not supported",
        "fan_in_fan_out": "fan_in_fan_out weights are not supported (Llama projections are not Conv1D)",
        "alpha_pattern": "alpha_pattern (per-module alpha) is not supported",
    }
    for key, why in refused.items():
        if cfg.get(key):
            raise _refuse(path, why)
    if cfg.get("bias", "none") != "none":
        raise _refuse(path, f"bias {cfg['bias']!r}: adapters with trained biases are not supported")
    return cfg


def _scaling(cfg: dict[str, Any], rank: int) -> float:
    alpha = float(cfg.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def read_adapter(path: str, model_config: Any, max_rank: int) -> LoraAdapter:
    """The adapter in directory ``path`` checked against the base ``model_config`` (models/config.py) and
    the bank's rank ``max_rank``; an AdapterError when it does not fit."""
    cfg = read_config(path)
    tensors = SafetensorsFile(os.path.join(path, WEIGHTS_FILE))
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key in tensors:
        m = _KEY.search(key)
        if m is None:
            raise _refuse(path, f"tensor {key!r} is not a LoRA A/B weight of a decoder layer projection")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise _refuse(path, f"targets {module!r}; the bank adapts only {', '.join(TARGETS)}")
        if layer >= model_config.num_layers:
            raise _refuse(path, f"has layer {layer}; the base model has {model_config.num_layers} layers")
        parts.setdefault((layer, module), {})[which] = np.asarray(tensors[key], np.float32)
    if not parts:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    adapter = LoraAdapter(path, 0)
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"layer {layer} {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]  # PEFT: A [r, in], B [out, r]
        din, dout = target_shape(model_config, module)
        r = a.shape[0]
        if a.shape != (r, din) or b.shape != (dout, r):
            raise _refuse(
                path,
                f"layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base "
                f"model's projection ({din} -> {dout}); is the adapter for another base model?",
            )
        if r > max_rank:
            raise _refuse(path, f"rank {r} exceeds --max-lora-rank {max_rank}")
        adapter.weights[(layer, module)] = (a.T.copy(), (b.T * _scaling(cfg, r)).astype(np.float32))
        adapter.rank = max(adapter.rank, r)
    return adapter
