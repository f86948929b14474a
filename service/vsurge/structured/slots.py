"""SlotGrammars: the constrained slots of one decode lane, on the step thread.

How a structured step runs (vEngine's split step), so that nobody waits for grammar work:

    dispatch model(n)  ->  read tokens of step n-1 (done: model(n) is already queued behind it)
                       ->  each constrained slot's matcher accepts its token, fills its mask row (host)
                       ->  upload the mask (S x ceil(V/32) int32: 196 KB at 32 x 49152)
                       ->  dispatch sampler(n) under the mask

The device runs the model of step n while the host advances the matchers, so the mask costs the batch
nothing as long as the masks of all constrained slots take less than one model forward (measured: ~20 us
p50, ~250 us p99 per slot on SmolLM2's vocabulary; a step's model forward is ~100 ms on the dev CPU).
Every constrained slot advances every step (no lag); unconstrained rows keep all-ones mask rows, which
leave their logits bit for bit unchanged, and a batch with no constrained slot runs the fused decode program
as before. EOS is allowed only where the grammar accepts; once the grammar is complete only EOS is, so the
request stops with finish_reason "stop" on the next token.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .bitmask import ALL_ALLOWED, allocate_bitmask
from .compiler import CompiledGrammar
from .matcher import GrammarMatcher


class SlotGrammars:
    def __init__(self, slots: int, vocab_size: int, eos_token_ids: Sequence[int]):
        self.mask = allocate_bitmask(slots, vocab_size)
        self._eos_row = np.zeros(self.mask.shape[1], np.int32)
        for t in eos_token_ids:
            if 0 <= t < vocab_size:
                self._eos_row[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
        self._matchers: dict[int, GrammarMatcher] = {}
        self._unread: dict[int, tuple[Any, int]] = {}  # slot -> (device tokens, row) not yet accepted
        self.fill_seconds: collections.deque[float] = collections.deque(maxlen=4096)  # per slot and step

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def __contains__(self, slot: int) -> bool:
        return slot in self._matchers

    def start(self, slot: int, grammar: CompiledGrammar, accepted: Sequence[int] = ()) -> np.ndarray:
        """A new sample in ``slot``: its matcher, and the mask row of its first token (i32[1, W]).
        ``accepted``: tokens the sample produced before (a recompute after preemption), replayed first
        (sampled under the mask, so the grammar takes them; one it did not would leave only EOS)."""
        m = grammar.matcher()
        for t in accepted:
            if m.done or not m.accept(t):
                break
        self._unread.pop(slot, None)
        self._matchers[slot] = m
        self._fill(slot, m)
        return self.mask[slot : slot + 1].copy()

    def sampled(self, slot: int, tokens: Any, row: int = 0) -> None:
        """The slot's next token is row ``row`` of ``tokens`` (a device array still being computed)."""
        if slot in self._matchers:
            self._unread[slot] = (tokens, row)

    def stepped(self, tokens: Any) -> None:
        """A decode step sampled every constrained slot: row = slot."""
        for slot in self._matchers:
            self._unread[slot] = (tokens, slot)

    def prepare(self) -> list[tuple[int, str]]:
        """Accept each constrained slot's last token and fill its next mask row; (slot, reason) for samples
        whose token the grammar rejected (cannot happen for tokens sampled under the mask)."""
        host: dict[int, np.ndarray] = {}
        failed = []
        for slot, m in self._matchers.items():
            unread = self._unread.pop(slot, None)
            if unread is not None and not m.done:
                arr, row = unread
                key = id(arr)
                if key not in host:
                    host[key] = np.asarray(arr)  # its copy to the host was started with the step
                tok = int(host[key][row])
                if not m.accept(tok):
                    failed.append((slot, f"the grammar rejected token {tok}: {m.error}"))
            self._fill(slot, m)
        return failed

    def release(self, slot: int) -> None:
        if self._matchers.pop(slot, None) is not None:
            self._unread.pop(slot, None)
            self.mask[slot] = ALL_ALLOWED

    def _fill(self, slot: int, m: GrammarMatcher) -> None:
        t = time.perf_counter()
        if m.done or m.error:
            self.mask[slot] = self._eos_row  # complete (or broken): only EOS may follow
        else:
            m.fill(self.mask[slot])
        self.fill_seconds.append(time.perf_counter() - t)
