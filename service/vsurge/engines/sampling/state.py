"""The sampler's per-slot state: `SlotSampling` (device arrays, one row per slot), `SampleResult`, and the
host / device helpers that build and update them. See `vsurge.engines.sampling` for the step itself."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vsurge.contracts.sampling_params import MAX_ALLOWED_TOKEN_IDS, SamplingParams

from ...structured.bitmask import bitmask_words

# Temperatures below this are greedy (vLLM's convention); dividing by them would only amplify noise.
GREEDY_EPS = 1e-5
DEFAULT_CANDIDATE_CAP = 64
DEFAULT_MAX_STOP_IDS = 8
DEFAULT_MAX_BIAS_IDS = MAX_ALLOWED_TOKEN_IDS
_KEY_IMPL = "threefry2x32"
# num_logprobs of a slot that asked for none (idle slots too): its step computes no logprob at all.
NO_LOGPROBS = -1


class SlotSampling(NamedTuple):
    """Per-slot sampling parameters as device arrays (leading dim S = number of slots)."""

    temperature: jax.Array  # f32[S]; < GREEDY_EPS means greedy
    top_p: jax.Array  # f32[S]; 1 = off
    top_k: jax.Array  # i32[S]; 0 = off
    min_p: jax.Array  # f32[S]; 0 = off
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]
    repetition_penalty: jax.Array  # f32[S]; 1 = off
    key: jax.Array  # u32[S, 2]; raw threefry2x32 key data, see `seed_key_data`
    min_tokens: jax.Array  # i32[S]; stop_ids are suppressed while step < min_tokens
    stop_ids: jax.Array  # i32[S, E]; ids that would end the request (EOS, stop_token_ids), -1 padded
    bias_ids: jax.Array  # i32[S, B]; ids named by logit_bias or allowed_token_ids, -1 padded
    bias_vals: jax.Array  # f32[S, B]; the bias of each (0 for an allowed id without one)
    restrict: jax.Array  # bool[S]; True: only bias_ids may be sampled (allowed_token_ids)
    # i32[S]: the logprobs the slot's request asked for: -1 none, 0 the chosen token's, k > 0 also the top k
    # (`make_slot_sampling` sets it from SamplingParams.logprobs / top_logprobs). A step where no slot asks
    # computes none of them. None (a SlotSampling built by hand without it): computed every step.
    num_logprobs: jax.Array | None = None
    # i32[S]: the LoRA bank slot of the slot's request (-1: the base model). The sampler never reads it; it
    # rides here because every insert, seat and slot move already copies a request's row of this state,
    # and vEngine's programs read it for the model's per-row adapter (models/lora.py)
    lora: jax.Array | None = None


class SampleResult(NamedTuple):
    tokens: jax.Array  # i32[S]
    logprob: jax.Array  # f32[S]; raw-model logprob of the chosen token (0 where no slot asked for one)
    top_ids: jax.Array  # i32[S, K] (0 where no slot asked for top logprobs)
    top_logprobs: jax.Array  # f32[S, K]


# --------------------------------------------------------------------------------------------- host helpers


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def seed_key_data(seed: int | None, sample_index: int = 0) -> np.ndarray:
    """Key material (u32[2]) for one sample of a request.

    Pure Python so the host never dispatches a device op per request. ``sample_index`` separates the n
    samples of one request that share a seed. ``seed=None`` draws fresh OS entropy.
    """
    if seed is None:
        return np.frombuffer(os.urandom(8), dtype=np.uint32).copy()
    mixed = _splitmix64((seed & 0xFFFFFFFFFFFFFFFF) ^ _splitmix64(sample_index))
    return np.array([mixed >> 32, mixed & 0xFFFFFFFF], dtype=np.uint32)


def slot_num_logprobs(p: SamplingParams | None) -> int:
    """The `SlotSampling.num_logprobs` value of a request: -1 when it asked for no logprobs."""
    if p is None or not p.logprobs:
        return NO_LOGPROBS
    return int(p.top_logprobs)


# Fields make_slot_sampling does not copy from SamplingParams by name.
_DERIVED = ("key", "stop_ids", "bias_ids", "bias_vals", "restrict", "num_logprobs", "lora")


def make_slot_sampling(
    params: Sequence[SamplingParams | None],
    keys: Sequence[np.ndarray] | None = None,
    stop_ids: Sequence[Sequence[int]] | None = None,
    max_stop_ids: int = DEFAULT_MAX_STOP_IDS,
    max_bias_ids: int = DEFAULT_MAX_BIAS_IDS,
    adapters: Sequence[int] | None = None,
) -> SlotSampling:
    """Build a `SlotSampling` from host values; ``None`` entries are idle slots (greedy, no penalties).

    ``keys[i]`` defaults to ``seed_key_data(params[i].seed)``; ``stop_ids[i]`` lists the token ids that end
    request i (EOS unless ignore_eos, plus stop_token_ids), used only to enforce min_tokens on device;
    ``adapters[i]`` its LoRA bank slot (default -1: the base model).
    """
    n = len(params)
    # Idle slots: greedy (the cheapest path), neutral filters / penalties, no logprobs.
    cols: dict[str, np.ndarray] = {
        "temperature": np.zeros(n, np.float32),
        "top_p": np.ones(n, np.float32),
        "top_k": np.zeros(n, np.int32),
        "min_p": np.zeros(n, np.float32),
        "presence_penalty": np.zeros(n, np.float32),
        "frequency_penalty": np.zeros(n, np.float32),
        "repetition_penalty": np.ones(n, np.float32),
        "key": np.zeros((n, 2), np.uint32),
        "min_tokens": np.zeros(n, np.int32),
        "stop_ids": np.full((n, max_stop_ids), -1, np.int32),
        "bias_ids": np.full((n, max_bias_ids), -1, np.int32),
        "bias_vals": np.zeros((n, max_bias_ids), np.float32),
        "restrict": np.zeros(n, bool),
        "num_logprobs": np.full(n, NO_LOGPROBS, np.int32),
        "lora": np.full(n, -1, np.int32),
    }
    if adapters is not None:
        cols["lora"][: len(adapters)] = adapters
    for i, p in enumerate(params):
        if keys is not None:
            cols["key"][i] = keys[i]
        elif p is not None and p.seed is not None:
            # unseeded: a fixed placeholder; an engine never draws entropy itself (each process of a
            # multi-host group would draw its own): the request's key is drawn once with the request
            # (ActiveRequest.keys) and passed where it samples
            cols["key"][i] = seed_key_data(p.seed)
        if p is None:
            continue
        for name in SlotSampling._fields:
            if name not in _DERIVED:
                cols[name][i] = getattr(p, name)
        bias = _bias_row(p)
        if len(bias) > max_bias_ids:
            raise ValueError(f"logit_bias / allowed_token_ids of slot {i}: at most {max_bias_ids} ids")
        if bias:
            cols["bias_ids"][i, : len(bias)] = list(bias)
            cols["bias_vals"][i, : len(bias)] = list(bias.values())
        cols["restrict"][i] = p.allowed_token_ids is not None
        cols["num_logprobs"][i] = slot_num_logprobs(p)
        ids = list(stop_ids[i]) if stop_ids is not None else []
        if len(ids) > max_stop_ids:
            raise ValueError(f"stop_ids of slot {i}: at most {max_stop_ids} ids, got {len(ids)}")
        cols["stop_ids"][i, : len(ids)] = ids
    return SlotSampling(**jax.device_put(cols))


def _bias_row(p: SamplingParams) -> dict[int, float]:
    """The slot's sparse row: allowed ids (bias 0) and logit_bias entries, each id once.

    With allowed_token_ids, every id in the row counts as allowed (``restrict``), so a logit_bias entry for an
    id outside the allowed set is dropped: it can never be sampled, and listing it would allow it."""
    row = dict.fromkeys(p.allowed_token_ids or (), 0.0)
    bias = {int(t): float(b) for t, b in (p.logit_bias or {}).items()}
    row.update(bias if p.allowed_token_ids is None else {t: b for t, b in bias.items() if t in row})
    return row


def set_slot(sampling: SlotSampling, slot: int | jax.Array, row: SlotSampling) -> SlotSampling:
    """Write a one-slot `SlotSampling` (leading dim 1) into ``slot``; jit-friendly (in place if donated)."""
    return SlotSampling(
        *(a if a is None else a.at[slot].set(r[0]) for a, r in zip(sampling, row, strict=True))
    )


# ------------------------------------------------------------------------------------ device state helpers


def update_counts(
    generated_counts: jax.Array, tokens: jax.Array, valid: jax.Array | None = None
) -> jax.Array:
    """Add the tokens just sampled (i32[S]) to the per-slot counts (i32[S, V]).

    A scatter-add of S elements: in place when the caller's jit donates ``generated_counts``. ``valid``
    (bool[S]) skips idle slots.
    """
    s = generated_counts.shape[0]
    inc = jnp.ones((s,), generated_counts.dtype) if valid is None else valid.astype(generated_counts.dtype)
    return generated_counts.at[jnp.arange(s), tokens].add(inc, mode="drop")


def prompt_mask_from_tokens(tokens: jax.Array, length: jax.Array | int, vocab_size: int) -> jax.Array:
    """bool[V] (tokens i32[L]) or bool[B, V] (tokens i32[B, L], length i32[B]) marking prompt tokens.

    Positions at or beyond ``length`` (bucket padding) are ignored.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim == 1:
        return prompt_mask_from_tokens(tokens[None], jnp.reshape(jnp.asarray(length), (1,)), vocab_size)[0]
    b, seq = tokens.shape
    valid = jnp.arange(seq)[None, :] < jnp.reshape(jnp.asarray(length), (-1, 1))
    # Invalid positions scatter to index V, which mode="drop" discards.
    ids = jnp.where(valid, tokens, vocab_size)
    return jnp.zeros((b, vocab_size), bool).at[jnp.arange(b)[:, None], ids].set(True, mode="drop")


def prompt_mask_words(prompts: Sequence[Sequence[int]], rows: int, vocab_size: int) -> np.ndarray:
    """The prompt masks of ``prompts`` (row j: prompt j; rows past them empty) packed on the host as
    i32[rows, ceil(V/32)], bit t % 32 of word t // 32 set <=> token t occurs in the prompt: what a
    prefill hands the device, which unpacks it (`sampling/penalties.unpack_token_mask`). Built on the
    device from the tokens it was a scatter into [rows, V], the slowest part of a prefill's programs
    to compile on a TPU (~5 s of a v5e's XLA time per prefill shape, next to a decoder layer's 2-5 s)."""
    words = np.zeros((rows, bitmask_words(vocab_size)), np.uint32)
    for j, prompt in enumerate(prompts):
        ids = np.asarray(prompt, np.int64)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        np.bitwise_or.at(words[j], ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    return words.view(np.int32)
