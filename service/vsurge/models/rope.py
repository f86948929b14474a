"""Rotary position embeddings (default, linear and Llama 3 frequency scaling), computed from positions."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from .config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair rotation frequencies, float32, as transformers computes them."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv = inv.astype(np.float32)
    p = cfg.rope_params
    kind = p.get("rope_type", "default")
    if kind == "linear":
        inv = inv / np.float32(p["factor"])
    elif kind == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_ctx = p["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """Rotate x [B, T, heads, head_dim] by positions [B, T] (rotate-half layout of HF checkpoints)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
