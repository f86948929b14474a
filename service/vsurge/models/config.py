"""Model configuration read from a Hugging Face config dict (both the flat and the nested rope layout)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .errors import CheckpointError
from .registry import ModelTypes, architecture_for

# The registered model_types (models/registry.py; the built-ins: llama, mistral, qwen2, qwen3), live.
SUPPORTED_ARCHITECTURES = ModelTypes()
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # hashable: configs are static under jit
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Build from a config.json dict; `source` names the file in error messages."""
        model_type = cfg.get("model_type")
        family = architecture_for(model_type, source=source, architectures=cfg.get("architectures"))
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in cfg]
        if missing:
            raise CheckpointError(f"{source}: missing required field(s) {', '.join(missing)}")
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)

        # transformers 5 nests rope settings in `rope_parameters`; older files keep rope_theta at top level
        # and the scaling in `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling") or {}
        rope = {**legacy_scaling, **rope}
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise CheckpointError(f"{source}: unsupported rope type {rope_type!r}; supported: {_ROPE_TYPES}")
        scaling = None
        if rope_type != "default":
            keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            scaling = (("rope_type", rope_type),) + tuple((k, float(rope[k])) for k in keep if k in rope)

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        window = cfg.get("sliding_window")
        if not family.sliding_window_always and not cfg.get("use_sliding_window", False):
            window = None  # Qwen configs carry a window they do not use unless use_sliding_window is set
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)) and family.o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
        )
