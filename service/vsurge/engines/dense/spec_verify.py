"""The verify step of n-gram speculative decoding on vEngine's dense cache: K+1 tokens per row, one call.

Each row feeds its last accepted token followed by its K draft tokens (`speculative.propose_ngram`); the
model scores the K+1 positions against the row's cache in one batched forward (`DenseVerifyAttention`),
and `speculative.verify` keeps the accepted prefix plus one target token. The state then advances by the
number of tokens each row emitted: its next input token, position, step counter and penalty counts.
KV written for rejected draft positions stays in the cache past the row's position, where nothing reads
it: the next step overwrites a position before any query may attend to it (the dense cache's rule).

Rows whose sampling the verification does not model exactly (penalties, logit_bias / allowed ids, top_k,
top_p, min_p, min_tokens, structured output, logprobs) must get ``num_draft = 0``: their token at position 0
then comes from the engine's own sampler on the same logits, so they decode exactly as without
speculation. `plain_sampling(params)` says which requests may be given drafts, from what each
SamplingParams field declares (`DRAFTS`).

The driver's side (drivers/dense/slot_scheduler.py, `DenseSlots`): proposing drafts needs each row's latest tokens on
the host, so with speculation on every step's tokens are read before the next step is dispatched (the
one-step-ahead overlap of ordinary decoding is given up), and the detokenize thread takes up to K+1 tokens
per row per step (stopping at an EOS, stop string or max_tokens inside an accepted draft).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...contracts.sampling_params import ANY_VALUE, DRAFTS, SamplingParams
from ...models.attention import as_given, flat_cache, kv_store, read_chunk, read_dense_rows, to_flat
from ...models.lora import has_bank
from ..aot_program import program
from ..engine_base import constrain, sampling_context
from ..sampling import SlotSampling, sample
from .speculative import verify

__all__ = ["DenseVerifyAttention", "SpeculativeVerifier", "VerifyStep", "plain_sampling"]


class VerifyStep(NamedTuple):
    """One verify step's results, one row per decoded slot (the rows of the step's bucket)."""

    tokens: jax.Array  # i32[R, K+1]; the first num_accepted + 1 are emitted, the rest are -1
    logprob: jax.Array  # f32[R, K+1]; raw-model logprob of each emitted token
    top_ids: jax.Array  # i32[R, T]: top logprobs at position 0 (rows without a draft)
    top_logprobs: jax.Array  # f32[R, T]
    num_accepted: jax.Array  # i32[R]; draft tokens accepted (0 for rows without a draft)


def plain_sampling(params: SamplingParams) -> bool:
    """True when `verify` reproduces this request's sampling exactly: every option that allows drafts only
    while it is off (its field's `DRAFTS` declaration, in contracts/sampling_params.py) is off. A field
    that declares nothing is taken as `WHEN_OFF`: set, it rules drafts out."""
    return all(
        f.metadata.get(DRAFTS) == ANY_VALUE or _off(getattr(params, f.name), f.default)
        for f in dataclasses.fields(params)
    )


def _off(value: Any, default: Any) -> bool:
    """An option is off when it is None, empty, or a plain value equal to its default."""
    if value is None or (isinstance(value, list | tuple | dict) and not value):
        return True
    return isinstance(value, bool | int | float | str) and value == default


@dataclasses.dataclass(frozen=True)
class DenseVerifyAttention:
    """T new tokens per row against a dense cache K, V [S, M, KVH * D] (T = K+1 in a verify step).

    meta: (positions i32[S], lengths): row s's new tokens go to positions[s] .. positions[s] + T - 1;
    ``lengths`` i32[S] is how much of each row the step reads (its last new position + 1; 0 for an idle
    row, not read at all), or an i32 scalar bounding every row. Token t attends to the cache up to its own
    position: the row's history and the new tokens before it. The cache is read like DenseDecodeAttention
    reads it (`read_dense_rows`); writes past the cache's end are dropped.
    """

    window: int | None = None
    chunk: int | None = None

    def __call__(self, q, k, v, cache, meta):
        positions, lengths = meta
        kc, vc, shape4 = flat_cache(cache)
        s, t, h, d = q.shape
        kvh = k.shape[2]
        g = h // kvh
        pos = positions[:, None] + jnp.arange(t)[None, :]  # [S, T]
        rows = jnp.arange(s)[:, None]
        kc = kc.at[rows, pos].set(kv_store(to_flat(k), kc.dtype), mode="drop")
        vc = vc.at[rows, pos].set(kv_store(to_flat(v), vc.dtype), mode="drop")
        need = lengths if jnp.ndim(lengths) else jnp.minimum(positions + t, lengths)
        qg = q.reshape(s, t, kvh, g, d).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
        out = read_dense_rows(
            qg, kc, vc, pos, jnp.minimum(need, kc.shape[1]), window=self.window, chunk=read_chunk(self.chunk)
        )
        return out.reshape(s, t, h, d).astype(q.dtype), as_given(kc, vc, shape4)


def _verify_step_impl(
    graphdef, params, state, draft, num_draft, lengths, *, rows: int, num_top: int, shardings
):
    """One verify step over the first `rows` slots: forward K+1 tokens, verify, advance the state."""
    model = nnx.merge(graphdef, params)
    k = draft.shape[1]
    backend = DenseVerifyAttention(window=model.config.sliding_window)
    pos = state.positions[:rows]
    tokens_in = jnp.concatenate([state.tokens[:rows, None], draft], axis=1)  # [rows, K+1]
    positions = pos[:, None] + jnp.arange(k + 1)[None, :]
    lora = jnp.broadcast_to(state.sampling.lora[:rows, None], tokens_in.shape) if has_bank(model) else None
    hidden, caches = model(tokens_in, positions, backend, state.caches, (pos, lengths), lora)
    logits = model.compute_logits(hidden.reshape(rows * (k + 1), -1)).reshape(rows, k + 1, -1)
    sampling = SlotSampling(*(a[:rows] for a in state.sampling))
    steps = state.steps[:rows]
    # traced for a partitioned program on a mesh, as the decode step's sampler is (both take top_k: XLA's
    # TopkDecomposer crashes on the barrier an unpartitioned program puts after it)
    with sampling_context(shardings):
        res = verify(logits, draft, num_draft, sampling.temperature, sampling.key, steps)
        # rows without a draft decode exactly as an ordinary step: the engine's sampler at position 0
        plain = sample(logits[:, 0], sampling, state.counts[:rows], state.prompt_mask[:rows], steps, num_top)
    no_draft = num_draft == 0
    first = jnp.where(no_draft, plain.tokens, res.tokens[:, 0])
    tokens = res.tokens.at[:, 0].set(first)
    lp0 = jnp.where(no_draft, plain.logprob, res.logprob[:, 0])
    res = VerifyStep(
        tokens,
        res.logprob.at[:, 0].set(lp0),
        plain.top_ids,
        plain.top_logprobs,
        jnp.where(no_draft, 0, res.num_accepted),
    )
    emitted = res.num_accepted + 1
    last = jnp.take_along_axis(res.tokens, res.num_accepted[:, None], axis=1)[:, 0]
    r = jnp.arange(rows)
    counts = state.counts
    for t in range(k + 1):  # static K+1: scatter each emitted position's token into the penalty counts
        counts = counts.at[r, jnp.maximum(res.tokens[:, t], 0)].add((t < emitted).astype(counts.dtype))
    new = state._replace(
        caches=tuple(tuple(c) for c in caches),
        tokens=state.tokens.at[:rows].set(last),
        positions=state.positions.at[:rows].add(emitted),
        steps=state.steps.at[:rows].add(emitted),
        counts=counts,
    )
    return constrain(new, shardings), res


class SpeculativeVerifier:
    """Verify steps for a vEngine: `step(state, drafts, num_draft)` advances every live slot by 1..K+1."""

    def __init__(self, engine: Any, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.engine = engine
        self.k = int(num_speculative_tokens)
        self._fns = {
            rows: program(
                partial(
                    _verify_step_impl,
                    engine.graphdef,
                    rows=rows,
                    num_top=engine.num_top_logprobs,
                    shardings=engine._state_shardings,
                ),
                donate_argnums=(1,),
            )
            for rows in engine.decode_rows
        }
        # seconds of a verify step / a decode step, per row bucket: 1.0 (always verify) until warm()
        self.cost_ratio: dict[int, float] = dict.fromkeys(engine.decode_rows, 1.0)

    def jobs(self, state: Any) -> list[tuple[str, Any, tuple]]:
        """(name, program, example arguments) of every verify step, for the engine's compile()."""
        eng = self.engine
        return [
            (
                f"verify slots={r} k={self.k}",
                fn,
                (
                    eng.step_params(r),
                    state,
                    np.zeros((r, self.k), np.int32),
                    np.zeros(r, np.int32),
                    np.ones(r, np.int32),
                ),
            )
            for r, fn in self._fns.items()
        ]

    def warm(self, state: Any, repeats: int = 2) -> Any:
        """Run every verify program on the real state (as compile() does for decode), and time it against
        the decode step of the same row bucket: `cost_ratio`, for the driver's choice of step."""
        eng = self.engine

        def timed(fn, rows, *args):
            t = time.perf_counter()
            new, out = fn(eng.step_params(rows), *args)
            jax.block_until_ready(out)
            return new, time.perf_counter() - t

        for r, fn in self._fns.items():
            draft, num = np.zeros((r, self.k), np.int32), np.zeros(r, np.int32)
            state, _ = timed(fn, r, state, draft, num, np.ones(r, np.int32))  # the first run pays for loading
            t_verify, t_decode = [], []
            for _ in range(repeats):
                state, t = timed(fn, r, state, draft, num, np.ones(r, np.int32))
                t_verify.append(t)
                state, t = timed(eng._decode[r], r, state, np.ones(r, np.int32))
                t_decode.append(t)
            self.cost_ratio[r] = max(1.0, min(t_verify) / max(min(t_decode), 1e-9))
        return state

    def step(self, state: Any, draft: np.ndarray, num_draft: np.ndarray) -> tuple[Any, VerifyStep]:
        """draft i32[S, K] and num_draft i32[S] for every slot (idle slots: 0). Blocks until the accepted
        counts are known (the engine's host mirror of each slot's length needs them)."""
        eng = self.engine
        rows = eng.decode_bucket()
        # the row's new position (+ accepted + 1) must stay inside the context
        room = np.maximum(eng.max_length - 2 - eng._pos[:rows], 0)
        num = np.minimum(np.asarray(num_draft[:rows], np.int32), room).astype(np.int32)
        state, res = self._fns[rows](
            eng.step_params(rows),
            state,
            np.asarray(draft[:rows], np.int32),
            num,
            eng.read_lengths(rows, self.k + 1),
        )
        eng._pos[:rows] += np.where(eng._active[:rows], np.asarray(res.num_accepted) + 1, 0)
        return state, res
