"""vDriver: continuous batching over vEngines (dense KV per slot), on the shared pipeline.

    submit -> [prefill queue] -> prefill thread(s) -> [transfer queue] -> transfer thread
           -> [backlog per decode engine] -> step thread -> [detokenize queue] -> detokenize thread
           -> each request's ReturnChannel

The queues, threads, request lifecycle and detokenizer are the pipeline's (pipeline.py). What is vDriver's
own: the feeders and the slots. A prefill thread packs the prompts waiting in the queue (up to the engine's
max_concurrent_prefill, within its prefill_pack_tokens) into one prefill call: under load the prompt work
is batched, while a lone prompt goes at once; the transfer thread moves the prefixes to a decode engine's
devices and streams each request's first token (sampled there, so it waits neither for the step in flight
nor for a free slot). Each decode engine's step thread holds its slots (plain integers, ``DenseSlots``),
inserts prefilled requests into free slots and runs the decode steps.

With ``max_num_batched_tokens`` set, the prefill thread only forwards prompts (`Arrived`) and the decode
steps prefill them in place, chunk by chunk, beside the decoding rows (inplace_prefill.py); requests with
n > 1, prompt logprobs or a grammar still take the prefill path above.
"""

from __future__ import annotations

import collections
import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..engine_config import EngineConfig
from ..engines.prefill_rows import first_fit
from ..engines.sampling import SampleResult
from ..engines.slot_moves import plan_moves
from ..engines.speculative import worth_verifying
from ..engines.vengine import vEngine
from ..structured.slots import SlotGrammars
from .active_request import ActiveRequest
from .inplace_prefill import InPlacePrefill, prefilled_in_step
from .lanes import Abort, Arrived, FirstToken, Prefilled, PrefilledPack
from .metrics import DriverMetrics
from .ngram_drafts import NgramDrafts
from .pipeline import Lane, Pipeline, StepLoop, drain

log = logging.getLogger(__name__)
_DEFAULTS = EngineConfig()  # the driver knobs' defaults live in EngineConfig
# A prefill call on an idle engine lingers for a burst: after its first prompt it keeps taking prompts
# while each arrives within PREFILL_GAP_S of the last, for at most PREFILL_LINGER_S in all. Clients that
# submit together (32 at once through one asyncio loop) arrive over several ms; without the linger a burst
# was prefilled as a lone first call and then the rest, and decoded in two cohorts. While streams decode
# a call takes what is there: lingering then raised mixed-32's TTFT p50 (HTTP, every bfloat16 knob +
# ngram: 2.03 s against 1.59 s before the linger; 1.71 against 1.63 s without it, one run each).
PREFILL_GAP_S = 0.005
PREFILL_LINGER_S = 0.025
# While streams decode, a prefill call holds at most this many prompts in this many rows (the bounds of
# before the idle burst took whole calls): a call's prompts see their first token only when the whole call
# is done (an earlier try measured larger busy calls raising mixed-32's TTFT p50 from 1.35 s to 1.58-1.66 s,
# HTTP, two runs; the larger idle calls measured no TTFT cost, see the README)
BUSY_PREFILL_PROMPTS = 16
BUSY_PREFILL_ROWS = 4


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


@dataclass(frozen=True, slots=True, eq=False)
class SlotOwner:
    """Sample ``index`` of ``req`` in decode slot ``slot`` (its identity is the lease on the slot). Slot
    None: the sample's first token was streamed before it had a slot (`vDriver._stream_firsts`)."""

    req: ActiveRequest
    index: int
    slot: int | None
    cached_tokens: int = 0  # dense prefill reuses nothing


class DenseSlots:
    """One decode engine's slots and its step planning: vDriver's Stepper (pipeline.py)."""

    def __init__(self, driver: vDriver, engine: vEngine, lane: Lane):
        self.driver, self.engine, self.lane = driver, engine, lane
        self.pipeline = driver.pipeline
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
            engine.max_concurrent_decodes, engine.config.vocab_size, engine.eos_token_ids
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
        for item in drain(self.lane.backlog):
            self._receive(item)
        self._hold_structured(loop)
        state = self._insert_waiting(state, loop)
        if self.inplace is not None:
            self.inplace.admit(loop)
        state = self._compact(state)
        # decode never waits for prompts on their way: they join the batch at the next step they are ready
        if all(o is None for o in self.owners) and not self.inplace:
            self.driver._may_prefill.set()
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
        if self.inplace and not self.grammars:  # prompts being prefilled: a mixed step
            state, out, seats = self.inplace.step(state)
            if self.drafts is not None:
                self.drafts.advance(np.asarray(out.tokens))
            self._dispatched(1)
            return self.inplace.seat(state, self._loop, *seats), out, owners
        if self.drafts is None:
            state, out = self._decode(state)
            self._dispatched(1)
            return state, out, owners
        # speculation: the proposer needs every step's tokens before the next step, so each is read here
        draft, num = self.drafts.propose() if not self.grammars else (None, None)
        if num is not None and self._verify_pays(num):
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
        self.driver._may_prefill.set()

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
            context = self.engine.max_length - len(req.prompt_ids)
            budget = context if req.params.max_tokens is None else min(req.params.max_tokens, context)
            for i, slot, first in zip(samples, slots, firsts, strict=True):
                owner = SlotOwner(req, i, slot)
                self.owners[slot] = owner
                self.left[slot] = budget - 1  # the first token is out
                req.samples[i].slot = slot
                self.grammars.sampled(slot, first.tokens)
                if self.drafts is not None:
                    first_token = int(np.asarray(first.tokens)[0])
                    self.drafts.start(slot, req.prompt_ids, first_token, req.params, self.engine.max_length)
                if not early:
                    loop.send(FirstToken(owner, first))
                if budget <= 1:  # its first token was its last (a structured request's max_tokens 1)
                    self.release(slot)
        return state


class vDriver:  # noqa: N801 - the seed's name
    supports_structured_output = True  # token masks in DenseSlots (structured/slots.py)

    def __init__(
        self,
        prefill_engines: list[vEngine] | vEngine | None = None,
        decode_engines: list[vEngine] | vEngine | None = None,
        interleaved_mode: bool = _DEFAULTS.interleaved_mode,
        detokenizing_blocks: int = _DEFAULTS.detokenizing_blocks,
        max_queue_size: int = _DEFAULTS.max_queue_size,
        max_decode_stall: float = _DEFAULTS.max_decode_stall,
    ):
        self._prefill_engines = _as_list(prefill_engines)
        self._decode_engines = _as_list(decode_engines) or list(self._prefill_engines)
        if not self._prefill_engines:
            self._prefill_engines = list(self._decode_engines)
        if not self._decode_engines:
            raise ValueError("vDriver needs at least one engine")
        self.interleaved_mode = interleaved_mode
        self.detokenizing_blocks = detokenizing_blocks
        # accepted for compatibility only: decode no longer waits for prompts being prefilled (issue 14:
        # a long prompt held every running stream for up to this long)
        self.max_decode_stall = max_decode_stall
        self.pipeline = Pipeline(max_queue_size, detokenizing_blocks)
        self._transfer_q: queue.Queue = queue.Queue(max(4, 2 * len(self._decode_engines)))
        self._slots = [
            DenseSlots(self, e, self.pipeline.new_lane(2 * e.max_concurrent_decodes))
            for e in self._decode_engines
        ]
        self._may_prefill = threading.Event()  # interleaved mode: set by the step thread once per step
        self._speculative = any(e.speculator is not None for e in self._decode_engines)
        # max_num_batched_tokens set: the decode steps prefill prompts in place (inplace_prefill.py)
        self._mixed = all(e.mixed is not None for e in self._decode_engines)

    # ------------------------------------------------------------------ seed API
    @property
    def driver_name(self) -> str:
        return f"vdriver-{self._decode_engines[0].model_name}"

    @property
    def processor(self) -> Any:
        return self._decode_engines[0].processor

    @property
    def engines(self) -> list[vEngine]:
        return list(dict.fromkeys(self._prefill_engines + self._decode_engines))

    @property
    def live(self) -> bool:
        return self.pipeline.live

    def compile(self, progress: Callable[[str], None] | None = None) -> float:
        return sum(e.compile(progress) for e in self.engines)

    @property
    def num_used_slots(self) -> int:
        return sum(s.used for s in self._slots)

    def get_total_concurrent_requests(self) -> int:
        return sum(e.max_concurrent_decodes for e in self._decode_engines)

    def add_observer(self, fn) -> None:
        self.pipeline.metrics.observers.append(fn)

    def submit_request(self, request: Any) -> None:
        self.pipeline.submit(request, self._decode_engines[0].max_concurrent_decodes)

    def place_request_on_prefill_queue(self, request: ActiveRequest) -> None:
        self.submit_request(request)

    def metrics(self) -> DriverMetrics:
        used = self.num_used_slots
        total = self.get_total_concurrent_requests()
        m = self.pipeline.metrics
        backlog = sum(
            s.lane.backlog.qsize() + len(s.waiting) + (len(s.inplace.arrived) if s.inplace is not None else 0)
            for s in self._slots
        )
        # the transfer queue holds packs, not requests, and a prefill thread holds some in its hands: the
        # pipeline count is exact for everything before the lanes
        waiting = self.pipeline.in_pipeline + backlog
        return DriverMetrics(
            slots_used=used,
            slots_total=total,
            slot_occupancy=used / total if total else 0.0,
            prefill_queue_size=self.pipeline.prefill_q.qsize(),
            transfer_queue_size=self._transfer_q.qsize(),
            generate_backlog_size=backlog,
            requests_running=max(0, m.running - waiting),
            requests_waiting=waiting,
            prompt_tokens_total=m.prompt_tokens,
            generation_tokens_total=m.generated_tokens,
            finished_total=dict(m.finished),
            spec_decode_draft_tokens_total=m.draft_tokens if self._speculative else None,
            spec_decode_accepted_tokens_total=m.accepted_tokens if self._speculative else None,
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.pipeline.live:
            return
        p = self.pipeline
        threads = [(self._prefill_loop, (e,), f"prefill-{i}") for i, e in enumerate(self._prefill_engines)]
        threads.append((self._transfer_loop, (), "transfer"))
        for i, s in enumerate(self._slots):
            threads.append((p.step_loop, (s.lane, s), f"generate-{i}"))
            threads.append((p.detokenize_loop, (s.lane, s.engine.max_length), f"detokenize-{i}"))
        p.start(threads)

    def stop(self) -> None:
        """Stop every thread; requests still queued or running end with finish_reason 'abort'."""
        if not self.pipeline.live:
            return
        self.pipeline.stop([s.lane for s in self._slots])
        for item in drain(self._transfer_q):
            for req in item.batch:
                self.pipeline.finish(req, "abort")
        for s in self._slots:
            s.abort_left()

    # ------------------------------------------------------------------ prefill and transfer threads
    def _admit_prefill(self, engine: vEngine, req: ActiveRequest) -> bool:
        """False when the request ends here (cancelled, or a prompt this engine cannot prefill)."""
        if req.cancelled:
            self.pipeline.finish(req, "abort")
            return False
        try:
            engine.check_prompt(req.prompt_ids)
        except Exception as e:  # one bad request must not take the driver down
            self.pipeline.fail(req, f"prefill failed: {e}")
            return False
        return True

    def _take_batch(self, engine: vEngine, carry: collections.deque[ActiveRequest]) -> list[ActiveRequest]:
        """The requests of the next prefill call: what is waiting (``carry`` first: taken from the queue
        but left out of the last call) that fits one call: one row of prefill_pack_tokens, or, when
        prompts queue up, several such rows (a longer prompt goes alone: filling its bucket's padding with
        the prompts behind it measured 3-6% slower under mixed-32). A multi-row call holds as many rows as
        are full: the prompts of a row that would only pad it to the next compiled row count wait for the
        next call.

        How big a call may be depends on whether anything decodes. An idle engine takes up to
        max_concurrent_prefill prompts in up to prefill_pack_rows rows, so a burst decodes together from
        its first step (`benchmarks/engine.py`, 64 x 32-token prompts on 64 slots: 87% -> 99% of the raw
        loop); while streams decode, BUSY_PREFILL_PROMPTS in BUSY_PREFILL_ROWS."""
        largest = max(engine.pack_rows, default=1)
        max_prompts, max_rows = engine.max_concurrent_prefill, largest
        batch: list[ActiveRequest] = []
        q = self.pipeline.prefill_q
        linger_until = time.monotonic()
        while len(batch) < max_prompts:
            if carry:
                req = carry.popleft()
            else:
                try:
                    if batch:
                        req = q.get(timeout=max(0.0, min(PREFILL_GAP_S, linger_until - time.monotonic())))
                    else:
                        req = q.get(timeout=0.1)
                        linger_until = time.monotonic() + PREFILL_LINGER_S
                except queue.Empty:
                    break
            if not self._admit_prefill(engine, req):
                continue
            if not batch and self.num_used_slots:  # whether streams decode now, not when the wait began
                max_prompts = min(engine.max_concurrent_prefill, BUSY_PREFILL_PROMPTS)
                max_rows = min(largest, BUSY_PREFILL_ROWS)
                linger_until = time.monotonic()  # and no linger: take what is there
            alone = engine.needs_chunks(req.prompt_ids, req.params)  # chunk by chunk, in its own call
            lengths = [len(r.prompt_ids) for r in batch] + [len(req.prompt_ids)]
            if batch and (alone or engine.pack_rows_for(lengths, max_rows) is None):
                carry.appendleft(req)
                break
            batch.append(req)
            if alone:
                break
        rows = engine.pack_rows_for([len(r.prompt_ids) for r in batch], max_rows) if batch else 1
        if rows is not None and rows > 1:
            where = first_fit([len(r.prompt_ids) for r in batch], engine.prefill_pack_tokens)
            full = max(r for r in (1, *engine.pack_rows) if r <= max(where) + 1)
            carry.extendleft(reversed([r for r, w in zip(batch, where, strict=True) if w >= full]))
            batch = [r for r, w in zip(batch, where, strict=True) if w < full]
        return batch

    def _prefill_loop(self, engine: vEngine) -> None:
        if self._mixed:
            self._feed_loop(engine)
            return
        carry: collections.deque[ActiveRequest] = collections.deque()
        batch: list[ActiveRequest] = []
        while self.pipeline.live:
            batch = self._take_batch(engine, carry)
            if not batch:
                continue
            handed_off = self._prefill_batch(engine, batch)
            if not handed_off:
                break
            batch = []
        for req in batch + list(carry):
            self.pipeline.finish(req, "abort")

    def _feed_loop(self, engine: vEngine) -> None:
        """Mixed steps: a prompt the decode steps prefill in place goes straight to the lane with the most
        room; the others (prefilled_in_step False) are prefilled here, one per call."""
        p = self.pipeline
        while p.live:
            req = p.next_request()
            if req is None or not self._admit_prefill(engine, req):
                continue
            if not prefilled_in_step(req):
                if not self._prefill_batch(engine, [req]):
                    p.finish(req, "abort")
                    return
                continue
            dest = max(self._slots, key=lambda s: len(s.free) - s.lane.backlog.qsize())
            if p.put(dest.lane.backlog, Arrived(req)):
                p.left_pipeline(req)
            else:
                p.finish(req, "abort")

    def _prefill_batch(self, engine: vEngine, batch: list[ActiveRequest]) -> bool:
        """Prefill one pack and hand it to the transfer thread; False when stopping (the batch is not
        handed off and the caller aborts it)."""
        p = self.pipeline
        if self.interleaved_mode:
            # one prefill per decode step keeps token latency steady
            while p.live and not self._may_prefill.wait(timeout=0.1):
                pass
            self._may_prefill.clear()
            if not p.live:
                return False
        now = time.time()
        for req in batch:
            req.metadata.prefill_started_at = now
        try:
            head = batch[0]
            if engine.needs_chunks(head.prompt_ids, head.params):
                prefix, head.prompt_logprobs = engine.prefill_chunked(
                    head.prompt_ids, head.params, sorted(head.stop_ids)
                )
            else:
                prefix = engine.prefill_many(
                    [r.prompt_ids for r in batch],
                    [r.params for r in batch],
                    [sorted(r.stop_ids) for r in batch],
                )
        except Exception as e:
            for req in batch:
                p.fail(req, f"prefill failed: {e}")
            batch.clear()  # failed, not aborted
            return True
        # stopping: the hand-off never happened
        return p.put(self._transfer_q, PrefilledPack(batch, engine, prefix))

    def _transfer_loop(self) -> None:
        while self.pipeline.live:
            try:
                pack = self._transfer_q.get(timeout=0.1)
            except queue.Empty:
                continue
            self._transfer(pack.batch, pack.engine, pack.prefix)

    def _transfer(self, batch: list[ActiveRequest], src: vEngine, prefix) -> None:
        p = self.pipeline
        dest = max(self._slots, key=lambda s: len(s.free) - s.lane.backlog.qsize())
        try:
            if dest.engine is not src:
                prefix = jax.device_put(prefix, dest.engine.get_prefix_destination_sharding())
            jax.block_until_ready(prefix.hidden)
        except Exception as e:
            for req in batch:
                p.fail(req, f"transfer failed: {e}")
            return
        now = time.time()
        firsts = self._stream_firsts(dest, batch, prefix)
        for j, req in enumerate(batch):
            req.metadata.prefill_done_at = now
            if p.put(dest.lane.backlog, Prefilled(req, prefix, j, firsts[j])):
                p.left_pipeline(req)
            else:
                p.finish(req, "abort")

    def _stream_firsts(self, dest: DenseSlots, batch: list[ActiveRequest], prefix) -> list[list | None]:
        """Sample every sample's first token of a pack now (max_concurrent_prefill per program call) and
        send each to the lane's detokenizer, ahead of its insert: the client sees it without waiting for
        the step in flight (or for a free slot). The insert then reuses these tokens, so the output is what
        sampling at insert gives. A structured request keeps sampling at insert, under its grammar's first
        mask: None for it (and for every request of the pack when sampling failed here)."""
        out: list[list | None] = [None] * len(batch)
        picks = [
            (j, i)
            for j, req in enumerate(batch)
            if getattr(req.params, "grammar", None) is None and not req.cancelled
            for i in range(req.params.n)
        ]
        if not picks:
            return out
        engine = dest.engine
        try:
            own = engine.entry_keys(prefix)
            keys = np.stack([own[j] if batch[j].keys is None else batch[j].keys[i] for j, i in picks])
            m = engine.max_concurrent_prefill
            rows = []
            for at in range(0, len(picks), m):
                part = picks[at : at + m]
                res = engine.sample_firsts(prefix, [j for j, _ in part], keys[at : at + m])
                host = [np.asarray(x) for x in res]
                rows += [SampleResult(*(x[r : r + 1] for x in host)) for r in range(len(part))]
        except Exception as e:  # the insert samples them instead, and reports a failure there
            log.warning("first tokens before insert failed, sampling at insert: %s", e)
            return out
        for (j, i), first in zip(picks, rows, strict=True):
            out[j] = out[j] or [None] * batch[j].params.n
            out[j][i] = first
        for j, req in enumerate(batch):
            if out[j] is None:
                continue
            for i, first in enumerate(out[j]):
                # sent before the request reaches the backlog, so it precedes every step holding its tokens
                if not self.pipeline.put(dest.lane.detok, FirstToken(SlotOwner(req, i, None), first)):
                    out[j] = None
                    break
        return out
