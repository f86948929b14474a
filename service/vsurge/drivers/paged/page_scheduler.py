"""Host-side scheduling of the paged engine: slots, admission by pages, prefill chunks, growth, preemption.

Pure Python over an HBMPageManager (no JAX), so its rules are tested on their own:

* a waiting sequence is admitted, in arrival order, when a slot is free and the pages for all its tokens
  fit (a cached prefix counts as already there); while others run, a small reserve of pages is kept back
  so a new admission does not force an immediate preemption;
* prefill runs in chunks of at most ``max_chunk`` tokens, oldest sequence first, about ``max_chunk`` tokens
  per engine step, so a long prompt never stalls decoding for long and is never truncated;
* or, for the mixed step (`plan_step`): one token budget per step, as vLLM's scheduler has it. Every
  decoding sequence takes one token of it; what is left goes to prefill chunks, oldest sequence first,
  up to a few sequences per step (`plan_chunks`, the mixed step's rule), so decode never waits for a whole prompt;
* before each decode step every decoding sequence gets the page its next token goes to; when pages run
  out the youngest sequence (latest admitted) is preempted: its pages return and it is recomputed later,
  ahead of new arrivals. The oldest sequence can always proceed (a sequence of max_length fits in the
  cache by construction), so nothing deadlocks and nothing fails for lack of pages.

Per step the work is O(slots); nothing walks pages or tokens except admission and prefix hashing.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...contracts.token_budget import TokenBudget
from ...engines.paged.mixed_step import plan_chunks
from ...engines.paged.paging import HBMPageManager


@dataclass(eq=False)
class Seq:
    """One sample of a request, (re)computed from ``tokens``: its identity is the lease on its slot."""

    req: Any  # the ActiveRequest (opaque here)
    index: int  # which of the request's n samples
    tokens: np.ndarray  # i32: the prompt, plus the tokens generated before a preemption
    keys: list[bytes]  # prefix keys of the full pages of `tokens`
    generated: int  # tokens generated before this (re)compute: the sampler step of its next token
    prompt_len: int  # of the original prompt (max_length is counted from it)
    budget: TokenBudget  # its request's (ActiveRequest.budget): the detokenize thread reads the same one
    inputs: Any = None  # device inputs of its first-token sampling, prepared off the generate thread
    slot: int = -1
    cursor: int = 0  # tokens whose KV is written or dispatched (cached prefix + chunks + decode steps)
    produced: int = 0  # tokens produced so far, those in flight included
    order: int = 0  # admission order: the youngest is preempted first
    published: int = 0  # full pages already published to the prefix cache
    decoding: bool = False
    cached_tokens: int = 0  # prefix tokens reused at admission

    def fresh(self) -> Seq:
        """A copy to recompute from scratch (a prefilling sequence that was preempted)."""
        return Seq(
            self.req,
            self.index,
            self.tokens,
            self.keys,
            self.generated,
            self.prompt_len,
            self.budget,
            self.inputs,
        )


@dataclass
class Chunk:
    seq: Seq
    start: int
    length: int  # tokens in this chunk
    final: bool


@dataclass
class PageScheduler:
    manager: HBMPageManager
    num_slots: int
    max_length: int
    max_chunk: int
    reserve_fraction: float = 0.01
    slots: list[Seq | None] = field(init=False)
    waiting: collections.deque = field(init=False)
    table: np.ndarray = field(init=False)  # i32[S, W]: decoding sequences' page tables; 0 = scratch
    table_version: int = 0
    preemptions: int = 0

    def __post_init__(self):
        ps = self.manager.page_size
        self.width = -(-self.max_length // ps)
        if self.manager.num_pages < self.width:
            raise ValueError(
                f"the KV cache holds {self.manager.num_pages} pages of {ps} tokens but one sequence of "
                f"max_length {self.max_length} needs {self.width}: raise the KV budget or lower max_length"
            )
        self.slots = [None] * self.num_slots
        self.waiting = collections.deque()
        self.table = np.zeros((self.num_slots, self.width), np.int32)
        # a heap: the lowest free slot goes first, so live slots stay packed and decode covers few rows
        self._free_slots = list(range(self.num_slots))
        self._order = 0
        self.reserve = max(1, int(self.reserve_fraction * self.manager.num_pages))

    # ------------------------------------------------------------------ figures
    @property
    def running(self) -> list[Seq]:
        return [s for s in self.slots if s is not None]

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free_slots)

    def any_decoding(self) -> bool:
        return any(s is not None and s.decoding for s in self.slots)

    def any_prefilling(self) -> bool:
        return any(s is not None and not s.decoding for s in self.slots)

    # ------------------------------------------------------------------ queue
    def add(self, seq: Seq, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def admit(self) -> list[Seq]:
        """Admit waiting sequences in order while a slot is free and their pages fit."""
        admitted = []
        ps = self.manager.page_size
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            if seq.index > 0 and any(
                s is not None and s.req is seq.req and not s.decoding for s in self.slots
            ):
                break  # a sibling sample is still prefilling: wait for its pages to be cached, then share them
            n = len(seq.tokens)
            # at least the last token is computed: its logits give the next token
            reusable = seq.keys[: (n - 1) // ps]
            busy = any(s is not None for s in self.slots)
            need = self.manager.pages_for(n) - len(self.manager.lookup(reusable))
            if busy and self.manager.num_free - need < self.reserve:
                break
            cached = self.manager.allocate(seq, n, reusable)
            if cached is None:
                break
            self.waiting.popleft()
            seq.slot = heapq.heappop(self._free_slots)
            seq.cursor = seq.cached_tokens = cached
            seq.published = cached // ps
            self._order += 1
            seq.order = self._order
            self.slots[seq.slot] = seq
            admitted.append(seq)
        return admitted

    # ------------------------------------------------------------------ prefill
    def plan_prefill(self) -> list[Chunk]:
        """The chunks to run now, oldest sequence first, about ``max_chunk`` tokens in all."""
        budget = self.max_chunk
        out = []
        for seq in sorted((s for s in self.slots if s is not None and not s.decoding), key=lambda s: s.order):
            while budget > 0 and seq.cursor < len(seq.tokens):
                n = min(len(seq.tokens) - seq.cursor, self.max_chunk)
                out.append(Chunk(seq, seq.cursor, n, seq.cursor + n == len(seq.tokens)))
                seq.cursor += n
                budget -= n
            if budget <= 0:
                break
        return out

    def plan_step(self, budget: int, max_seqs: int, max_tokens: int | None = None) -> list[Chunk]:
        """The prefill chunks of the next mixed step (see `plan_chunks`); their tokens count as dispatched."""
        pre = sorted((s for s in self.slots if s is not None and not s.decoding), key=lambda s: s.order)
        decoding = sum(1 for s in self.slots if s is not None and s.decoding)
        lens = plan_chunks([len(s.tokens) - s.cursor for s in pre], decoding, budget, max_seqs, max_tokens)
        out = []
        for seq, n in zip(pre, lens, strict=False):
            out.append(Chunk(seq, seq.cursor, n, seq.cursor + n == len(seq.tokens)))
            seq.cursor += n
        return out

    def active_rows(self, rows: int | None = None) -> np.ndarray:
        """bool per leading slot (through the highest decoding one): whether it decodes in the next step."""
        rows = self.decode_rows() if rows is None else rows
        return np.array([s is not None and s.decoding for s in self.slots[:rows]], bool)

    def row(self, seq: Seq) -> np.ndarray:
        """The sequence's page table padded with scratch to the table width."""
        row = np.zeros(self.width, np.int32)
        pages = self.manager.table(seq)
        row[: len(pages)] = pages
        return row

    def written(self, seq: Seq, upto: int) -> None:
        """Tokens [0, upto) of ``seq`` are dispatched: publish its newly full pages to the prefix cache."""
        full = min(upto // self.manager.page_size, len(seq.keys))
        if full > seq.published:
            self.manager.register(seq, seq.keys[:full], start=seq.published)
            seq.published = full

    def start_decoding(self, seq: Seq) -> bool:
        """The final chunk is dispatched (its first token sampled). False if the sequence is already done."""
        seq.decoding = True
        seq.produced = seq.generated + 1
        if self._done(seq):
            return False
        pages = self.manager.table(seq)
        self.table[seq.slot, :] = 0
        self.table[seq.slot, : len(pages)] = pages
        self.table_version += 1
        return True

    # ------------------------------------------------------------------ decode
    def grow(self) -> list[Seq]:
        """Give every decoding sequence the page of its next token; returns the sequences preempted."""
        preempted = []
        ps = self.manager.page_size
        for seq in sorted((s for s in self.slots if s is not None and s.decoding), key=lambda s: s.order):
            if not self.holds(seq):
                continue  # preempted earlier in this loop
            while not self.manager.grow(seq, seq.cursor + 1):
                victim = max(self.running, key=lambda s: s.order)
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                idx = seq.cursor // ps
                if self.table[seq.slot, idx] == 0:
                    self.table[seq.slot, idx] = self.manager.table(seq)[idx]
                    self.table_version += 1
        return preempted

    def decode_tokens(self) -> int:
        """Positions the next decode step must read: through the furthest decoding sequence's new token."""
        return max((s.cursor + 1 for s in self.slots if s is not None and s.decoding), default=1)

    def decode_rows(self) -> int:
        """Slots the next decode step must cover: through the highest decoding slot."""
        return max((s.slot + 1 for s in self.slots if s is not None and s.decoding), default=1)

    def decoding(self, rows: int) -> list[Seq | None]:
        """Per slot < rows, the sequence that decodes in the next step (the snapshot the detokenizer reads)."""
        return [s if s is not None and s.decoding else None for s in self.slots[:rows]]

    def stepped(self) -> list[Seq]:
        """A decode step was dispatched. Returns the sequences that just produced their last token."""
        done = []
        for seq in self.slots:
            if seq is not None and seq.decoding:
                seq.cursor += 1
                seq.produced += 1
                if self._done(seq):
                    done.append(seq)
        for seq in done:
            self.release(seq)
        return done

    def _done(self, seq: Seq) -> bool:
        # known on the host without reading tokens: the sample's budget (max_tokens within max_length)
        return seq.budget.spent(seq.produced)

    # ------------------------------------------------------------------ ends
    def holds(self, seq: Seq) -> bool:
        return 0 <= seq.slot < self.num_slots and self.slots[seq.slot] is seq

    def release(self, seq: Seq) -> bool:
        """Free the sequence's slot and pages (finished, cancelled, failed). False if it holds none."""
        if not self.holds(seq):
            return False
        self.manager.free(seq)
        self.slots[seq.slot] = None
        if self.table[seq.slot].any():
            self.table[seq.slot] = 0
            self.table_version += 1
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = -1
        return True

    def preempt(self, seq: Seq) -> None:
        self.release(seq)
        self.preemptions += 1

    def drop_waiting(self, pred) -> list[Seq]:
        """Remove and return the waiting sequences for which ``pred(seq)`` holds."""
        gone = [s for s in self.waiting if pred(s)]
        if gone:
            self.waiting = collections.deque(s for s in self.waiting if not pred(s))
        return gone

    def reset(self) -> list[Seq]:
        """Release everything (after a failed device step); returns the sequences that were running."""
        running = self.running
        for seq in running:
            self.release(seq)
        self.manager.drop_cache()
        return running
