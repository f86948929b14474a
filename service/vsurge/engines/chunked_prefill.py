"""Chunk-by-chunk prefill of one sequence into a dense row: prompts longer than the largest prefill bucket,
and prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` + `logprobs`).

A prompt of n tokens runs as chunks of at most `max_prefill_length` tokens, each padded to one of two
chunk buckets (the smallest prefill bucket of at least 128 tokens, and the largest: each bucket is
programs to compile, and a short chunk padded to 128 tokens costs little); chunk i starts at
i * max_prefill_length and attends to the row written by the chunks before it (`ChunkAttention`), one
decoder layer per program (layered_chunk.py). The row is `round_up(max_length, max_prefill_length)`
long, so no chunk's write is ever clamped. Per chunk, when asked, one more program turns the chunk's hidden states into the logprob of
each next prompt token and the top `MAX_TOP_LOGPROBS`: the normal prefill never pays for logits at every
position. Every (bucket) shape is compiled with the engine; both engines use this (vEngine also inserts the
row into a slot; oEngine only scores).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ..contracts.request import TokenLogprob
from ..contracts.sampling_params import MAX_TOP_LOGPROBS
from ..models.lora import has_bank
from .aot_program import program
from .layered_chunk import LayeredChunk
from .sampling import _top_k, sharded_sampling

Rows = tuple[tuple[jax.Array, jax.Array], ...]
SMALL_CHUNK = 128


def _logprobs_impl(graphdef, params, hidden, targets, *, sharded: bool):
    """Raw-model logprob of targets[t] after position t, and the top MAX_TOP_LOGPROBS, for one chunk."""
    model = nnx.merge(graphdef, params)
    logits = model.compute_logits(hidden).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    own_logit = jnp.take_along_axis(logits, targets[:, None], axis=1)[:, 0]
    rank = 1 + jnp.sum(logits > own_logit[:, None], axis=-1)  # vLLM's rank: 1 = the most likely
    # on a mesh the top-k must be traced without the sampler's optimization barrier (it crashes XLA's
    # SPMD TopkDecomposer), as the sampler itself is
    with sharded_sampling() if sharded else contextlib.nullcontext():
        top_vals, top_ids = _top_k(logits, MAX_TOP_LOGPROBS)
    return own_logit - lse, rank.astype(jnp.int32), top_ids.astype(jnp.int32), top_vals - lse[:, None]


class ChunkedPrefill:
    """The programs and the chunk loop for one engine (its model, buckets and padding token)."""

    def __init__(
        self,
        graphdef: Any,
        params: Any,
        config: Any,
        buckets: Sequence[int],
        chunk: int,
        max_length: int,
        pad_token_id: int,
        dtype: Any,
    ):
        self.params = params
        small = next((b for b in buckets if b >= min(SMALL_CHUNK, chunk)), chunk)
        self.buckets = sorted({small, chunk})
        self.chunk = chunk
        self.row_length = -(-max_length // chunk) * chunk
        self.pad_token_id = pad_token_id
        self.hidden_size = config.hidden_size
        self.dtype = dtype
        shape = (self.row_length, config.num_kv_heads, config.head_dim)
        layers = config.num_layers

        def zero_rows() -> Rows:
            return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(layers))

        # committed where a chunk leaves its row (the chunk's layer programs keep rows whole), so the first
        # chunk and the later ones are one program signature, not two to compile
        self._zeros = program(zero_rows, out_shardings=self._whole())
        # a chunk: the embedding, one program per layer (the same for all), the final norm
        self._extend = LayeredChunk(graphdef, params, self._whole())
        leaf = jax.tree_util.tree_leaves(params)[0]
        sharded = isinstance(getattr(leaf, "sharding", None), NamedSharding)  # placed on a mesh
        self._logprobs = program(partial(_logprobs_impl, graphdef, sharded=sharded))
        # the adapter argument exists only with a LoRA bank: without, the programs are those of before
        self.lora = has_bank(nnx.merge(graphdef, params))

    @property
    def window(self) -> Any:
        """The chunk chain's DispatchWindow (dispatch_window.py)."""
        return self._extend.window

    def _whole(self) -> Any:
        """A sharding that keeps an array whole on the weights' devices."""
        sh = jax.tree_util.tree_leaves(self.params)[0].sharding
        return NamedSharding(sh.mesh, PartitionSpec()) if isinstance(sh, NamedSharding) else sh

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def jobs(self) -> list[tuple[str, Any, tuple]]:
        """(name, jitted fn, example args) of every program, for the engine's parallel compile: per bucket,
        the chunk program on a row as `_zeros` makes it and a chunk leaves it (whole on the weights'
        devices), and the prompt logprobs of a chunk's hidden states."""
        out = []
        whole = self._whole()
        row = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole), jax.eval_shape(self._zeros)
        )
        lora = (np.int32(-1),) if self.lora else ()
        for b in self.buckets:
            tokens = np.zeros(b, np.int32)
            out += self._extend.jobs(f"chunk bucket {b}", self.params, row[0], tokens, np.int32(0), *lora)
            hidden = jax.ShapeDtypeStruct((b, self.hidden_size), self.dtype, sharding=whole)
            out.append((f"prompt logprobs bucket {b}", self._logprobs, (self.params, hidden, tokens)))
        return out

    def run(
        self, tokens: Sequence[int], want_logprobs: bool, adapter: int = -1
    ) -> tuple[Rows, jax.Array, list | None]:
        """Prefill the whole prompt chunk by chunk (with LoRA bank slot ``adapter``, -1: none). Returns
        (row, hidden state at the last prompt token, the host logprob arrays per chunk or None); dispatched
        asynchronously except the logprobs."""
        lora = (np.int32(adapter),) if self.lora else ()
        n = len(tokens)
        if not 1 <= n <= self.row_length:
            raise ValueError(f"a chunked prefill takes 1..{self.row_length} tokens, got {n}")
        ids = np.asarray(tokens, np.int32)
        rows = self._zeros()
        parts = []
        hidden = None
        last = 0
        for start in range(0, n, self.chunk):
            m = min(self.chunk, n - start)
            b = self._bucket(m)
            chunk = np.full(b, self.pad_token_id, np.int32)
            chunk[:m] = ids[start : start + m]
            rows, hidden = self._extend(self.params, rows, chunk, np.int32(start), *lora)
            last = m - 1
            if want_logprobs:
                targets = np.zeros(b, np.int32)
                nxt = ids[start + 1 : start + m + 1]
                targets[: len(nxt)] = nxt
                parts.append((start, len(nxt), self._logprobs(self.params, hidden, targets)))
        return rows, hidden[last], parts if want_logprobs else None

    @staticmethod
    def prompt_logprobs(tokens: Sequence[int], parts: list, k: int) -> list[TokenLogprob | None]:
        """Per prompt token: None for the first, then its logprob given what precedes it and the top k."""
        out: list[TokenLogprob | None] = [None]
        for _start, count, dev in parts:
            own, rank, top_ids, top_lps = (np.asarray(x) for x in dev)
            for t in range(count):
                top = [(int(top_ids[t, j]), float(top_lps[t, j])) for j in range(k)]
                out.append(TokenLogprob(int(tokens[len(out)]), float(own[t]), top, int(rank[t])))
        return out
