"""vEngine's mixed step: every decoding row and chunks of up to SEQS prompts in one forward, under a token
budget (``max_num_batched_tokens``), as vLLM V1's scheduler and oEngine's mixed step do on pages.

A prompt is prefilled in place: it takes a decode slot when it starts, each step writes one chunk of it
into that slot's dense row (`DenseMixedAttention`), and the step that writes its last chunk also returns
the hidden state at its last token; `seat` then samples the first token and turns the slot into a decoding
one. So decode never waits for a whole prompt, and a long prompt is spread over several steps.

Shapes: per decode row bucket R the step carries P = budget - R prefill tokens (rounded down to a multiple
of 8), as one chunk of P tokens or SEQS chunks of P / SEQS (a chunk is padded to its size, so short
prompts share a step in the second shape); `plan_chunks` picks the shape that carries more. Every
(R, shape) program and the seat program are compiled with the engine.

While a slot is being prefilled its position is held past the cache (``max_length``), so the decode and
verify steps, which write every row of their bucket at the row's position, drop that row's write instead
of overwriting a prompt position; `seat` sets the real position.

With a LoRA bank (enable_lora) every token of a step names its bank slot, as in vEngine's separate prefill
and decode programs: a decode row its request's (the slot's sampling row, set when it was seated), a chunk
its prompt's (``Chunk.adapter``, sent with the step). Adapters are values in the bank, not shapes, so the
same (R, shape) programs serve every mix of adapters; without a bank the programs are those of before.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...models.attention import DenseMixedAttention
from ...models.lora import has_bank
from ..aot_program import program
from ..engine_base import constrain, sample_first_token, sample_step, start_slot
from ..sampling import SampleResult, SlotSampling

SEQS = 4  # chunks a step of the many-chunk shape carries (oEngine's STEP_SEQS)


class Chunk(NamedTuple):
    """One prompt's chunk in a mixed step: ``tokens`` go to slot ``slot`` from position ``start``."""

    slot: int
    start: int
    tokens: np.ndarray
    adapter: int = -1  # the prompt's LoRA bank slot (-1: the base model)


def step_shapes(budget: int, rows: int) -> list[tuple[int, int]]:
    """The (chunks, tokens per chunk) shapes a step of ``rows`` decode rows may carry within ``budget``."""
    p = (budget - rows) // 8 * 8
    if p < 8:
        raise ValueError(f"max_num_batched_tokens {budget} leaves no prefill tokens at {rows} decode rows")
    many = p // SEQS // 8 * 8
    return [(1, p)] + ([(SEQS, many)] if many >= 8 else [])


def plan_chunks(
    remaining: Sequence[int], shapes: Sequence[tuple[int, int]]
) -> tuple[tuple[int, int], list[int]]:
    """The shape of the next step and how many tokens each of the oldest prompts gets in it.

    ``remaining``: tokens each prompt being prefilled has left, oldest first. Returns (shape, takes) with
    takes[i] > 0 for the first len(takes) prompts; the shape is the one that carries the most tokens (the
    first such, i.e. one long chunk, on a tie)."""
    best: tuple[int, tuple[int, int], list[int]] | None = None
    for k, c in shapes:
        takes = [min(c, n) for n in remaining[:k]]
        if best is None or sum(takes) > best[0]:
            best = (sum(takes), (k, c), takes)
    assert best is not None
    return best[1], best[2]


def _token_adapters(row_adapters: jax.Array, chunk_adapters: jax.Array, c: int) -> jax.Array:
    """i32[1, R + K*C]: the bank slot of each token of the flat step, the decode rows' then each chunk's
    for all its C tokens (a chunk's padding gets it too: its hidden states and KV writes are dropped)."""
    return jnp.concatenate([row_adapters, jnp.repeat(chunk_adapters, c)])[None]


def _mixed_impl(
    graphdef,
    params,
    state,
    lengths,
    tokens,
    slots,
    starts,
    counts,
    adapters=None,
    *,
    rows,
    logits_sharding,
    num_top,
    shardings,
):
    """Decode the first ``rows`` slots and write the chunks tokens [K, C] into slots [K] from starts [K]
    (counts [K] real tokens each; ``adapters`` [K] their LoRA bank slots, given only with a bank). Returns
    (state, the decode rows' SampleResult, hidden state at each chunk's last real token [K, hidden])."""
    model = nnx.merge(graphdef, params)
    k, c = tokens.shape
    s = state.positions.shape[0]
    m = state.caches[0][0].shape[1]
    vocab = model.config.vocab_size
    pos = state.positions[:rows]
    c_pos = starts[:, None] + jnp.arange(c)[None, :]
    flat = jnp.concatenate([state.tokens[:rows], tokens.reshape(-1)])[None]
    flat_pos = jnp.concatenate([pos, c_pos.reshape(-1)])[None]
    backend = DenseMixedAttention(rows=rows, window=model.config.sliding_window)
    lora = _token_adapters(state.sampling.lora[:rows], adapters, c) if has_bank(model) else None
    meta = (pos, lengths, slots, starts, counts)
    hidden, caches = model(flat, flat_pos, backend, state.caches, meta, lora)
    hidden = hidden[0]
    logits = model.compute_logits(hidden[:rows])
    if logits_sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    # the prompt's tokens, for the repetition penalty: gathered chunk by chunk in the slot's row
    live = counts > 0
    at = jnp.where(live, slots, s)  # s: dropped
    valid = jnp.arange(c)[None, :] < counts[:, None]
    seen = jnp.where((starts == 0)[:, None], False, state.prompt_mask[jnp.minimum(slots, s - 1)])
    seen = seen.at[jnp.arange(k)[:, None], jnp.where(valid, tokens, vocab)].set(True, mode="drop")
    state = state._replace(
        caches=tuple(tuple(x) for x in caches),
        prompt_mask=state.prompt_mask.at[at].set(seen, mode="drop"),
        positions=state.positions.at[at].set(m, mode="drop"),  # past the cache until seated
    )
    state, out = sample_step(state, logits, rows=rows, num_top=num_top, shardings=shardings)
    last = rows + jnp.arange(k) * c + jnp.maximum(counts - 1, 0)
    return state, out, hidden[last]


def _seat_impl(
    graphdef, params, state, hidden, j, slot, length, sampling, key, *, num_top, logits_sharding, shardings
):
    """Sample the first token of the prompt whose last chunk was chunk ``j`` (hidden [K, hidden]) and make
    ``slot`` decode it: what vEngine's insert does, less the KV copy (the row was written in place)."""
    model = nnx.merge(graphdef, params)
    row = SlotSampling(*sampling)._replace(key=key[None])
    out = sample_first_token(
        model,
        hidden[j][None],
        row,
        state.prompt_mask[slot][None],
        num_top=num_top,
        logits_sharding=logits_sharding,
    )
    new = start_slot(state, slot, out.tokens[0], length, row)
    return constrain(new, shardings), out


class DenseMixedStep:
    """The mixed-step programs of one vEngine (``max_num_batched_tokens`` set on vdriver)."""

    def __init__(self, engine: Any, budget: int):
        self.engine = engine
        self.budget = budget
        self.shapes = {r: step_shapes(budget, r) for r in engine.decode_rows}
        common = dict(
            num_top=engine.num_top_logprobs,
            logits_sharding=engine.logits_sharding,
            shardings=engine._state_shardings,
        )
        self._fns = {
            r: program(partial(_mixed_impl, engine.graphdef, rows=r, **common), donate_argnums=(1,))
            for r in engine.decode_rows
        }
        self._seat = program(partial(_seat_impl, engine.graphdef, **common), donate_argnums=(1,))
        # chunks of many tokens: the bfloat16 kernels when a knob asked for them (as packed prefill)
        self.params = engine._bf16 if engine._bf16 is not None else engine.params
        # the chunks' adapter argument exists only with a LoRA bank: without, the programs are those of before
        self.lora = bool(engine.engine_config.enable_lora)

    def _args(self, r: int, shape: tuple[int, int]) -> tuple:
        k, c = shape
        z = np.zeros(k, np.int32)
        lora = (np.full(k, -1, np.int32),) if self.lora else ()
        return (np.zeros(r, np.int32), np.zeros((k, c), np.int32), z, z, z, *lora)

    def jobs(self, state: Any) -> list[tuple[str, Any, tuple]]:
        """(name, program, example arguments) of every mixed step and seat, for the engine's compile()."""
        out = [
            (f"mixed slots={r} chunks={k}x{c}", fn, (self.params, state, *self._args(r, (k, c))))
            for r, fn in self._fns.items()
            for k, c in self.shapes[r]
        ]
        width = self.engine.model_config.hidden_size
        dtype = self.engine.model.dtype
        row = self.engine.make_sampling_row(None, ())
        for k in sorted({k for shapes in self.shapes.values() for k, _ in shapes}):
            hidden = jax.ShapeDtypeStruct((k, width), dtype)
            args = (self.engine.params, state, hidden, np.int32(0), np.int32(0), np.int32(1), row, row.key[0])
            out.append((f"seat from {k} chunks", self._seat, args))
        return out

    def warm(self, state: Any) -> Any:
        """Run every program once on the real state (nothing is written: every chunk is empty)."""
        row = self.engine.make_sampling_row(None, ())
        for r, fn in self._fns.items():
            for shape in self.shapes[r]:
                state, out, hidden = fn(self.params, state, *self._args(r, shape))
                state, first = self._seat(
                    self.engine.params, state, hidden, np.int32(0), np.int32(0), np.int32(1), row, row.key[0]
                )
        jax.block_until_ready((out, first))
        return state

    def step_plan(self, remaining: Sequence[int]) -> tuple[tuple[int, int], list[int]]:
        """`plan_chunks` for the next step (the shapes of the row bucket the live slots need)."""
        return plan_chunks(remaining, self.shapes[self.engine.decode_bucket()])

    def step(
        self, state: Any, chunks: Sequence[Chunk], shape: tuple[int, int]
    ) -> tuple[Any, SampleResult, Any]:
        """One mixed step: the engine's live rows decode (as `vEngine.decode`) and ``chunks`` (at most
        shape[0], each at most shape[1] tokens) are written. Returns (state, decode SampleResult, hidden
        [K, hidden] for `seat`)."""
        eng = self.engine
        rows = eng.decode_bucket()
        k, c = shape
        if shape not in self.shapes[rows] or len(chunks) > k or any(len(x.tokens) > c for x in chunks):
            raise ValueError(f"chunks do not fit a step of shape {shape} at {rows} rows")
        tokens = np.full((k, c), eng.pad_token_id, np.int32)
        slots, starts, counts = (np.zeros(k, np.int32) for _ in range(3))
        adapters = np.full(k, -1, np.int32)
        for i, x in enumerate(chunks):
            tokens[i, : len(x.tokens)] = x.tokens
            slots[i], starts[i], counts[i], adapters[i] = x.slot, x.start, len(x.tokens), x.adapter
        live = np.flatnonzero(eng._active)
        lengths = eng.read_lengths(rows)
        lora = (adapters,) if self.lora else ()
        state, out, hidden = self._fns[rows](
            self.params, state, lengths, tokens, slots, starts, counts, *lora
        )
        eng._pos[live] += 1
        return state, out, hidden

    def seat(
        self,
        state: Any,
        hidden: Any,
        index: int,
        slot: int,
        length: int,
        sampling: SlotSampling,
        key: np.ndarray,
    ) -> tuple[Any, SampleResult]:
        """After the step that wrote a prompt's last chunk (chunk ``index``): sample its first token with
        ``sampling`` (a one-row SlotSampling, `vEngine.make_sampling_row`) and ``key`` (u32[2]), and let
        ``slot`` decode from the next step."""
        eng = self.engine
        state, first = self._seat(
            eng.params,
            state,
            hidden,
            np.int32(index),
            np.int32(slot),
            np.int32(length),
            sampling,
            np.asarray(key, np.uint32),
        )
        eng._pos[slot] = length
        eng._active[slot] = True
        return state, first
