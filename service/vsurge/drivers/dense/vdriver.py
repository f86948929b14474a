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
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ...contracts.engine_config import EngineConfig
from ...engines.dense.prefill_rows import first_fit
from ...engines.dense.vengine import DenseEngine
from ..active_request import ActiveRequest
from ..lora_adapters import adapters_for, left, lora_figures, pin_request, submit_request
from ..metrics import DriverMetrics
from ..pipeline import Pipeline, drain
from ..queue_messages import Arrived, PrefilledPack
from .inplace_prefill import prefilled_in_step
from .slot_scheduler import DenseSlots
from .transfer import transfer_group

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


class vDriver:  # noqa: N801 - the seed's name
    supports_structured_output = True  # token masks in DenseSlots (structured/slots.py)

    def __init__(
        self,
        prefill_engines: list[DenseEngine] | DenseEngine | None = None,
        decode_engines: list[DenseEngine] | DenseEngine | None = None,
        interleaved_mode: bool = _DEFAULTS.interleaved_mode,
        detokenizing_blocks: int = _DEFAULTS.detokenizing_blocks,
        max_queue_size: int = _DEFAULTS.max_queue_size,
    ):
        self._prefill_engines = _as_list(prefill_engines)
        self._decode_engines = _as_list(decode_engines) or list(self._prefill_engines)
        if not self._prefill_engines:
            self._prefill_engines = list(self._decode_engines)
        if not self._decode_engines:
            raise ValueError("vDriver needs at least one engine")
        self.interleaved_mode = interleaved_mode
        self.detokenizing_blocks = detokenizing_blocks
        self.pipeline = Pipeline(max_queue_size, detokenizing_blocks)
        self._transfer_q: queue.Queue = queue.Queue(max(4, 2 * len(self._decode_engines)))
        self._may_prefill = threading.Event()  # interleaved mode: set by the step thread once per step
        self._slots = [
            DenseSlots(
                self.pipeline,
                e,
                self.pipeline.new_lane(2 * e.max_concurrent_decodes, e.decode_steps),
                self._may_prefill,
            )
            for e in self._decode_engines
        ]
        self._speculative = any(e.speculator is not None for e in self._decode_engines)
        # max_num_batched_tokens set: the decode steps prefill prompts in place (inplace_prefill.py)
        self._mixed = all(e.mixed is not None for e in self._decode_engines)
        # LoRA adapters (drivers/lora_adapters.py): None unless the engines carry an adapter bank
        self.lora = adapters_for(self.engines)
        self.pipeline.end_hooks.append(left(self.lora))

    # ------------------------------------------------------------------ seed API
    @property
    def driver_name(self) -> str:
        return f"vdriver-{self._decode_engines[0].model_name}"

    @property
    def processor(self) -> Any:
        return self._decode_engines[0].processor

    @property
    def engines(self) -> list[DenseEngine]:
        return list(dict.fromkeys(self._prefill_engines + self._decode_engines))

    @property
    def live(self) -> bool:
        return self.pipeline.live

    def compile(self, progress: Callable[[str], None] | None = None) -> float:
        seconds = sum(e.compile(progress) for e in self.engines)
        if self.lora is not None:
            self.lora.bank.warm()  # the bank's update programs: loading an adapter compiles nothing
        return seconds

    @property
    def num_used_slots(self) -> int:
        return sum(s.used for s in self._slots)

    def get_total_concurrent_requests(self) -> int:
        return sum(e.max_concurrent_decodes for e in self._decode_engines)

    def add_observer(self, fn) -> None:
        self.pipeline.metrics.observers.append(fn)

    def submit_request(self, request: Any) -> None:
        n = self._decode_engines[0].max_concurrent_decodes
        submit_request(self.lora, request, lambda: self.pipeline.submit(request, n))

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
            **lora_figures(self.lora),
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
    def _admit_prefill(self, engine: DenseEngine, req: ActiveRequest) -> bool:
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

    def _take_batch(
        self, engine: DenseEngine, carry: collections.deque[ActiveRequest]
    ) -> list[ActiveRequest]:
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
            if not pin_request(self.lora, req, False, lambda: self.pipeline.live):
                # every bank slot is pinned by other adapters' requests: prefill what is taken, or, with
                # nothing taken, try again shortly (pins are released as requests end)
                if req.finalized:
                    continue
                if batch:
                    carry.appendleft(req)
                else:
                    carry.append(req)
                    time.sleep(0.02)
                break
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

    def _prefill_loop(self, engine: DenseEngine) -> None:
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

    def _feed_loop(self, engine: DenseEngine) -> None:
        """Mixed steps: a prompt the decode steps prefill in place goes straight to the lane with the most
        room; the others (prefilled_in_step False) are prefilled here, one per call."""
        p = self.pipeline
        while p.live:
            req = p.next_request()
            if req is None or not self._admit_prefill(engine, req):
                continue
            # its adapter's bank slot before either path prefills it; waiting here is safe, as on oDriver:
            # the slots are pinned by requests already handed on, which end without this thread
            if not pin_request(self.lora, req, True, lambda: p.live):
                if not req.finalized:
                    p.finish(req, "abort")  # stopping
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

    def _prefill_batch(self, engine: DenseEngine, batch: list[ActiveRequest]) -> bool:
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
        now, started, waited = time.time(), time.perf_counter(), engine.prefill_waited
        for req in batch:
            req.metadata.prefill_started_at = now
        try:
            head = batch[0]
            if engine.needs_chunks(head.prompt_ids, head.params):
                prefix, head.prompt_logprobs = engine.prefill_chunked(
                    head.prompt_ids, head.params, sorted(head.stop_ids), head.adapter_slot
                )
            else:
                prefix = engine.prefill_many(
                    [r.prompt_ids for r in batch],
                    [r.params for r in batch],
                    [sorted(r.stop_ids) for r in batch],
                    [r.adapter_slot for r in batch],
                )
        except Exception as e:
            for req in batch:
                p.fail(req, f"prefill failed: {e}")
            batch.clear()  # failed, not aborted
            return True
        # host time: the call less its waits for the device (XLA:CPU's dispatch window)
        host = time.perf_counter() - started - (engine.prefill_waited - waited)
        timing = p.clock.dispatched("prefill", engine, host)
        # stopping: the hand-off never happened
        return p.put(self._transfer_q, PrefilledPack(batch, engine, prefix, timing))

    def _transfer_loop(self) -> None:
        while self.pipeline.live:
            try:
                packs = [self._transfer_q.get(timeout=0.1)]
            except queue.Empty:
                continue
            transfer_group(self, packs + drain(self._transfer_q))
