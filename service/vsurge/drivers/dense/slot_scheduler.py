"""vDriver's slots: one decode engine's dense slots and how each step is planned (the pipeline's Stepper).

A slot is a plain integer, its KV one row of the engine's dense cache. `DenseSlots` inserts prefilled
requests into the lowest free slots, frees a slot the step its last token is dispatched (or when the
detokenizer sees it finish), moves live slots down when that shrinks the step's row bucket (slot_moves.py),
and chooses each step: a mixed step while prompts are written in place, a verify step when n-gram drafts
pay, else a decode step (split around the token masks when a grammar is live).
"""

from __future__ import annotations

import collections
import heapq
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...engines.dense.slot_moves import plan_moves
from ...engines.dense.speculative import worth_verifying
from ...engines.dense.vengine import DenseEngine
from ...structured.slots import SlotGrammars
from ..active_request import ActiveRequest
from ..pipeline import Lane, Pipeline, StepLoop, drain
from ..queue_messages import Abort, Arrived, FirstToken, Prefilled
from .inplace_prefill import InPlacePrefill
from .ngram_drafts import NgramDrafts


@dataclass(frozen=True, slots=True, eq=False)
class SlotOwner:
    """Sample ``index`` of ``req`` in decode slot ``slot`` (its identity is the lease on the slot). Slot
    None: the sample's first token was streamed before it had a slot (`transfer._stream_firsts`)."""

    req: ActiveRequest
    index: int
    slot: int | None
    cached_tokens: int = 0  # dense prefill reuses nothing


class DenseSlots:
    """One decode engine's slots and its step planning: vDriver's Stepper (pipeline.py)."""

    def __init__(self, pipeline: Pipeline, engine: DenseEngine, lane: Lane, may_prefill: threading.Event):
        self.pipeline, self.engine, self.lane = pipeline, engine, lane
        # set once per step: in interleaved mode the driver's prefill thread waits for it
        self.may_prefill = may_prefill
        self.owners: list[SlotOwner | None] = [None] * engine.max_concurrent_decodes
        # a heap: the lowest free slot goes first, so live slots stay packed and decode covers few rows
        self.free = list(range(engine.max_concurrent_decodes))
        self.waiting: collections.deque[Prefilled] = collections.deque()
        # tokens each slot may still produce beyond the steps already dispatched (max_tokens or the
        # context): known on the host, so a slot is freed the step its last token is dispatched, not
        # when the detokenizer sees it, up to detokenizing_blocks steps later
        self.left = np.zeros(engine.max_concurrent_decodes, np.int64)
        self.last_step = time.monotonic()
        # structured output: matchers and token masks of the constrained slots (structured/slots.py)
        self.grammars = SlotGrammars(
            engine.max_concurrent_decodes, engine.model_config.vocab_size, engine.eos_token_ids
        )
        # constrained requests wait here until the engine's structured programs are compiled
        self.held: collections.deque[Prefilled] = collections.deque()
        self._loop: Any = None  # the step thread's StepLoop, set by plan()
        self._warming: threading.Thread | None = None
        # n-gram speculation (speculative="ngram"): every slot's tokens on the host, for the proposer
        spec = engine.speculator
        self.drafts = (
            NgramDrafts(engine.max_concurrent_decodes, spec.k, engine.max_length)
            if spec is not None
            else None
        )
        # max_num_batched_tokens set: prompts prefilled inside the decode steps (inplace_prefill.py)
        self.inplace = InPlacePrefill(self) if engine.mixed is not None else None
        self.moved = 0  # live slots moved down so far (_compact)

    @staticmethod
    def owner_of(req: ActiveRequest, index: int, slot: int) -> SlotOwner:
        return SlotOwner(req, index, slot)

    def _receive(self, item: Any) -> None:
        if isinstance(item, Arrived):
            self.inplace.arrived.append(item.req)
        else:
            self.waiting.append(item)

    def _room(self) -> int:
        """How many more arrivals the step thread takes in: up to one per slot waiting for a slot."""
        arrived = len(self.inplace.arrived) if self.inplace is not None else 0
        return max(0, self.engine.max_concurrent_decodes - len(self.waiting) - arrived)

    @property
    def used(self) -> int:
        return self.engine.max_concurrent_decodes - len(self.free)

    def release(self, slot: int) -> None:
        self.owners[slot] = None
        self.left[slot] = 0
        self.grammars.release(slot)
        if self.drafts is not None:
            self.drafts.release(slot)
        self.engine.free_resource(slot)
        heapq.heappush(self.free, slot)

    # ------------------------------------------------------------------ Stepper
    def init_state(self) -> Any:
        self.last_step = time.monotonic()  # the stall counts from the step thread's start, not compile()
        return self.engine.init_decode_state()

    def plan(self, state: Any, loop: StepLoop) -> tuple[Any, bool]:
        self._loop = loop
        self._drop_ended(loop)
        # take from the backlog only what the slots could start soon: a prefilled prompt holds its KV on
        # the device until it has a slot, so the bounded backlog (and, behind it, the prefill queue and
        # its 429) is what holds a burst back, not an ever-growing `waiting`
        for item in drain(self.lane.backlog, self._room()):
            self._receive(item)
        self._hold_structured(loop)
        state = self._insert_waiting(state, loop)
        if self.inplace is not None:
            self.inplace.admit(loop)
        state = self._compact(state)
        # decode never waits for prompts on their way: they join the batch at the next step they are ready
        if all(o is None for o in self.owners) and not self.inplace:
            self.may_prefill.set()
            loop.flush()
            try:
                self._receive(self.lane.backlog.get(timeout=0.05))
            except queue.Empty:
                pass
            return state, False
        return state, True

    def step(self, state: Any) -> tuple[Any, Any, list[SlotOwner | None]]:
        self.last_step = time.monotonic()
        owners = list(self.owners)  # the step's rows, as the detokenizer will account them
        self.step_kind = "decode"  # what the step runs, for its timing (step_timing.py)
        if self.inplace and not self.grammars:  # prompts being prefilled: a mixed step
            self.step_kind = "mixed"
            state, out, seats = self.inplace.step(state)
            if self.drafts is not None:
                self.drafts.advance(np.asarray(out.tokens))
            self._dispatched(1)
            return self.inplace.seat(state, self._loop, *seats), out, owners
        if self.drafts is None:
            if self.engine.decode_steps > 1 and not self.grammars:  # K steps in one program
                self.step_kind = "decode_block"
                state, out = self.engine.decode_block(state)
                self._dispatched(self.engine.decode_steps)
                return state, out, owners
            state, out = self._decode(state)
            self._dispatched(1)
            return state, out, owners
        # speculation: the proposer needs every step's tokens before the next step, so each is read here
        draft, num = self.drafts.propose() if not self.grammars else (None, None)
        if num is not None and self._verify_pays(num):
            self.step_kind = "verify"
            state, out = self.engine.verify(state, draft, num)
            tokens, accepted = np.asarray(out.tokens), np.asarray(out.num_accepted)
            self.drafts.observe(draft, num, tokens[:, 0])
            self.drafts.advance(tokens, accepted)
            self.pipeline.metrics.drafted(int(num.sum()), int(accepted.sum()))
            self._dispatched(accepted.astype(np.int64) + 1)
            return state, out, owners
        state, out = self._decode(state)
        tokens = np.asarray(out.tokens)
        if num is not None:
            self.drafts.observe(draft, num, tokens)
        self.drafts.advance(tokens)
        self._dispatched(1)
        return state, out, owners

    def _dispatched(self, produced: int | np.ndarray) -> None:
        """A step is out that gives each live row ``produced`` tokens (per row for a verify step): free
        the slots whose last token it holds. The detokenizer still gets their tokens, from the step's own
        owners; its later release of them finds the slot no longer theirs and does nothing."""
        rows = len(self.left) if np.ndim(produced) == 0 else len(produced)
        self.left[:rows] -= produced
        for slot in np.flatnonzero(self.left[:rows] <= 0):
            if self.owners[slot] is not None:
                self.release(int(slot))

    def _verify_pays(self, num_draft: np.ndarray) -> bool:
        spec = self.engine.speculator
        live = sum(o is not None for o in self.owners)
        ratio = spec.cost_ratio[self.engine.decode_bucket()]
        return worth_verifying(live, num_draft, self.drafts.p_right, ratio)

    def _decode(self, state: Any) -> tuple[Any, Any]:
        """One token for every live slot (structured slots under their token masks)."""
        if not self.grammars:
            return self.engine.decode(state)
        # a constrained slot is live: the model first, the masks while it runs, then the sampler
        state, logits = self.engine.decode_logits(state)
        for slot, reason in self.grammars.prepare():
            owner = self.owners[slot]
            if owner is not None and not owner.req.samples[owner.index].done:
                self.pipeline.fail(owner.req, reason)
                owner.req.cancel()
        state, out = self.engine.decode_sample(state, logits, self.grammars.mask)
        self.grammars.stepped(out.tokens)
        return state, out

    def stepped(self) -> None:
        self.may_prefill.set()

    def lose_state(self, reason: str) -> Any:
        if self.inplace is not None:
            self.inplace.end(lambda req: self.pipeline.fail(req, reason))
        for slot, owner in enumerate(self.owners):
            if owner is not None:
                self.pipeline.fail(owner.req, reason)
                self.release(slot)
        return self.engine.init_decode_state()

    def stopped(self) -> None:
        if self.inplace is not None:
            self.inplace.end(lambda req: self.pipeline.finish(req, "abort"))
        for req in {id(o.req): o.req for o in self.owners if o is not None}.values():
            if not req.done:
                self.pipeline.finish(req, "abort")

    def abort_left(self) -> None:
        """After the threads stopped: nothing waits for a slot and no slot is held."""
        self.waiting.extend(self.held)
        self.held.clear()
        if self.inplace is not None:
            self.inplace.end(lambda req: self.pipeline.finish(req, "abort"))
        while self.waiting:
            self.pipeline.finish(self.waiting.popleft().req, "abort")
        for slot, owner in enumerate(self.owners):
            if owner is not None:
                self.release(slot)

    # ------------------------------------------------------------------ planning
    def _drop_ended(self, loop: StepLoop) -> None:
        """Free the slots the detokenizer saw finish, and every slot of a cancelled request."""
        if self.inplace is not None:
            self.inplace.drop_cancelled(loop)
        for owner in drain(self.lane.release):
            if owner.slot is not None and self.owners[owner.slot] is owner:
                self.release(owner.slot)
                continue
            # finished on its early first token (slot None), or its slot was moved down (_compact): free
            # the slot it holds now, if any
            for slot, o in enumerate(self.owners):
                if o is not None and o.req is owner.req and o.index == owner.index:
                    self.release(slot)
        cancelled = {}
        for slot, owner in enumerate(self.owners):
            if owner is not None and owner.req.cancelled:
                self.release(slot)
                cancelled[id(owner.req)] = owner.req
        for req in cancelled.values():
            loop.send(Abort(req))

    def _compact(self, state: Any) -> Any:
        """Move live slots down into free ones when the next step then covers a smaller row bucket
        (slot_moves.py: a burst's last long requests sit anywhere in the slots). A slot being written in
        place or under a grammar stays put."""
        used = len(self.owners) - len(self.free)
        # the usual step: the live slots already fit the bucket their count needs (one numpy scan)
        if not used or self.engine.decode_bucket() <= self.engine.rows_for(used):
            return state
        pinned = [p.slot for p in self.inplace.prefilling] if self.inplace is not None else []
        live = []
        for slot, owner in enumerate(self.owners):
            if owner is None:
                continue
            (pinned if slot in self.grammars else live).append(slot)
        moves = plan_moves(live, pinned, self.free, self.engine.decode_rows)
        if not moves:
            return state
        state = self.engine.move_slots(state, moves)
        for a, b in moves:
            owner = self.owners[a]
            self.owners[b] = self.owner_of(owner.req, owner.index, b)
            owner.req.samples[owner.index].slot = b
            self.owners[a] = None
            self.left[b], self.left[a] = self.left[a], 0
            if self.drafts is not None:
                self.drafts.move(a, b)
        self.free = sorted(set(self.free) - {b for _, b in moves} | {a for a, _ in moves})
        self.moved += len(moves)
        return state

    def _hold_structured(self, loop: StepLoop) -> None:
        """Constrained requests wait in `held` while the engine compiles its structured programs (once, on
        a background thread); the others go on. Back to the front of the queue once they are ready."""
        ready = self.engine.structured_ready.is_set()
        if ready and not self.held:
            return
        if ready:
            self.waiting.extendleft(reversed(self.held))
            self.held.clear()
            return
        if self._warming is not None and not self._warming.is_alive():  # warm-up failed
            for item in self.held:
                self.pipeline.fail(item.req, "compiling the structured-output programs failed")
            self.held.clear()
        keep = collections.deque()
        for item in self.waiting:
            if getattr(item.req.params, "grammar", None) is None:
                keep.append(item)
            elif item.req.cancelled:
                loop.send(Abort(item.req))
            else:
                self.held.append(item)
        self.waiting = keep
        if self.held and (self._warming is None or not self._warming.is_alive()):
            self._warming = threading.Thread(
                target=self.engine.warm_structured, name="vsurge-structured-warm", daemon=True
            )
            self._warming.start()

    def _insert_waiting(self, state: Any, loop: StepLoop) -> Any:
        """Insert prefilled requests, oldest first, while all n samples of the next one fit. A sample whose
        early first token already finished it (EOS, a stop string, max_tokens 1) takes no slot."""
        while self.waiting and len(self.free) >= self.waiting[0].req.params.n:
            ready = self.waiting.popleft()
            req = ready.req
            if req.cancelled:
                loop.send(Abort(req))
                continue
            early = ready.firsts is not None
            samples = [i for i in range(req.params.n) if not (early and req.samples[i].done)]
            if not samples:
                continue
            slots = [heapq.heappop(self.free) for _ in samples]
            grammar = getattr(req.params, "grammar", None)
            try:
                masks = None if grammar is None else [self.grammars.start(s, grammar) for s in slots]
                state, firsts = self.engine.bulk_insert(
                    ready.prefix,
                    state,
                    slots,
                    keys=None if req.keys is None else [req.keys[i] for i in samples],
                    index=ready.index,
                    length=len(req.prompt_ids),
                    token_masks=masks,
                    firsts=[ready.firsts[i] for i in samples] if early else None,
                )
            except Exception as e:
                for s in slots:
                    self.grammars.release(s)
                    heapq.heappush(self.free, s)
                self.pipeline.fail(req, f"insert failed: {e}")
                continue
            budget = req.budget(self.engine.max_length).tokens
            for i, slot, first in zip(samples, slots, firsts, strict=True):
                owner = SlotOwner(req, i, slot)
                self.owners[slot] = owner
                self.left[slot] = budget - 1  # the first token is out
                req.samples[i].slot = slot
                self.grammars.sampled(slot, first.tokens)
                if self.drafts is not None:
                    first_token = int(np.asarray(first.tokens)[0])
                    self.drafts.start(
                        slot, req.prompt_ids, first_token, req.params, req.budget(self.engine.max_length)
                    )
                if not early:
                    loop.send(FirstToken(owner, first))
                if budget <= 1:  # its first token was its last (a structured request's max_tokens 1)
                    self.release(slot)
        return state
