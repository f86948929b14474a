"""vEngine's programs: the state they carry (GenerationState, Prefix) and the bodies vEngine jits.

Pure functions of (graphdef, params, state, ...): vEngine binds them with functools.partial and jax.jit,
one program per shape (vengine.py); the decode block (decode_block.py) runs the decode body K times.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ...models.attention import DenseDecodeAttention, kv_store, to_flat
from ...models.lora import has_bank
from ...models.target import target_backend
from ..engine_base import constrain, sample_first_token, sample_step, start_slot
from ..sampling import SlotSampling, sample, sharded_sampling
from ..sampling.penalties import unpack_token_mask


class GenerationState(NamedTuple):
    caches: tuple[tuple[jax.Array, jax.Array], ...]  # per layer K, V [slots, max_length, kv_heads * head_dim]
    tokens: jax.Array  # i32[S] the token each slot feeds to its next decode step
    positions: jax.Array  # i32[S] where that token goes (the slot's current length)
    steps: jax.Array  # i32[S] tokens generated so far: the sampler's per-request step counter
    counts: jax.Array  # i32[S, V] generated-token counts (presence / frequency / repetition penalties)
    prompt_mask: jax.Array  # bool[S, V] tokens of the prompt (repetition penalty)
    sampling: SlotSampling


class Prefix(NamedTuple):
    """Prompts prefilled in one call, packed one after another in the rows of a prefill shape: one row of
    a bucket, or several rows of prefill_pack_tokens (prefill_rows.py).

    Entry j (j < max_concurrent_prefill) is inserted into a slot by its index; unused entries have
    length 0. Logits are computed at insert from the last hidden state, only for the entries used.
    """

    kv: tuple[tuple[jax.Array, jax.Array], ...]  # per layer k, v [rows, row length, kv_heads, head_dim]
    hidden: jax.Array  # [K, hidden] final hidden state at each prompt's last token
    starts: jax.Array  # i32[K] where each prompt begins: row * row length + offset in the row
    lengths: jax.Array  # i32[K] prompt lengths (0: unused entry)
    prompt_mask: jax.Array  # bool[K, V]
    sampling: SlotSampling  # K rows


def _long_prefix_impl(kv, last, words, length, sampling, *, entries: int, vocab: int):
    """A chunked prefill's row as entry 0 of a Prefix (the other entries unused), so insert and the
    first-token sampler serve it like any pack; ``words``: the prompt mask packed on the host
    (`sampling/state.prompt_mask_words`)."""
    hidden = jnp.zeros((entries, last.shape[-1]), last.dtype).at[0].set(last)
    starts = jnp.zeros((entries,), jnp.int32)
    lengths = jnp.zeros((entries,), jnp.int32).at[0].set(length)
    mask = unpack_token_mask(words, vocab)
    return Prefix(tuple((k[None], v[None]) for k, v in kv), hidden, starts, lengths, mask, sampling)


def _entry(rows: SlotSampling, j, key) -> SlotSampling:
    return SlotSampling(*(a[j][None] for a in rows))._replace(key=key[None])


def _first_impl(
    graphdef, params, hidden, rows, prompt_mask, j, key, token_mask=None, *, num_top: int, logits_sharding
):
    """Sample entry j's first token from its last hidden state (one program for every bucket);
    ``token_mask`` (i32[1, ceil(V/32)]): a structured request's first allowed tokens."""
    model = nnx.merge(graphdef, params)
    return sample_first_token(
        model,
        hidden[j][None],
        _entry(rows, j, key),
        prompt_mask[j][None],
        num_top=num_top,
        logits_sharding=logits_sharding,
        token_mask=token_mask,
    )


def _firsts_impl(graphdef, params, hidden, rows, prompt_mask, js, keys, *, num_top: int, logits_sharding):
    """The first tokens of entries js (i32[M]) with keys (u32[M, 2]), in one program: the logits read
    the embedding once for all of them (a pack's first tokens, or one entry's repeated)."""
    model = nnx.merge(graphdef, params)
    logits = model.compute_logits(hidden[js])
    if logits_sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    picked = SlotSampling(*(a[js] for a in rows))._replace(key=keys)
    with sharded_sampling() if logits_sharding is not None else contextlib.nullcontext():
        return sample(logits, picked, None, prompt_mask[js], jnp.zeros(js.shape, jnp.int32), num_top)


def _insert_impl(prefix: Prefix, state: GenerationState, j, slot, key, first_token, *, shardings):
    # entry j's whole row, shifted so the entry starts at position 0; what follows the prompt is never
    # read (decode writes position p before attending to positions <= p)
    t = prefix.kv[0][0].shape[1]
    row, at = prefix.starts[j] // t, prefix.starts[j] % t
    # a chunked prefill's row may be longer than the cache (rounded up to whole chunks)
    src = jnp.minimum(at + jnp.arange(min(t, state.caches[0][0].shape[1])), t - 1)

    def entry(x):  # [1, M, KVH * D]: the cache's flat rows
        return to_flat(jnp.take(jax.lax.dynamic_index_in_dim(x, row, 0, keepdims=False), src, axis=0))[None]

    caches = tuple(
        (
            jax.lax.dynamic_update_slice(kc, kv_store(entry(k), kc.dtype), (slot, 0, 0)),
            jax.lax.dynamic_update_slice(vc, kv_store(entry(v), vc.dtype), (slot, 0, 0)),
        )
        for (kc, vc), (k, v) in zip(state.caches, prefix.kv, strict=True)
    )
    state = state._replace(caches=caches, prompt_mask=state.prompt_mask.at[slot].set(prefix.prompt_mask[j]))
    new = start_slot(state, slot, first_token, prefix.lengths[j], _entry(prefix.sampling, j, key))
    return constrain(new, shardings)


def _decode_impl(
    graphdef, params, state: GenerationState, lengths, *, rows: int, logits_sharding, num_top, shardings
):
    """One step over the first `rows` slots (slots are handed out lowest first): the model, reading
    `lengths[s]` cache positions of row s (its sequence + 1; 0 for an idle slot), then the sampler. One
    program, so the logits never leave it (~7% of a 32-row step when they did)."""
    state, logits = _forward_impl(
        graphdef, params, state, lengths, rows=rows, logits_sharding=logits_sharding
    )
    return sample_step(state, logits, rows=rows, num_top=num_top, shardings=shardings)


def _forward_impl(graphdef, params, state: GenerationState, lengths, *, rows: int, logits_sharding):
    """The model half of a decode step: (state with the new KV, logits f32[rows, V]). Structured output
    runs it apart from the sampler, so the host fills the token mask while the device runs the model."""
    model = nnx.merge(graphdef, params)
    backend = DenseDecodeAttention(window=model.config.sliding_window)
    pos = state.positions[:rows]
    lora = state.sampling.lora[:rows, None] if has_bank(model) else None  # each row's adapter
    hidden, caches = model(
        state.tokens[:rows, None], pos[:, None], backend, state.caches, (pos, lengths), lora
    )
    logits = model.compute_logits(hidden[:, 0])
    if logits_sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    return state._replace(caches=tuple(tuple(c) for c in caches)), logits


def resolve_decode_steps(steps: int | None, backend: str | None = None) -> int:
    """decode_steps left unset: 4 on TPU (a ~5 ms step is shorter than the host's work per token of 64
    streams), 1 elsewhere (XLA:CPU steps take 100+ ms: the host keeps up, and tokens stream one by one)."""
    if steps is not None:
        return steps
    return 4 if (backend or target_backend()) == "tpu" else 1
