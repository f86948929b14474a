"""oEngine's seed `prefill` / `insert` / `bulk_insert`: a prefix that holds pages, not a copy of the KV.

* `prefill(graphstate, graphothers, tokens, valids, true_length, temperature, top_p, top_k, rngs)` takes
  the pages for each prompt (``tokens`` [L] one prompt, [B, L] a batch of B) from the engine's page
  manager and writes the prompts' KV into them with the engine's mixed step (`oEngine.run_mixed`: the
  program oDriver runs, here with no decode row and the prompts' chunks within the step's token budget),
  in the pages of the engine's latest ActiveSequenceBatch (`init_sequence_batch`); then it samples each
  prompt's first token with the engine's sampler (`first_of_chunk`: the first half of the seat oDriver
  runs after a final chunk) under the given settings. Returns (PagedPrefix, ResultTokens of the first
  tokens, one row per prompt).
* `insert(prefix, decode_state, slot)` puts a one-prompt prefix in ``slot`` of that ActiveSequenceBatch:
  its page ids become the slot's page table (the KV stays where prefill wrote it) and `place` (the seat's
  second half) sets the slot's token, position, sampler row and counts. `bulk_insert(prefix,
  decode_state, slots)` puts prompt i of the prefix (or of a list of prefixes, in order) in ``slots[i]``.
  The slot then decodes with `decode` / `forward` from the first token prefill returned.

Pages: a prefix owns its pages until it is inserted; then its slot does (`free_resource(slot)` /
`ActiveSequenceBatch.free` returns them). A prefix that is never inserted returns its pages when it is
garbage-collected, or at once with `PagedPrefix.free()`. A prefix goes only into the batch whose pages it
was written in: a page id names a page of the engine's manager, the KV is in that batch's arrays.

Sampling: prompt 0 samples with ``rngs``, prompt i > 0 with ``fold_in(rngs, i)``; each keeps its key for
the tokens it decodes (so `decode`'s ``rngs`` is not used, as for `admit`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..contracts.sampling_params import SamplingParams
from ..engines.paged.mixed_step import ChunkWork, plan_chunks
from .dense import prompt_ids
from .engine_layer import host_key
from .types import ResultTokens

__all__ = ["PagedPrefix", "insert_prefixes", "prefill_prefix"]

_ids = itertools.count()


@dataclass(eq=False)
class PrefixSeq:
    """One prompt of a PagedPrefix: its pages (the manager's ``seq_id``), its tokens, the inputs of its
    sampling (a SeqInputs, carrying its key) and its first token (a SampleResult of one row)."""

    seq_id: tuple
    prompt: np.ndarray
    inputs: Any
    first: Any = None


def _free_pages(manager: Any, owned: set) -> None:
    for seq_id in sorted(owned):
        manager.free(seq_id)
    owned.clear()


class PagedPrefix:
    """What oEngine's seed `prefill` returns: the prompts' pages (their KV written in ``batch``'s pages)
    and first tokens, for `insert` / `bulk_insert` (see the module docstring)."""

    def __init__(self, batch: Any, seqs: Sequence[PrefixSeq] = ()):
        self.batch = batch
        self.seqs: list[PrefixSeq] = []
        self._owned: set = set()  # seq ids whose pages this prefix still holds
        self._finalizer = weakref.finalize(self, _free_pages, batch.engine.manager, self._owned)
        self._finalizer.atexit = False  # nothing to return once the process ends
        for s in seqs:
            self.add(s)

    def add(self, seq: PrefixSeq) -> None:
        """Take ownership of a prompt whose pages were allocated under ``seq.seq_id``."""
        self.seqs.append(seq)
        self._owned.add(seq.seq_id)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def lengths(self) -> list[int]:
        """The prompts' lengths (tokens)."""
        return [len(s.prompt) for s in self.seqs]

    @property
    def holds_pages(self) -> bool:
        """Whether the prefix still holds its pages (False once inserted or freed)."""
        return bool(self._owned)

    def free(self) -> None:
        """Return the pages of the prompts not inserted (what garbage collection would do)."""
        self._finalizer()

    def hand_over(self, seq: PrefixSeq) -> None:
        """``seq``'s pages now belong to a slot."""
        self._owned.discard(seq.seq_id)


def _per_row(x: Any, b: int, name: str) -> np.ndarray:
    arr = np.asarray(x).reshape(-1)
    if arr.size == 1:
        return np.repeat(arr, b)
    if arr.size != b:
        raise ValueError(f"{name} has {arr.size} values for {b} prompts")
    return arr


def _prompts(tokens: Any, valids: Any, true_length: Any) -> list[list[int]]:
    """The prompts of ``tokens`` [L] or [B, L] (see dense.prompt_ids, per row)."""
    toks = np.asarray(tokens)
    toks = toks.reshape(1, -1) if toks.ndim < 2 else toks
    if toks.ndim != 2:
        raise ValueError(f"tokens must be [L] or [B, L], got shape {np.shape(tokens)}")
    mask = None if valids is None else np.asarray(valids).reshape(toks.shape)
    lengths = _per_row(true_length, len(toks), "true_length")
    return [prompt_ids(t, None if mask is None else mask[i], lengths[i]) for i, t in enumerate(toks)]


def prefill_prefix(
    engine: Any,
    batch: Any,
    tokens: Any,
    valids: Any,
    true_length: Any,
    temperature: Any,
    top_p: Any,
    top_k: Any,
    rngs: Any,
) -> tuple[PagedPrefix, ResultTokens]:
    """The seed's `prefill` into ``batch``'s pages (see the module docstring)."""
    prompts = _prompts(tokens, valids, true_length)
    b = len(prompts)
    per_row = [
        _per_row(x, b, n) for x, n in ((temperature, "temperature"), (top_p, "top_p"), (top_k, "top_k"))
    ]
    params = [
        SamplingParams(temperature=float(t), top_p=float(p), top_k=int(k), max_tokens=1)
        for t, p, k in zip(*per_row, strict=True)
    ]
    for p in params:
        p.validate()
    for ids in prompts:
        if len(ids) > engine.max_prompt_length:
            raise ValueError(
                f"a prompt of {len(ids)} tokens; this engine takes 1..{engine.max_prompt_length}"
            )
    key = host_key(rngs)
    keys = [key] + [host_key(jax.random.fold_in(key, i)) for i in range(1, b)]
    prefix = PagedPrefix(batch)
    for i, ids in enumerate(prompts):
        seq_id = ("seed-prefix", next(_ids), i)
        if engine.manager.allocate(seq_id, len(ids)) is None:
            prefix.free()
            raise RuntimeError(f"no KV pages left for a prompt of {len(ids)} tokens")
        inputs = engine.seq_inputs(params[i], engine.eos_token_ids, keys[i], ids)
        prefix.add(PrefixSeq(seq_id, np.asarray(ids, np.int32), inputs))
    _write(engine, batch, prefix.seqs)
    firsts = jnp.concatenate([s.first.tokens for s in prefix.seqs])
    one = np.ones(b, np.int32)
    return prefix, ResultTokens.from_columns(firsts, one, one)


def _write(engine: Any, batch: Any, seqs: list[PrefixSeq]) -> None:
    """The prompts' chunks through the mixed step, oldest first within each step's token budget; the
    first token of each after its final chunk."""
    written = [0] * len(seqs)
    idle = np.zeros(engine.max_concurrent_decodes, bool)  # no decode row: the batch's slots wait
    table = jax.device_put(batch.table, engine._replicated())
    while todo := [i for i, s in enumerate(seqs) if written[i] < len(s.prompt)]:
        left = [len(seqs[i].prompt) - written[i] for i in todo]
        lens = plan_chunks(left, 0, engine.token_budget, engine.step_seqs, engine.step_tokens[-1])
        chunks = []
        for i, n in zip(todo, lens, strict=False):
            s, at = seqs[i], written[i]
            chunks.append(ChunkWork(s.prompt[at : at + n], at, batch.row(s.seq_id), -1))
            written[i] = at + n
        batch.state, _, logits = engine.run_mixed(batch.state, table, idle, chunks)
        for k, i in enumerate(todo[: len(chunks)]):
            if written[i] == len(seqs[i].prompt):
                seqs[i].first = engine._first(logits, np.int32(k), seqs[i].inputs)


def insert_prefixes(engine: Any, prefix: Any, batch: Any, slots: Sequence[int]) -> Any:
    """Put the prompts of ``prefix`` (a PagedPrefix or a list of them) in ``slots`` of ``batch``, in
    order; every check is made before anything moves. Returns the batch."""
    prefixes = [prefix] if isinstance(prefix, PagedPrefix) else list(prefix)
    slots = [int(s) for s in slots]
    for p in prefixes:
        if not isinstance(p, PagedPrefix):
            raise TypeError(f"a prefix is what oEngine.prefill returned, got {type(p).__name__}")
        if p.batch is not batch:
            raise ValueError(
                "the prefix was written into the pages of another ActiveSequenceBatch: insert it into "
                "the engine's init_sequence_batch() that was latest when it was prefilled"
            )
        if not p.holds_pages:
            raise ValueError("the prefix was already inserted or freed")
    seqs = [(p, s) for p in prefixes for s in p.seqs]
    if len(seqs) != len(slots):
        raise ValueError(f"{len(seqs)} prefilled prompts for {len(slots)} slots: give one slot per prompt")
    if len(set(slots)) != len(slots):
        raise ValueError(f"slots {slots} repeat a slot")
    for slot in slots:
        batch.check_free(slot)
    for (p, s), slot in zip(seqs, slots, strict=True):
        batch.seat(slot, s.seq_id, s.prompt, s.inputs)
        length = np.int32(len(s.prompt))
        batch.state = engine._place(batch.state, np.int32(slot), length, s.inputs, s.first.tokens[0])
        p.hand_over(s)
    return batch
