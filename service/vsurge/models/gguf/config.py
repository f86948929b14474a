"""GGUF metadata -> a Hugging Face `config.json`-style dict (`model_type` llama, mistral, qwen2 or qwen3).

Llama 3 rope scaling, stored by llama.cpp as a `rope_freqs.weight` tensor of per-frequency divisors, is turned
back into the Hugging Face `rope_scaling` dict (and checked to reproduce that tensor).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from vsurge.models.errors import CheckpointError
from vsurge.models.registry import GGUFArchitectures, architecture_for

from .reader import _Metadata
from .tensors import _LAYER_RE, _ROPE_FREQS

__all__ = ["SUPPORTED_ARCHITECTURES"]

# general.architecture -> (Hugging Face model_type, architectures class): the families registered with a
# `gguf_architecture` (models/registry.py), live.
SUPPORTED_ARCHITECTURES = GGUFArchitectures()

# llama.cpp writes Llama 3 rope factors with `original_max_position_embeddings` defaulting to 8192.
_LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192


def _build_config(path: Path, arch: str, meta: _Metadata, by_name: dict) -> dict[str, Any]:
    model_type, architecture = SUPPORTED_ARCHITECTURES[arch]
    name = str(meta.get("general.name") or "") + " " + str(meta.get("general.basename") or "")
    if arch == "llama" and "mistral" in name.lower():
        mistral = architecture_for("mistral")  # llama.cpp converts Mistral to the llama architecture
        model_type, architecture = mistral.model_type, mistral.hf_architecture

    hidden = meta.int(f"{arch}.embedding_length", required=True)
    n_layers = meta.int(f"{arch}.block_count", required=True)
    n_heads = meta.int(f"{arch}.attention.head_count", required=True)
    n_kv_heads = meta.int(f"{arch}.attention.head_count_kv", n_heads)
    intermediate = meta.int(f"{arch}.feed_forward_length", required=True)
    eps = meta.float(f"{arch}.attention.layer_norm_rms_epsilon", required=True)
    context = meta.int(f"{arch}.context_length", required=True)
    rope_theta = meta.float(f"{arch}.rope.freq_base", 10000.0)
    if min(hidden, n_layers, n_heads, n_kv_heads, intermediate, context) <= 0:
        raise CheckpointError(f"{path}: GGUF metadata has a non-positive model dimension")
    if n_heads % n_kv_heads:
        raise CheckpointError(f"{path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    head_dim = meta.int(f"{arch}.attention.key_length", None)
    if head_dim is None:
        if hidden % n_heads:
            raise CheckpointError(
                f"{path}: embedding_length {hidden} is not a multiple of head_count {n_heads}"
            )
        head_dim = hidden // n_heads
    value_dim = meta.int(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise CheckpointError(
            f"{path}: attention key_length {head_dim} != value_length {value_dim}; not supported"
        )
    rope_dim = meta.int(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise CheckpointError(
            f"{path}: partial rotary embedding (rope.dimension_count {rope_dim} < head_dim {head_dim}) "
            "is not supported"
        )

    embd = by_name.get("token_embd.weight")
    if embd is None:
        raise CheckpointError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = embd.shape[0] if len(embd.shape) == 2 else None
    declared_vocab = meta.int(f"{arch}.vocab_size", None)
    if declared_vocab is None:
        declared_vocab = meta.array_len("tokenizer.ggml.tokens")
    if vocab is None or (declared_vocab is not None and declared_vocab != vocab):
        raise CheckpointError(
            f"{path}: tensor 'token_embd.weight' has shape {list(embd.shape)}, "
            f"expected [{declared_vocab}, {hidden}]"
        )

    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "max_position_embeddings": context,
        "tie_word_embeddings": "output.weight" not in by_name,
    }
    if model_type in ("llama", "mistral"):
        has_bias = any(_LAYER_RE.match(n) and n.endswith(".bias") for n in by_name)
        config["attention_bias"] = has_bias
        config["mlp_bias"] = False
    if model_type == "mistral":
        config["sliding_window"] = None
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    if model_type == "qwen3":
        config["attention_bias"] = False

    bos = meta.int("tokenizer.ggml.bos_token_id", None)
    eos = meta.int("tokenizer.ggml.eos_token_id", None)
    stops = [eos] if eos is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = meta.int(key, None)
        if extra is not None and extra not in stops:
            stops.append(extra)
    config["bos_token_id"] = bos
    config["eos_token_id"] = stops[0] if len(stops) == 1 else (stops or None)
    pad = meta.int("tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        config["pad_token_id"] = pad

    rope_scaling = _rope_scaling(path, arch, meta, by_name, rope_theta, head_dim)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(path: Path, arch: str, meta: _Metadata, by_name: dict, theta: float, head_dim: int):
    kind = meta.get(f"{arch}.rope.scaling.type")
    orig_ctx = meta.int(f"{arch}.rope.scaling.original_context_length", None)
    freqs_tensor = by_name.get(_ROPE_FREQS)
    if freqs_tensor is not None:
        if kind not in (None, "none"):
            raise CheckpointError(
                f"{path}: both rope_freqs.weight and rope.scaling.type {kind!r}; not supported"
            )
        if freqs_tensor.type_name != "F32" or freqs_tensor.n_elements != head_dim // 2:
            raise CheckpointError(
                f"{path}: tensor 'rope_freqs.weight' should be F32 with {head_dim // 2} values, got "
                f"{freqs_tensor.type_name} with {freqs_tensor.n_elements}"
            )
        factors = np.asarray(freqs_tensor.data, dtype=np.float64).reshape(-1)
        return _llama3_from_rope_freqs(path, factors, theta, head_dim, orig_ctx)
    if kind in (None, "none"):
        return None
    factor = meta.float(f"{arch}.rope.scaling.factor", required=True)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        if orig_ctx is not None:
            scaling["original_max_position_embeddings"] = orig_ctx
        return scaling
    raise CheckpointError(f"{path}: unsupported rope scaling type {kind!r}")


def _llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, orig: float):
    """Per-frequency divisors, as llama.cpp's converter computes them for Llama 3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _llama3_from_rope_freqs(path: Path, rf: np.ndarray, theta: float, head_dim: int, orig_ctx: int | None):
    """Recover Hugging Face llama3 `rope_scaling` from llama.cpp's rope_freqs tensor.

    The tensor only fixes the frequencies, not the parameters: scaling `original_max_position_embeddings`,
    `low_freq_factor` and `high_freq_factor` together gives the same tensor, so we keep the original context
    at 8192 (what llama.cpp assumes) and solve for the two factors; the result is checked to reproduce
    the tensor.
    """
    if not np.all(np.isfinite(rf)) or np.any(rf <= 0):
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' has non-positive or non-finite values")
    if np.allclose(rf, 1.0, rtol=1e-6, atol=0):
        return None
    orig = float(orig_ctx or _LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
    factor = float(rf.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = orig * inv_freq / (2 * math.pi)  # orig / wavelength, decreasing along the tensor
    is_high = np.isclose(rf, 1.0, rtol=1e-5, atol=0)
    is_low = np.isclose(rf, factor, rtol=1e-5, atol=0)
    mid = ~(is_high | is_low)
    x_low_max = float(x[is_low].max()) if is_low.any() else None  # low frequencies: x < low_freq_factor
    x_high_min = float(x[is_high].min()) if is_high.any() else None  # high frequencies: x > high_freq_factor

    candidates = [(1.0, 4.0)]  # Llama 3.1 / 3.2 values
    if mid.sum() >= 2:
        smooth = (1 / rf[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(x[mid], smooth, 1)
        if slope > 0:
            low = -intercept / slope
            candidates.append((low, low + 1 / slope))
    elif mid.sum() == 1:
        xm = float(x[mid][0])
        s = float((1 / rf[mid][0] - 1 / factor) / (1 - 1 / factor))
        if 0 < s < 1:
            lo_gap = xm - x_low_max if x_low_max is not None else math.inf
            hi_gap = (x_high_min - xm) * s / (1 - s) if x_high_min is not None else math.inf
            delta = 0.5 * min(lo_gap, hi_gap) if min(lo_gap, hi_gap) < math.inf else 0.5 * xm
            low = xm - delta
            candidates.append((low, low + delta / s))
    else:
        lo = x_low_max if x_low_max is not None else 0.0
        hi = x_high_min if x_high_min is not None else (lo + 1.0) * 4
        candidates.append((lo + (hi - lo) / 3, lo + 2 * (hi - lo) / 3))

    for low, high in candidates:
        if not (0 < low < high):
            continue
        if np.allclose(_llama3_factors(theta, head_dim, factor, low, high, orig), rf, rtol=1e-4, atol=1e-6):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": float(low),
                "high_freq_factor": float(high),
                "original_max_position_embeddings": int(orig),
            }
    raise CheckpointError(
        f"{path}: tensor 'rope_freqs.weight' does not match Llama 3 rope scaling; not supported"
    )
