"""vDriver's prompts prefilled inside the decode steps (``max_num_batched_tokens`` set: engines/dense/mixed_step.py).

A request that arrives on the lane (`Arrived`) takes a free slot at once and becomes a `Prefilling`; each
step then writes the next chunk of the oldest prompts into their slots beside the decoding rows, within the
token budget (`plan_chunks`). The step that writes a prompt's last chunk seats it: its first token is
sampled and streamed, and the slot decodes from the next step. Requests the steps do not prefill (n > 1,
prompt logprobs, structured output) keep the prefill thread's path.
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...engines.dense.mixed_step import Chunk
from ..active_request import ActiveRequest
from ..queue_messages import Abort, FirstToken

if TYPE_CHECKING:
    from ..pipeline import StepLoop


class SlotTable(Protocol):
    """What in-place prefill needs from the slots it lives in (`DenseSlots`, which holds it): declared
    here so that this module does not import the one that imports it."""

    engine: Any  # the decode vEngine (its .mixed does the steps)
    free: list[int]  # a heap of free slots
    owners: list[Any]  # slot -> its SlotOwner or None
    left: Any  # slot -> tokens it may still produce (numpy int64)
    drafts: Any  # NgramDrafts or None

    def release(self, slot: int) -> None: ...

    def owner_of(self, req: ActiveRequest, index: int, slot: int) -> Any: ...


def prefilled_in_step(req: ActiveRequest) -> bool:
    """True when the decode steps can prefill this request in place: one sample, no prompt logprobs, no
    grammar (those need a prefix of their own, the prefill thread's)."""
    p = req.params
    return p.n == 1 and p.prompt_logprobs is None and getattr(p, "grammar", None) is None


@dataclass(eq=False)
class Prefilling:
    """A prompt being written into its slot, chunk by chunk."""

    req: ActiveRequest
    slot: int
    sampling: Any  # its one-row SlotSampling (vEngine.make_sampling_row)
    done: int = 0  # prompt tokens written so far

    @property
    def left(self) -> int:
        return len(self.req.prompt_ids) - self.done


class InPlacePrefill:
    """The prompts one decode lane prefills in its steps (`DenseSlots` holds one when the engine mixes)."""

    def __init__(self, slots: SlotTable):
        self.slots = slots
        self.engine = slots.engine
        self.mixed = slots.engine.mixed
        self.arrived: collections.deque[ActiveRequest] = collections.deque()
        self.prefilling: list[Prefilling] = []

    def __bool__(self) -> bool:
        return bool(self.prefilling)

    def admit(self, loop: StepLoop) -> None:
        """Give each arrived request a free slot, oldest first, while one is free."""
        s = self.slots
        while self.arrived and s.free:
            req = self.arrived.popleft()
            if req.cancelled:
                loop.send(Abort(req))
                continue
            slot = heapq.heappop(s.free)
            req.metadata.prefill_started_at = time.time()
            # the row carries the request's LoRA bank slot: the slot's decode steps read it once seated
            row = self.engine.make_sampling_row(req.params, sorted(req.stop_ids), req.adapter_slot)
            self.prefilling.append(Prefilling(req, slot, row))

    def drop_cancelled(self, loop: StepLoop) -> None:
        """End the cancelled requests, waiting for a slot or being written (their slots come back)."""
        for req in [r for r in self.arrived if r.cancelled]:
            self.arrived.remove(req)
            loop.send(Abort(req))
        keep = []
        for p in self.prefilling:
            if p.req.cancelled:
                self.slots.release(p.slot)
                loop.send(Abort(p.req))
            else:
                keep.append(p)
        self.prefilling = keep

    def step(self, state: Any) -> tuple[Any, Any, tuple[Any, list[tuple[int, Prefilling]]]]:
        """Dispatch one mixed step: the live rows decode, the oldest prompts get their next chunks.
        Returns (state, the decode SampleResult, what `seat` takes once the step's rows are accounted)."""
        shape, takes = self.mixed.step_plan([p.left for p in self.prefilling])
        chunks = [
            Chunk(
                p.slot,
                p.done,
                np.asarray(p.req.prompt_ids[p.done : p.done + n], np.int32),
                p.req.adapter_slot,
            )
            for p, n in zip(self.prefilling, takes, strict=False)
        ]
        state, out, hidden = self.mixed.step(state, chunks, shape)
        done = []
        for i, (p, n) in enumerate(zip(self.prefilling, takes, strict=False)):
            p.done += n
            if not p.left:
                done.append((i, p))
        self.prefilling = [p for p in self.prefilling if p.left]
        return state, out, (hidden, done)

    def seat(self, state: Any, loop: StepLoop, hidden: Any, done: list[tuple[int, Prefilling]]) -> Any:
        """The prompts whose last chunk the step wrote start decoding: first token sampled and streamed."""
        s = self.slots
        max_length = self.engine.max_length
        for i, p in done:
            req = p.req
            key = p.sampling.key[0] if req.keys is None else req.keys[0]
            n = len(req.prompt_ids)
            state, first = self.mixed.seat(state, hidden, i, p.slot, n, p.sampling, key)
            req.metadata.prefill_done_at = time.time()
            owner = s.owner_of(req, 0, p.slot)
            s.owners[p.slot] = owner
            budget = req.budget(max_length).tokens
            s.left[p.slot] = budget - 1  # the first token is out
            req.samples[0].slot = p.slot
            if s.drafts is not None:
                first_token = int(np.asarray(first.tokens)[0])
                s.drafts.start(p.slot, req.prompt_ids, first_token, req.params, req.budget(max_length))
            loop.send(FirstToken(owner, first))
            if budget <= 1:
                s.release(p.slot)
        return state

    def end(self, finish) -> None:
        """The lane stops or lost its state: ``finish(req)`` each request here, and free the slots."""
        for req in self.arrived:
            finish(req)
        self.arrived.clear()
        for p in self.prefilling:
            finish(p.req)
            self.slots.release(p.slot)
        self.prefilling = []
