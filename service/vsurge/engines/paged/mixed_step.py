"""oEngine's mixed step: every decoding row and up to K prefill chunks in one forward over a flat token batch.

The batch is ``R`` decode rows (slots 0..R-1, one token each, their tokens and positions read from the
decode state on the device, so step n+1 is dispatched before step n's tokens reach the host) followed by
``P`` prefill tokens: the chunks of up to ``K`` sequences, back to back. Attention sees it the way the
ragged paged attention kernel does (models/paged_attention.py, `PagedRaggedAttention`): per sequence a
kv_len, a page row and its slice of the queries (cu_q_lens). (R, P) come from a few static buckets, all
compiled at start-up; how many pages a step reads is decided at run time inside the page walks, so it
needs no bucket of its own.

What the host sends per step is one small int32 vector (`pack_meta`): the chunk tokens, their kv_lens,
cu_q_lens and page rows (K x table width), and which of the R rows decode. Nothing in it grows with the
number of pages in use; the decode page table lives on the device and is re-sent only when it changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...models.lora import has_bank
from ...models.paged_attention import PagedRaggedAttention, ragged_token_layout


def plan_chunks(
    remaining: list[int], decoding: int, budget: int, max_seqs: int, max_tokens: int | None = None
) -> list[int]:
    """Chunk lengths for the prefilling sequences (``remaining``: prompt tokens left, oldest first) in a
    step of ``budget`` tokens of which ``decoding`` go to decode rows: oldest first, each as much as is
    left of the budget, at most ``max_seqs`` sequences. The sum never exceeds ``budget - decoding``, nor
    ``max_tokens`` (the largest chunk-token shape of a step) when given."""
    left, out = budget - decoding, []
    if max_tokens is not None:
        left = min(left, max_tokens)
    for r in remaining[:max_seqs]:
        if left <= 0 or r <= 0:
            break
        out.append(min(r, left))
        left -= out[-1]
    return out


class ChunkWork(NamedTuple):
    """One sequence's prefill chunk in a mixed step."""

    tokens: np.ndarray  # i32: the chunk's tokens
    start: int  # position of its first token
    row: np.ndarray  # i32[W]: the sequence's page row (scratch-padded)
    slot: int  # the decode slot the sequence is seated in after its final chunk
    inputs: Any = None  # SeqInputs for a final chunk (its first token is sampled); None otherwise
    adapter: int = -1  # the sequence's LoRA bank slot (-1: the base model)
    # structured output: i32[1, ceil(V/32)], the allowed first tokens of a final chunk (None: any)
    token_mask: Any = None

    @property
    def final(self) -> bool:
        return self.inputs is not None


class MetaLayout(NamedTuple):
    """Offsets of the parts of the per-step int32 vector for one (R, P) program."""

    rows: int  # R decode rows
    tokens: int  # P prefill token slots
    seqs: int  # K chunk slots
    width: int  # W page-table columns
    # with a LoRA bank: the R rows' and the K chunks' bank slots follow (absent without: the vector and
    # the programs are those of before)
    lora: bool = False

    @property
    def base(self) -> int:
        """The size of the parts every step has."""
        return self.tokens + self.seqs + (self.seqs + 1) + self.seqs * self.width + self.rows + 1

    @property
    def size(self) -> int:
        return self.base + (self.rows + self.seqs if self.lora else 0)

    def adapters(self, meta: jax.Array) -> jax.Array:
        """i32[R + K]: the bank slot of each sequence of the step (decode rows, then chunks)."""
        return meta[self.base : self.base + self.rows + self.seqs]

    def split(self, meta: jax.Array) -> tuple[jax.Array, ...]:
        """(tokens [P], kv_lens [K], cu [K+1], rows [K, W], active [R], num_chunks [1])."""
        p, k, w, r = self.tokens, self.seqs, self.width, self.rows
        o = np.cumsum([0, p, k, k + 1, k * w, r, 1])
        part = [meta[o[i] : o[i + 1]] for i in range(6)]
        part[3] = part[3].reshape(k, w)
        return tuple(part)


def pack_meta(
    layout: MetaLayout,
    chunks: Sequence[ChunkWork],
    active: np.ndarray,
    row_adapters: np.ndarray | None = None,
) -> np.ndarray:
    """The host side of a step: chunks back to back, then their metadata, then the decoding rows' mask;
    with LoRA, each row's bank slot (``row_adapters``, by slot) and each chunk's."""
    p, k, w, r = layout.tokens, layout.seqs, layout.width, layout.rows
    if len(chunks) > k:
        raise ValueError(f"{len(chunks)} chunks in a step that packs at most {k}")
    out = np.zeros(layout.size, np.int32)
    kv, cu, rows = out[p : p + k], out[p + k : p + 2 * k + 1], out[p + 2 * k + 1 : p + 2 * k + 1 + k * w]
    rows = rows.reshape(k, w)
    at = 0
    for i, c in enumerate(chunks):
        n = len(c.tokens)
        out[at : at + n] = c.tokens
        at += n
        kv[i] = c.start + n
        rows[i] = c.row
        cu[i + 1] = at
    if at > p:
        raise ValueError(f"{at} chunk tokens in a step of {p}")
    cu[len(chunks) + 1 :] = at
    end = layout.base
    out[end - 1 - r : end - 1] = active[:r]
    out[end - 1] = len(chunks)
    if layout.lora:
        out[end : end + r] = -1 if row_adapters is None else row_adapters[:r]
        out[end + r : end + r + k] = -1
        out[end + r : end + r + len(chunks)] = [c.adapter for c in chunks]
    return out


def mixed_forward(
    graphdef, params, pages, tokens, positions, table, meta, *, layout: MetaLayout, page_size: int
):
    """The model over R decode rows and P chunk tokens. Returns (pages, decode logits [R, V] or None,
    logits at each chunk's last token [K, V])."""
    model = nnx.merge(graphdef, params)
    r = layout.rows
    pf_tokens, pf_kv, pf_cu, pf_rows, active, num_chunks = layout.split(meta)
    dec_kv = jnp.where(active > 0, positions[:r] + 1, 0)
    kv_lens = jnp.concatenate([dec_kv, pf_kv])
    page_indices = jnp.concatenate([table[:r], pf_rows], axis=0)
    cu_q_lens = jnp.concatenate([jnp.arange(r, dtype=jnp.int32), r + pf_cu])
    num_seqs = r + num_chunks
    flat = jnp.concatenate([tokens[:r], pf_tokens])
    seq, pos = ragged_token_layout(kv_lens, cu_q_lens, num_seqs, flat.shape[0])
    backend = PagedRaggedAttention(page_size, num_decode=r, window=model.config.sliding_window)
    lora = None
    if layout.lora and has_bank(model):  # each token's adapter: its sequence's (padding: none)
        lora = jnp.concatenate([layout.adapters(meta), jnp.full((1,), -1, jnp.int32)])[seq][None]
    hidden, pages = model(
        flat[None],
        jnp.maximum(pos, 0)[None],
        backend,
        pages,
        (kv_lens, page_indices, cu_q_lens, num_seqs),
        lora,
    )
    hidden = hidden[0]
    dec_logits = model.compute_logits(hidden[:r]) if r else None
    if not layout.tokens:
        return tuple(pages), dec_logits, None
    last = r + jnp.maximum(pf_cu[1:] - 1, 0)
    return tuple(pages), dec_logits, model.compute_logits(hidden[last])


def seat_chunk(state, logits, k, slot, length, inputs, token_mask=None, *, seat):
    """Sample the token after chunk ``k`` of a step and seat its sequence (``seat``: oEngine's), under
    ``token_mask`` when given (structured output)."""
    return seat(state, logits[k], slot, length, inputs, token_mask)
