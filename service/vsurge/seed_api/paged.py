"""oEngine's seed layer: `forward(graphstate, graphothers, state, iteration_plan)` runs one mixed step
(`oEngine.step`) of an ActiveSequenceBatch and returns a ModelOutputBatch; `decode(graphstate,
graphothers, state, rngs)` is a forward of the decode rows alone.

An ActiveSequenceBatch is the seed's decode state of the paged engine: the engine's PagedState (the pages
and the per-slot sampler state, updated in place by each forward) and, on the host, which sequence holds
each slot, its page table (pages from the engine's HBMPageManager) and how far it got. `admit` puts a
prompt in a slot; `plan` says what the next step runs (every decoding slot, and prompt chunks within the
engine's token budget); a slot's first token comes from the step that runs its prompt's final chunk.

The seed's other way in: `prefill` writes prompts into pages of the latest batch (`init_sequence_batch`)
with the same mixed step, not yet in any slot, and returns a prefix holding those pages and the first
tokens; `insert` / `bulk_insert` hand its pages to slots (`seat`), no KV moves (paged_prefix.py). Sampling
keys are per sequence (``admit``'s key, prefill's ``rngs``), so ``rngs`` of `decode` is not used.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ..contracts.sampling_params import SamplingParams
from ..engines.paged.mixed_step import ChunkWork
from .engine_layer import SeedEngineLayer, host_key
from .paged_prefix import PagedPrefix, insert_prefixes, prefill_prefix
from .types import ModelOutputBatch, NextIterationPlan, ResultTokens

__all__ = ["ActiveSequenceBatch", "PagedSeedLayer"]

_ids = itertools.count()


@dataclass
class _Slot:
    seq_id: tuple  # the HBMPageManager's id of the sequence's pages
    prompt: np.ndarray  # i32[n]
    inputs: Any  # SeqInputs: sampling of the token after the prompt
    written: int = 0  # prompt tokens prefilled so far
    decoding: bool = False
    generated: int = 0


@dataclass
class ActiveSequenceBatch:
    """The paged engine's seed-layer decode state (see the module docstring)."""

    engine: Any
    state: Any  # PagedState: donated to each step; replaced by its result
    table: np.ndarray = field(init=False)  # i32[S, W] decode page table (0: the scratch page)
    slots: list[_Slot | None] = field(init=False)

    def __post_init__(self) -> None:
        s = self.engine.max_concurrent_decodes
        self.table = np.zeros((s, self.engine.table_width), np.int32)
        self.slots = [None] * s

    # ------------------------------------------------------------------ sequences
    def admit(
        self, slot: int, prompt_ids: Any, params: SamplingParams | None = None, key: Any = None
    ) -> None:
        """Put a prompt into the free ``slot``: its pages are taken now, its chunks run in the next steps.
        ``params``: how its tokens are sampled (default greedy); ``key``: its PRNG key (default the
        engine's next `prng_key`)."""
        eng = self.engine
        self.check_free(slot)
        ids = np.asarray(prompt_ids, np.int32).reshape(-1)
        if not 1 <= len(ids) <= eng.max_prompt_length:
            raise ValueError(f"a prompt of {len(ids)} tokens; this engine takes 1..{eng.max_prompt_length}")
        params = params or SamplingParams(temperature=0.0)
        params.validate()
        key = host_key(eng.prng_key if key is None else key)
        seq_id = ("seed", next(_ids), slot)
        if eng.manager.allocate(seq_id, len(ids)) is None:
            raise RuntimeError(f"no KV pages left for a prompt of {len(ids)} tokens")
        inputs = eng.seq_inputs(params, eng.eos_token_ids, key, ids.tolist())
        self.slots[slot] = _Slot(seq_id, ids, inputs)

    def check_free(self, slot: int) -> None:
        """Raise ValueError unless ``slot`` is one of the batch's and holds nothing."""
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"slot {slot} is not in 0..{len(self.slots) - 1}")
        if self.slots[slot] is not None:
            raise ValueError(f"slot {slot} is in use: free_resource({slot}) first")

    def seat(self, slot: int, seq_id: tuple, prompt: np.ndarray, inputs: Any) -> None:
        """Put a prefilled sequence (the seed's `insert`: its pages hold the prompt's KV, its first token
        was sampled) in the free ``slot`` on the host; it decodes from the next step on."""
        self.check_free(slot)
        self.slots[slot] = _Slot(seq_id, prompt, inputs, written=len(prompt), decoding=True, generated=1)
        self.table[slot] = self.row(seq_id)

    def free(self, slot: int) -> bool:
        """Release ``slot`` and its pages; False if it held nothing."""
        s = self.slots[slot]
        if s is None:
            return False
        self.engine.manager.free(s.seq_id)
        self.slots[slot] = None
        self.table[slot] = 0
        return True

    @property
    def decoding(self) -> np.ndarray:
        """bool[S]: slots whose sequence decodes (its prompt is in)."""
        return np.array([s is not None and s.decoding for s in self.slots], bool)

    # ------------------------------------------------------------------ planning
    def plan(self, prefill: bool = True) -> NextIterationPlan:
        """The next step: every decoding slot (given the page of its next token) and, with ``prefill``,
        prompt chunks in slot order within the engine's token budget and chunk count."""
        eng = self.engine
        decode = self.decoding
        for slot in np.flatnonzero(decode):
            self._grow(int(slot))
        chunks: list[ChunkWork] = []
        budget = min(eng.token_budget - int(decode.sum()), eng.step_tokens[-1])
        for slot, s in enumerate(self.slots):
            if not prefill or len(chunks) == eng.step_seqs or budget <= 0:
                break
            if s is None or s.decoding:
                continue
            n = min(len(s.prompt) - s.written, budget)
            final = s.written + n == len(s.prompt)
            row = self.row(s.seq_id)
            chunks.append(
                ChunkWork(
                    s.prompt[s.written : s.written + n], s.written, row, slot, s.inputs if final else None
                )
            )
            budget -= n
        return NextIterationPlan(decode, tuple(chunks))

    def row(self, seq_id: tuple) -> np.ndarray:
        """The page table of the sequence ``seq_id`` (the page manager's), padded with the scratch page."""
        row = np.zeros(self.engine.table_width, np.int32)
        pages = self.engine.manager.table(seq_id)
        row[: len(pages)] = pages
        return row

    def _grow(self, slot: int) -> None:
        s = self.slots[slot]
        position = len(s.prompt) + s.generated - 1  # where the token fed this step is written
        if position >= self.engine.max_length:
            raise RuntimeError(f"slot {slot} reached max_length {self.engine.max_length}: free it")
        if not self.engine.manager.grow(s.seq_id, position + 1):
            raise RuntimeError(f"no KV page left for slot {slot}'s next token: free a slot")
        self.table[slot] = self.row(s.seq_id)

    # ------------------------------------------------------------------ after a step
    def stepped(self, plan: NextIterationPlan, out: Any, firsts: list[tuple[int, Any]]) -> ModelOutputBatch:
        """Account a forward of ``plan``: decoding slots advanced, chunks written, final chunks seated."""
        n = len(self.slots)
        tokens, valid = np.zeros(n, np.int32), np.zeros(n, bool)
        if out is not None:
            rows = np.asarray(out.tokens)
            for slot in np.flatnonzero(plan.decode):
                tokens[slot], valid[slot] = rows[slot], True
                self.slots[slot].generated += 1
        for c in plan.chunks:
            self.slots[c.slot].written = c.start + len(c.tokens)
        for k, first in firsts:
            slot = plan.chunks[k].slot
            s = self.slots[slot]
            tokens[slot], valid[slot] = int(np.asarray(first.tokens)[0]), True
            s.decoding, s.generated = True, 1
            self.table[slot] = self.row(s.seq_id)
        lengths = np.array([0 if s is None else s.generated for s in self.slots], np.int32)
        result = ResultTokens.from_columns(tokens, valid.astype(np.int32), lengths)
        return ModelOutputBatch(tokens, valid, result)


def _is_seed_decode(args: tuple, kw: dict) -> bool:
    state = args[2] if len(args) > 2 else kw.get("state")
    return isinstance(state, ActiveSequenceBatch)


class PagedSeedLayer(SeedEngineLayer):
    """oEngine's seed layer (see the module docstring); `seed_forms` wires `decode`."""

    _seed_forms = {"decode": (_is_seed_decode, "seed_decode")}
    _seed_batch: ActiveSequenceBatch | None = None

    def init_sequence_batch(self) -> ActiveSequenceBatch:
        """A seed-layer decode state over a new PagedState (`init_decode_state`); the engine's
        `free_resource` acts on the latest one."""
        self._seed_batch = ActiveSequenceBatch(self, self.init_decode_state())
        return self._seed_batch

    def forward(
        self,
        graphstate: Any,
        graphothers: Any,
        state: ActiveSequenceBatch,
        iteration_plan: NextIterationPlan,
    ) -> ModelOutputBatch:
        """Run one mixed step of ``iteration_plan`` on ``state`` (its pages and slots updated in place):
        the next token of each decoding slot and the chunks' prompt tokens in one forward."""
        self._check_weights(graphstate, graphothers)
        if iteration_plan.empty:
            return state.stepped(iteration_plan, None, [])
        table = jax.device_put(state.table, self._replicated())
        new, out, firsts = self.step(state.state, table, iteration_plan.decode, iteration_plan.chunks)
        state.state = new
        return state.stepped(iteration_plan, out, firsts)

    def seed_decode(
        self, graphstate: Any, graphothers: Any, state: ActiveSequenceBatch, rngs: jax.Array
    ) -> tuple[ActiveSequenceBatch, ResultTokens]:
        """One token for every decoding slot of ``state``: (state, ResultTokens of every slot)."""
        host_key(rngs)  # checked, not used (see the module docstring)
        out = self.forward(graphstate, graphothers, state, state.plan(prefill=False))
        return state, out.result

    def prefill(
        self,
        graphstate: Any,
        graphothers: Any,
        tokens: jax.Array,
        valids: jax.Array,
        true_length: int,
        temperature: jax.Array,
        top_p: jax.Array,
        top_k: jax.Array,
        rngs: jax.Array,
    ) -> tuple[PagedPrefix, ResultTokens]:
        """Prefill one prompt (``tokens`` [L]) or a batch ([B, L]) into pages of the latest
        `init_sequence_batch` with the mixed step, and sample each first token with ``rngs``: (a
        PagedPrefix for `insert` / `bulk_insert`, the first tokens as ResultTokens, one row per prompt).
        See paged_prefix.py; the prefix's pages return when it is dropped uninserted, or with
        ``prefix.free()``."""
        self._check_weights(graphstate, graphothers)
        if self._seed_batch is None:
            raise RuntimeError(
                "oEngine.prefill writes prompts into the pages of the engine's ActiveSequenceBatch: "
                "call init_sequence_batch() first"
            )
        args = (tokens, valids, true_length, temperature, top_p, top_k, rngs)
        return prefill_prefix(self, self._seed_batch, *args)

    def insert(
        self, prefix: PagedPrefix, decode_state: ActiveSequenceBatch, slot: int
    ) -> ActiveSequenceBatch:
        """Put a one-prompt prefix in the free ``slot`` of ``decode_state`` (the batch it was prefilled
        into): its pages become the slot's, no KV moves; the slot decodes from the prefill's first token.
        Returns the batch (updated in place)."""
        if isinstance(prefix, PagedPrefix) and len(prefix) != 1:
            raise ValueError(f"a prefix of {len(prefix)} prompts: bulk_insert(prefix, state, slots)")
        return self.bulk_insert(prefix, decode_state, [slot])

    def bulk_insert(
        self, prefix: PagedPrefix | list[PagedPrefix], decode_state: ActiveSequenceBatch, slots: list[int]
    ) -> ActiveSequenceBatch:
        """Put prompt i of ``prefix`` (a batched prefill's, or a list of prefixes in order) in ``slots[i]``
        of ``decode_state``, as `insert` does for one. Returns the batch."""
        if not isinstance(decode_state, ActiveSequenceBatch):
            raise TypeError(
                "oEngine's decode state for insert is the ActiveSequenceBatch the prefix was prefilled "
                f"into (init_sequence_batch()), got {type(decode_state).__name__}"
            )
        return insert_prefixes(self, prefix, decode_state, slots)

    def free_resource(self, slot: int) -> bool:
        """Release ``slot`` of the latest `init_sequence_batch` and its pages; False if it held nothing.
        (oDriver frees its own sequences through its scheduler.)"""
        return self._seed_batch is not None and self._seed_batch.free(slot)

    def get_prefix_destination_sharding(self) -> None:
        """None: a paged prompt is written into the pages it decodes from; no prefix moves between
        engines."""
        return None
