"""Reference paths that every faster implementation is checked against.

`logits` is a full forward with no cache. `greedy_generate` is the plainest prefill + cached decode loop.
Both run on right-padded batches; padding never changes a row's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .attention import DenseDecodeAttention, PrefillAttention
from .llama import LlamaForCausalLM


def pad_batch(prompts: Sequence[Sequence[int]], pad_id: int = 0, length: int | None = None):
    """Right-pad token lists -> (tokens [B, T] int32, lengths [B] int32)."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    t = int(length or lengths.max())
    tokens = np.full((len(prompts), t), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


@partial(jax.jit, static_argnums=(0,))
def _forward_all(graphdef, state, tokens, lengths, adapters=None):
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    backend = PrefillAttention(window=model.config.sliding_window)
    lora = None if adapters is None else jnp.broadcast_to(adapters[:, None], (b, t))
    caches = [None] * model.config.num_layers
    hidden, kv = model(tokens, positions, backend, caches, (positions, lengths), lora)
    return model.compute_logits(hidden), kv


def logits(model: LlamaForCausalLM, input_ids, lengths=None, adapters=None) -> np.ndarray:
    """Full-sequence logits [batch, seq, vocab] (float32). `lengths` marks right padding per row;
    `adapters` each row's LoRA bank slot (-1: none) on a model with a bank (models/lora.py)."""
    tokens = np.asarray(input_ids, np.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    lens = (
        np.full((tokens.shape[0],), tokens.shape[1], np.int32)
        if lengths is None
        else np.asarray(lengths, np.int32)
    )
    graphdef, state = nnx.split(model)
    extra = () if adapters is None else (jnp.asarray(adapters, jnp.int32),)
    out, _ = _forward_all(graphdef, state, jnp.asarray(tokens), jnp.asarray(lens), *extra)
    return np.asarray(out)


@partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _decode(graphdef, state, caches, tokens, positions):
    model = nnx.merge(graphdef, state)
    backend = DenseDecodeAttention(window=model.config.sliding_window)
    hidden, caches = model(tokens[:, None], positions[:, None], backend, caches, positions)
    return jnp.argmax(model.compute_logits(hidden[:, 0]), axis=-1).astype(jnp.int32), caches


def greedy_generate(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Greedy continuation of each prompt by prefill + cached decode; stops a row at an EOS id if given."""
    tokens, lengths = pad_batch(prompts)
    graphdef, state = nnx.split(model)
    all_logits, kv = _forward_all(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths))
    b, t = tokens.shape
    first = np.argmax(np.asarray(all_logits)[np.arange(b), lengths - 1], axis=-1).astype(np.int32)
    max_len = t + max_new_tokens
    caches = [
        tuple(jnp.zeros((b, max_len) + x.shape[2:], x.dtype).at[:, :t].set(x) for x in layer) for layer in kv
    ]
    out = [[int(x)] for x in first]
    cur, pos = jnp.asarray(first), jnp.asarray(lengths)
    for _ in range(max_new_tokens - 1):
        cur, caches = _decode(graphdef, state, caches, cur, pos)
        pos = pos + 1
        for row, tok in zip(out, np.asarray(cur), strict=True):
            row.append(int(tok))
    if eos_token_ids:
        eos = set(eos_token_ids)
        out = [row[: next((i + 1 for i, x in enumerate(row) if x in eos), len(row))] for row in out]
    return out


def greedy_by_recompute(model: LlamaForCausalLM, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by a full forward over the whole sequence at every step (no cache).

    The row is padded to its final length so one compiled shape serves every step.
    """
    seq = list(prompt)
    total = len(prompt) + max_new_tokens
    for _ in range(max_new_tokens):
        tokens, lengths = pad_batch([seq], length=total)
        seq.append(int(np.argmax(logits(model, tokens, lengths)[0, len(seq) - 1])))
    return seq[len(prompt) :]
