"""oEngine's programs: the decode state's records, the bodies of the per-sequence programs (prefill a chunk,
seat a sequence, the decode forward), and the programs as (name, jitted program, example arguments): what
its compile() lowers and compiles in parallel, and what engines/program_inventory.py hands to a lowering
for TPU (the same list, on abstract arguments)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...models.paged_attention import PagedDecodeAttention, PagedPrefillAttention
from ..sampling import SlotSampling


class PagedState(NamedTuple):
    pages: tuple  # per layer (K, V) [num_pages + 1, page_size, kv_heads, head_dim] (see PagedAttentionCache)
    tokens: jax.Array  # i32[S] the token each slot feeds to its next decode step
    positions: jax.Array  # i32[S] where that token goes
    steps: jax.Array  # i32[S] the sampler's per-request step counter
    counts: jax.Array  # i32[S, V] generated-token counts (penalties)
    prompt_mask: jax.Array  # bool[S, V]
    sampling: SlotSampling


class SeqInputs(NamedTuple):
    """What sampling a sequence's first token needs; prepared on the device off the generate thread."""

    sampling: SlotSampling  # one row, carrying the sample's key
    prompt_mask: jax.Array  # bool[V]: tokens of the original prompt
    counts: jax.Array  # i32[V]: tokens generated before a preemption (zeros for a new request)
    step: jax.Array  # i32[]: the sampler step of the token sampled after this prefill


class SamplerRows(NamedTuple):
    """The decode state without its pages: all the samplers read and write. The masked programs of
    structured output take this (paged/structured_output.py), so warming them up needs no second KV cache."""

    tokens: jax.Array
    positions: jax.Array
    steps: jax.Array
    counts: jax.Array
    prompt_mask: jax.Array
    sampling: SlotSampling


def sampler_rows(state: PagedState) -> SamplerRows:
    return SamplerRows(*state[1:])


def with_rows(state: PagedState, rows: SamplerRows) -> PagedState:
    return PagedState(state.pages, *rows)


def prefill_impl(graphdef, params, pages, tokens, start, length, row, *, page_size: int, num_pages: int):
    """One chunk into its pages; returns the pages and the logits at the chunk's last valid token."""
    model = nnx.merge(graphdef, params)
    t = tokens.shape[0]
    positions = (start + jnp.arange(t, dtype=jnp.int32))[None]
    backend = PagedPrefillAttention(page_size, num_pages, window=model.config.sliding_window)
    hidden, pages = model(tokens[None], positions, backend, pages, (positions, length, row))
    last = jax.lax.dynamic_index_in_dim(hidden[0], length - start - 1, keepdims=False)
    return tuple(pages), model.compute_logits(last)


def forward_impl(
    graphdef,
    params,
    pages,
    tokens,
    positions,
    table,
    *,
    rows: int,
    page_size: int,
    num_pages: int,
    logits_sharding,
):
    """The model over the first ``rows`` slots reading ``num_pages`` page columns (cf. vEngine's forward)."""
    model = nnx.merge(graphdef, params)
    backend = PagedDecodeAttention(page_size, num_pages, window=model.config.sliding_window)
    pos = positions[:rows]
    hidden, pages = model(tokens[:rows, None], pos[:, None], backend, pages, (pos, table[:rows]))
    logits = model.compute_logits(hidden[:, 0])
    if logits_sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    return tuple(pages), logits


def step_metas(engine: Any) -> dict[tuple[int, int], np.ndarray]:
    """An all-idle metadata block per (rows, chunk tokens) mixed-step program (every page row scratch)."""
    return {rp: np.zeros(engine._layout(*rp).size, np.int32) for rp in engine._mixed}


def program_jobs(
    engine: Any, state: Any, inputs: Any, table: Any, place: Callable[[tuple, Any], Any]
) -> list[tuple[str, Any, tuple]]:
    """Every program of ``engine`` (an oEngine) a live request can hit, on ``state``, a sequence's
    ``inputs`` (SeqInputs) and the page ``table``; ``place(shape, dtype)`` makes a device argument (zeros
    on the device to compile, a jax.ShapeDtypeStruct to lower). The per-sequence prefill and decode
    programs only with ``legacy_programs``."""
    row, zero, v = np.zeros(engine.table_width, np.int32), np.int32(0), engine.model_config.vocab_size
    legacy = engine.legacy_programs
    jobs = [
        (
            f"prefill chunk {t} x {n} pages",
            engine._prefill[n],
            (engine.params, state.pages, np.ones(t, np.int32), zero, np.int32(t), row),
        )
        for t, n in (engine.prefill_shapes() if legacy else [])
    ]
    jobs.append(("seat", engine._seat, (state, place((v,), jnp.float32), zero, zero, inputs)))
    jobs += [
        (
            f"decode slots={r} x {n} pages",
            fn,
            (engine.params, state.pages, state.tokens, state.positions, table),
        )
        for (r, n), fn in (engine._forward.items() if legacy else [])
    ]
    metas = step_metas(engine)
    jobs += [
        (
            f"step rows={r} + {p} chunk tokens",
            fn,
            (engine.params, state.pages, state.tokens, state.positions, table, metas[(r, p)]),
        )
        for (r, p), fn in engine._mixed.items()
    ]
    k_logits = place((engine.step_seqs, v), jnp.float32)
    jobs.append(("seat after a chunk", engine._seat_chunk, (state, k_logits, zero, zero, zero, inputs)))
    jobs += [
        (f"sampler slots={r}", fn, (state, place((r, v), jnp.float32))) for r, fn in engine._sample.items()
    ]
    return jobs + engine.chunked.jobs()
