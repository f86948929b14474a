"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) in flax.nnx, written for serving.

The forward takes token ids, their positions, an attention backend and one cache per layer; it returns
the final hidden states and the new caches. Prefill, cached decode and paged decode are the same forward
with different backends (see attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .lora import lora_delta
from .quantization import check_quantization, embed_rows, int8_matmul
from .registry import register_architecture
from .rope import apply_rope, inverse_frequencies
from .sharding import LLAMA_RULES


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jnp.ndarray:
    return (0.02 * jax.random.normal(rngs.params(), shape)).astype(dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias). quantization="int8": the kernel is int8 [in, out] with `scale` [G, out]
    (models/quantization.py); the loader fills both."""

    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs, quantization: str = "none"):
        if quantization == "int8":
            self.kernel = nnx.Param(jnp.zeros((din, dout), jnp.int8))
            self.scale = nnx.Param(jnp.ones((1, dout), jnp.float32))
        else:
            self.kernel = nnx.Param(_init(rngs, (din, dout), dtype))
            self.scale = None
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x: jnp.ndarray, lora: jnp.ndarray | None = None) -> jnp.ndarray:
        """``lora``: each token's adapter bank slot (x's leading shape; -1 none), read only when the
        engine attached a bank (models/lora.py); None or no bank: the plain projection."""
        if self.scale is not None:
            y = int8_matmul(x, self.kernel[...], self.scale[...]).astype(x.dtype)
        else:
            k = self.kernel[...]  # a bfloat16 copy of float32 weights: the input is cast to it (vengine.py)
            y = jnp.dot(x.astype(k.dtype), k, preferred_element_type=jnp.float32).astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...]
        bank = getattr(self, "lora_a", None)
        if bank is not None and lora is not None:
            y = y + lora_delta(x, lora, bank[...], self.lora_b[...])
        return y


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        # transformers multiplies in the input dtype after casting back; do the same for bf16 parity
        return self.weight[...] * xf.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quantization: str = "none"):
        d, hd = cfg.hidden_size, cfg.head_dim
        lin = dict(dtype=dtype, rngs=rngs, quantization=quantization)
        self.q_proj = Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias, **lin)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, **lin)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, **lin)
        self.o_proj = Linear(cfg.num_heads * hd, d, bias=cfg.o_bias, **lin)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.cfg = cfg

    def __call__(self, x, positions, backend, cache, meta, lora=None):
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x, lora).reshape(b, t, c.num_heads, c.head_dim)
        k = self.k_proj(x, lora).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x, lora).reshape(b, t, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = inverse_frequencies(c)  # numpy at trace time: a constant in the compiled program
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        out, cache = backend(q, k, v, cache, meta)
        return self.o_proj(out.reshape(b, t, c.num_heads * c.head_dim), lora), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quantization: str = "none"):
        d, i = cfg.hidden_size, cfg.intermediate_size
        lin = dict(bias=cfg.mlp_bias, dtype=dtype, rngs=rngs, quantization=quantization)
        self.gate_proj = Linear(d, i, **lin)
        self.up_proj = Linear(d, i, **lin)
        self.down_proj = Linear(i, d, **lin)

    def __call__(self, x, lora=None):
        h = jax.nn.silu(self.gate_proj(x, lora)) * self.up_proj(x, lora)
        return self.down_proj(h, lora)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quantization: str = "none"):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, quantization)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs, quantization)

    def __call__(self, x, positions, backend, cache, meta, lora=None):
        h, cache = self.self_attn(self.input_layernorm(x), positions, backend, cache, meta, lora)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), lora), cache


class Embed(nnx.Module):
    """The token table [vocab, hidden]; int8: per-row `scale` [vocab, G] (also the tied lm_head's scale)."""

    def __init__(self, vocab: int, dim: int, dtype, rngs: nnx.Rngs, quantization: str = "none"):
        if quantization == "int8":
            self.embedding = nnx.Param(jnp.zeros((vocab, dim), jnp.int8))
            self.scale = nnx.Param(jnp.ones((vocab, 1), jnp.float32))
        else:
            self.embedding = nnx.Param(_init(rngs, (vocab, dim), dtype))
            self.scale = None
        self.dtype = dtype

    def __call__(self, ids):
        if self.scale is not None:
            return embed_rows(self.embedding[...], self.scale[...], ids, self.dtype)
        return jnp.take(self.embedding[...], ids, axis=0)


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quantization: str = "none"):
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype, rngs, quantization)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, quantization) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


def _one_traced_layer(layers, positions, backend, meta, lora):
    """Every decoder layer has the same structure and shapes: the layer is traced once and its equations
    are inlined for each layer (`jax.jit(inline=True)`), so the program is the unrolled stack, as if each
    layer were traced (tracing the default model's 30 layers was most of a warm start: lowering 9.4 ->
    3.3 s on CPU). Not a call per layer: XLA inlines calls too, but on a TPU that program's decode step
    ran 3.2-3.9% slower than the unrolled one (1b64, batch 64, A/B on one v5e)."""
    graphdef = nnx.graphdef(layers[0])

    def apply(state, x, cache):
        return nnx.merge(graphdef, state)(x, positions, backend, cache, meta, lora)

    return jax.jit(apply, inline=True)


class LlamaForCausalLM(nnx.Module):
    """Causal LM. ``__call__`` returns hidden states; ``compute_logits`` turns chosen rows into logits."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, quantization: str = "none"):
        self.config = cfg
        self.dtype = dtype  # the activations' dtype (also the weights' unless quantized)
        self.quantization = check_quantization(quantization)
        self.model = LlamaModel(cfg, dtype, rngs, self.quantization)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(
                cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs, quantization=quantization
            )
        )

    def __call__(
        self,
        tokens: jnp.ndarray,
        positions: jnp.ndarray,
        backend: Any,
        caches: Sequence[Any],
        meta: Any,
        lora: jnp.ndarray | None = None,
    ) -> tuple[jnp.ndarray, list[Any]]:
        """``lora``: i32, the shape of ``tokens``: each token's adapter bank slot (-1: the base model);
        None: no adapter anywhere (what every program passes when the engine has no bank)."""
        x = self.model.embed_tokens(tokens)
        layers = self.model.layers
        run = _one_traced_layer(layers, positions, backend, meta, lora)
        new_caches = []
        for layer, cache in zip(layers, caches, strict=True):
            x, cache = run(nnx.state(layer), x, cache)
            new_caches.append(cache)
        return self.model.norm(x), new_caches

    def compute_logits(self, hidden: jnp.ndarray) -> jnp.ndarray:
        if self.lm_head is None:
            embed = self.model.embed_tokens
            w = embed.embedding[...]
            if embed.scale is not None:  # tied and int8: the table [vocab, hidden] contracted over hidden
                return int8_matmul(hidden, w, embed.scale[...], axis=1)
            # contracted in place: `hidden @ w.T` made XLA:CPU copy the whole table transposed every decode
            # step (113 MB for the 135M model's [49152, 576])
            dims = (((hidden.ndim - 1,), (1,)), ((), ()))
            return jax.lax.dot_general(hidden, w, dims, preferred_element_type=jnp.float32)
        if self.lm_head.scale is not None:
            return int8_matmul(hidden, self.lm_head.kernel[...], self.lm_head.scale[...])
        w = self.lm_head.kernel[...]  # bfloat16 copy of a float32 head: the input is cast (vengine.py)
        return jnp.dot(hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)


# The family: one model class for four model_types, differing only in their configs.
register_architecture("llama", LlamaForCausalLM, LLAMA_RULES, gguf_architecture="llama")
register_architecture(
    "mistral",  # llama.cpp stores Mistral as `llama`: gguf/config.py tells them apart by the model name
    LlamaForCausalLM,
    LLAMA_RULES,
    hf_architecture="MistralForCausalLM",
    o_bias=False,
    sliding_window_always=True,
)
register_architecture(
    "qwen2",
    LlamaForCausalLM,
    LLAMA_RULES,
    hf_architecture="Qwen2ForCausalLM",
    gguf_architecture="qwen2",
    qkv_bias=True,
    o_bias=False,
)
register_architecture(
    "qwen3",
    LlamaForCausalLM,
    LLAMA_RULES,
    hf_architecture="Qwen3ForCausalLM",
    gguf_architecture="qwen3",
    qk_norm=True,
)
