"""Pooled hidden states for /v1/embeddings and /pooling: one jitted forward over the served model's weights.

The program runs the decoder stack with prefill attention on right-padded rows (no KV cache written, no
logits) and returns each row's final hidden state after the model's final norm, pooled two ways at once:
the last valid token's (the default for decoder LLMs) and the mean over valid tokens. Both come back in
float32 and the host picks and L2-normalizes, so the pooling type never forces a recompile.

Shapes are bounded: tokens are padded to one of the engine's prefill lengths and rows to that bucket's
row count (at most `ROWS`, and at most the largest bucket's tokens in all), so at most len(buckets)
programs exist, compiled at `compile()` (warm start) and never on a live request. The program is separate from the driver's step loop: it runs
on the engine's device from the server's worker thread, one bucket-sized batch at a time, so the time it
can hold the device between two decode steps is one batch's forward over at most as many tokens as the
engine's largest prefill — what the driver itself may run between two decode steps — not the request's
size. It is not scheduled by the driver: a decode step may wait for one such batch, as for one prefill.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vsurge.models.attention import PrefillAttention

# Rows per pooling batch: inputs of one request are packed this many at a time, fewer in long buckets, so
# one batch holds no more tokens than the largest prefill bucket (one prefill's worth) whatever the bucket.
ROWS = 8
POOLING_TYPES = ("last", "mean")


@partial(jax.jit, static_argnums=(0,))
def _pooled(graphdef: Any, state: Any, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """[2, B, H] float32: the last valid token's final-norm hidden state, and the mean over valid tokens."""
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    backend = PrefillAttention(window=model.config.sliding_window)
    hidden, _ = model(tokens, positions, backend, [None] * model.config.num_layers, (positions, lengths))
    hidden = hidden.astype(jnp.float32)
    last = hidden[jnp.arange(b), jnp.maximum(lengths - 1, 0)]
    mask = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)
    mean = (hidden * mask[..., None]).sum(axis=1) / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
    return jnp.stack([last, mean])


class Pooler:
    """Pooled, normalized hidden states of token-id inputs, over an engine's graphdef and weights."""

    def __init__(
        self, graphdef: Any, params: Any, buckets: Sequence[int], dim: int, rows: int = ROWS
    ) -> None:
        self.graphdef = graphdef
        self.dim = dim  # the hidden size: each vector's length
        self.params = params
        self.buckets = sorted(buckets)
        # each bucket's rows: `rows`, fewer where the bucket is long
        self.rows = {t: max(1, min(rows, self.buckets[-1] // t)) for t in self.buckets}
        # one batch at a time: two requests' batches would only queue on the device anyway
        self._lock = threading.Lock()

    @classmethod
    def for_engine(cls, engine: Any) -> Pooler:
        if jax.process_count() > 1:
            # a multi-host slice runs its programs in lockstep (multihost/); one host alone must not
            raise NotImplementedError("embeddings are not served by a multi-host engine")
        # the prefill buckets: what the engine already bounds a prompt by (longer input is a 400); of
        # those, the powers of two and the largest: each is the whole model compiled at start, and the
        # CPU's 1.5x prefill steps (engine_base.default_prefill_lengths) would add a third to the start
        lengths = sorted({int(n) for n in getattr(engine, "prefill_lengths", None) or [engine.max_length]})
        coarse = sorted({n for n in lengths if n & (n - 1) == 0} | {lengths[-1]})
        return cls(engine.graphdef, engine.params, coarse, int(engine.model_config.hidden_size))

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def compile(self) -> None:
        """Compile every bucket's program now (a warm start), so no request waits for one."""
        for t in self.buckets:
            self._run(np.zeros((self.rows[t], t), np.int32), np.ones((self.rows[t],), np.int32))

    def _run(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        with self._lock:
            out = _pooled(self.graphdef, self.params, jnp.asarray(tokens), jnp.asarray(lengths))
            return np.asarray(out)

    def pool(
        self, inputs: Sequence[Sequence[int]], pooling: str = "last", normalize: bool = True
    ) -> np.ndarray:
        """[len(inputs), H] float32. Inputs longer than the largest bucket are the caller's error."""
        if pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {pooling!r}")
        which = POOLING_TYPES.index(pooling)
        out: list[np.ndarray | None] = [None] * len(inputs)
        # shortest first, so a batch's rows share the smallest bucket that fits them
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        start = 0
        while start < len(order):
            # the bucket of the shortest input left; as many rows as that bucket takes, all fitting it
            t = next(b for b in self.buckets if b >= len(inputs[order[start]]))
            chunk = [i for i in order[start : start + self.rows[t]] if len(inputs[i]) <= t]
            start += len(chunk)
            tokens = np.zeros((self.rows[t], t), np.int32)
            lengths = np.ones((self.rows[t],), np.int32)
            for r, i in enumerate(chunk):
                tokens[r, : len(inputs[i])] = inputs[i]
                lengths[r] = len(inputs[i])
            pooled = self._run(tokens, lengths)[which]
            for r, i in enumerate(chunk):
                out[i] = pooled[r]
        vecs = np.stack(out).astype(np.float32)  # type: ignore[arg-type]
        if normalize:
            vecs /= np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
        return vecs
