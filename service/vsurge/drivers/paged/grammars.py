"""oDriver's structured output: the constrained sequences of the paged step thread, their matchers and token
masks (structured/slots.py), and the constrained requests waiting for the masked programs.

A step with a constrained row runs split, as vDriver's (drivers/dense/slot_scheduler.py), so nobody waits for
grammar work:

    dispatch the mixed forward of step n  ->  read each constrained row's token of step n-1 (its sampler
    ran before forward n on the device)  ->  advance its matcher, fill its mask row  ->  the first-token
    masks of the step's constrained final chunks  ->  dispatch the samplers of step n under the masks

The host's mask work overlaps the forward; unconstrained rows carry all-ones rows (their samples are bit
for bit the unmasked ones), and a step with no constrained row or final chunk runs `oEngine.step`, as
before. A sequence's matcher starts when its final chunk is dispatched (its first token is sampled under
the grammar's first mask) and is dropped once the scheduler no longer holds the sequence (finished,
cancelled, preempted); the recompute of a preempted sequence starts a new one that replays the tokens
produced so far. Once the grammar is complete only EOS is allowed, so the request ends with "stop".

The masked programs are compiled by `oEngine.warm_structured` (paged/structured_output.py) on a background thread
the first time a constrained request arrives (or at start, `vSurge.warm_structured`): until then constrained
requests wait here and the others go on.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...engines.paged.mixed_step import ChunkWork
from ...structured.slots import SlotGrammars
from ..pipeline import Pipeline
from ..queue_messages import Prepared
from .page_scheduler import Chunk, PageScheduler, Seq


def grammar_of(req: Any) -> Any:
    return getattr(req.params, "grammar", None)


class PagedGrammars:
    """The step thread's constrained sequences: slot -> sequence, and one SlotGrammars over the slots."""

    def __init__(self, pipeline: Pipeline, engine: Any, sched: PageScheduler):
        self.pipeline, self.engine, self.sched = pipeline, engine, sched
        self.slots = SlotGrammars(
            engine.max_concurrent_decodes, engine.model_config.vocab_size, engine.eos_token_ids
        )
        self.seqs: dict[int, Seq] = {}  # slot -> the sequence its matcher follows
        self.held: collections.deque[Prepared] = collections.deque()
        self._warming: threading.Thread | None = None

    # ------------------------------------------------------------------ waiting for the programs
    @property
    def num_held(self) -> int:
        return sum(len(item.seqs) for item in self.held)

    def hold(self, item: Prepared) -> bool:
        """Whether ``item`` waits here: a constrained request while the masked programs are not compiled
        (their compile starts now, on a background thread, if it is not running)."""
        if grammar_of(item.req) is None or self.engine.structured_ready.is_set():
            return False
        self.held.append(item)
        if self._warming is None or not self._warming.is_alive():
            self._warming = threading.Thread(
                target=self.engine.warm_structured, name="vsurge-structured-warm", daemon=True
            )
            self._warming.start()
        return True

    def ready(self) -> list[Seq]:
        """The held requests' sequences, in arrival order, once the programs are compiled; a failed
        compile fails them."""
        if not self.held:
            return []
        ready = self.engine.structured_ready
        if not ready.is_set():
            failed = self._warming is not None and not self._warming.is_alive() and not ready.is_set()
            if failed:  # the thread ended without setting it
                for item in self.held:
                    self.pipeline.fail(item.req, "compiling the structured-output programs failed")
                self.held.clear()
            return []
        seqs = [seq for item in self.held for seq in item.seqs]
        self.held.clear()
        return seqs

    def drop_cancelled(self) -> list[Any]:
        """Held requests that were cancelled, taken out."""
        gone = [item.req for item in self.held if item.req.cancelled]
        if gone:
            self.held = collections.deque(item for item in self.held if not item.req.cancelled)
        return gone

    def abort_held(self, finish: Callable[[Any, str], None]) -> None:
        for item in self.held:
            finish(item.req, "abort")
        self.held.clear()

    # ------------------------------------------------------------------ steps
    def wanted(self, chunks: Sequence[Chunk]) -> bool:
        """Whether the next step needs masks: a constrained sequence runs, or one's final chunk is in it.
        Drops the matchers of the sequences the scheduler let go since (finished, cancelled, preempted)."""
        for slot, seq in list(self.seqs.items()):
            if not self.sched.holds(seq):
                del self.seqs[slot]
                self.slots.release(slot)
        return bool(self.seqs) or any(c.final and grammar_of(c.seq.req) is not None for c in chunks)

    def step(
        self, state: Any, table: Any, active: np.ndarray, chunks: Sequence[Chunk], work: list[ChunkWork]
    ) -> tuple[Any, Any, list[tuple[int, Any]]]:
        """One step under the masks (after `wanted`): the forward, then (while it runs) the masks, then
        the samplers."""
        eng = self.engine
        state, logits = eng.step_logits(state, table, active, work)
        mask = self._decode_mask()
        work = [self._first_mask(c, w) for c, w in zip(chunks, work, strict=True)]
        state, out, firsts = eng.step_sample(state, logits, active, work, mask)
        if mask is not None:
            self.slots.stepped(out.tokens)  # row = slot
        for k, first in firsts:
            if work[k].token_mask is not None:
                self.slots.sampled(work[k].slot, first.tokens)
        return state, out, firsts

    def _decode_mask(self) -> np.ndarray | None:
        """Each constrained decoding row's matcher advanced by its last token and its mask row filled
        (the mask of every slot); None when no constrained sequence decodes."""
        if not any(seq.decoding for seq in self.seqs.values()):
            return None
        for slot, reason in self.slots.prepare():
            seq = self.seqs.get(slot)
            if seq is not None and not seq.req.samples[seq.index].done:
                self.pipeline.fail(seq.req, reason)
                seq.req.cancel()
        return self.slots.mask

    def _first_mask(self, chunk: Chunk, work: ChunkWork) -> ChunkWork:
        """A constrained final chunk: its matcher starts (replaying what a recompute already produced)
        and its first token is sampled under the grammar's mask."""
        seq, grammar = chunk.seq, grammar_of(chunk.seq.req)
        if not chunk.final or grammar is None:
            return work
        self.seqs[seq.slot] = seq
        produced = seq.tokens[seq.prompt_len :].tolist()
        return work._replace(token_mask=self.slots.start(seq.slot, grammar, produced))

    def reset(self) -> None:
        """Every sequence is gone (the cache restarts)."""
        for slot in self.seqs:
            self.slots.release(slot)
        self.seqs.clear()
