"""The pipeline both drivers share: threads joined by bounded queues, and the life of a request in them.

    submit -> [prefill queue] -> feeder thread(s) -> [lane backlog] -> step thread -> [detokenize queue]
           -> detokenize thread -> each request's ReturnChannel
                                      |
                 step thread <- [release]: samples the detokenizer saw finish give back their slot/pages

The pipeline owns every queue and thread: start, a graceful stop that aborts whatever is left, the end of
a request (finished once, failed alone without taking the driver down), the detokenize thread, and the
skeleton of the step thread — plan, dispatch step n+1, then hand step n to the detokenizer, so the device
never waits for Python. The queues are bounded: the prefill queue by ``max_queue_size`` (submit fails
fast when full), the detokenize queue by ``detokenizing_blocks`` (decode may run only that far ahead of
detokenization).

A driver supplies what differs: its feeder threads (vDriver: prefill and transfer threads over dense
prefixes; oDriver: a thread preparing paged sequences) and a ``Stepper`` per lane, which plans each step
and holds the KV (vDriver: dense slots; oDriver: pages through a PageScheduler). Work units travel as
*owners*: anything with ``req``, ``index`` (the sample) and ``cached_tokens``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

from ..contracts.request import QueueFullError
from .active_request import ActiveRequest
from .metrics import MetricsRecorder
from .queue_messages import STOP, Abort, FirstToken, Preempt, Step, requests_of
from .step_timing import StepClock

log = logging.getLogger(__name__)


class Owner(Protocol):
    """One sample of one request on a lane (vDriver: a slot; oDriver: a paged Seq)."""

    req: ActiveRequest
    index: int

    @property
    def cached_tokens(self) -> int: ...


# The prefill queue's order: arrival time plus this many seconds per prompt token (at most
# PREFILL_MAX_DEFER_SECONDS), so shorter prompts go first among those that arrived about together, and a
# longer one is overtaken only by prompts that arrived less than that after it: never starved. Measured
# under mixed-32 through HTTP (every bf16 knob + ngram): FIFO TTFT p50 2.00 s; 0.002 s/token 1.82 s;
# 0.01 s/token 1.55 s, TTFT p99 7.7 -> 8.0 s, throughput unchanged.
PREFILL_SECONDS_PER_TOKEN = 0.01
PREFILL_MAX_DEFER_SECONDS = 4.0


class PrefillQueue(queue.Queue):
    """A bounded queue of requests, taken shortest-prompt-first with ageing (PREFILL_SECONDS_PER_TOKEN,
    PREFILL_MAX_DEFER_SECONDS)."""

    def _init(self, maxsize: int) -> None:
        self.queue: list = []  # type: ignore[assignment]  # a heap of (key, arrival order, request)
        self._order = itertools.count()

    def _qsize(self) -> int:
        return len(self.queue)

    def _put(self, req: Any) -> None:
        defer = min(PREFILL_SECONDS_PER_TOKEN * len(req.prompt_ids), PREFILL_MAX_DEFER_SECONDS)
        key = time.monotonic() + defer
        heapq.heappush(self.queue, (key, next(self._order), req))

    def _get(self) -> Any:
        return heapq.heappop(self.queue)[2]


class DetokenizeQueue(queue.Queue):
    """The detokenizer's queue. Its bound limits how far the step thread runs ahead of detokenization; a
    first token the transfer thread streams is already on the host and costs the detokenizer no wait, so
    it goes in past the bound (`put_past_bound`). Bounded like the steps, 64 first tokens of a burst queued
    one by one behind decode blocks: on the 8B shape the burst's inserts came in four waves 0.8 s apart
    (timeline of the chip's fixed run), and the fixed batch decoded at 0.65 of the raw walk."""

    def put_past_bound(self, item: Any) -> None:
        with self.mutex:
            self._put(item)
            self.unfinished_tasks += 1
            self.not_empty.notify()


class Lane:
    """The queues around one step thread: its backlog, its detokenizer's queue and the release queue."""

    def __init__(self, backlog_size: int, detokenizing_blocks: int):
        self.backlog: queue.Queue = queue.Queue(backlog_size)
        self.detok = DetokenizeQueue(max(1, detokenizing_blocks))
        self.release: queue.SimpleQueue = queue.SimpleQueue()  # owners whose sample finished


class StepLoop:
    """The step thread's hand-off to its detokenizer: the step in flight is sent once the next is out."""

    def __init__(self, pipeline: Pipeline, lane: Lane):
        self.pipeline, self.lane = pipeline, lane
        self.pending: Step | None = None

    def send(self, item: Any) -> None:
        self.pipeline.put(self.lane.detok, item)

    def flush(self) -> None:
        """Send the step in flight now (before a message that must follow its tokens, or when idle)."""
        if self.pending is not None:
            self.send(self.pending)
            self.pending = None


class Stepper(Protocol):
    """What a driver supplies for one lane's step thread: how a step is planned and how KV is held."""

    def init_state(self) -> Any:
        """A fresh device state (the KV cache and the per-slot sampler state)."""

    def plan(self, state: Any, loop: StepLoop) -> tuple[Any, bool]:
        """Free what ended, admit what arrived, prefill what the plan allows; True when a decode step is due.

        May wait briefly for work when there is none; sends its own messages (FirstToken, Abort, Preempt)
        through ``loop``, flushing the step in flight first where order matters."""

    def step(self, state: Any) -> tuple[Any, Any, list[Any]]:
        """Dispatch one decode step: (state, device SampleResult, the owner of each row or None)."""

    def stepped(self) -> None:
        """Bookkeeping once a step is dispatched."""

    def lose_state(self, reason: str) -> Any:
        """A step failed on the device: fail what was running and return a fresh state."""

    def stopped(self) -> None:
        """The step thread is ending: abort what the stepper still holds."""


class Pipeline:
    """Queues, threads and request lifecycle shared by vDriver and oDriver (see the module docstring)."""

    def __init__(self, max_queue_size: int, detokenizing_blocks: int):
        self.prefill_q: queue.Queue = PrefillQueue(max_queue_size)
        self.detokenizing_blocks = detokenizing_blocks
        self.metrics = MetricsRecorder()
        self.clock = StepClock()  # device and host seconds per step (step_timing.py)
        # called once per request when it ends, however it ends (a LoRA adapter's pin is released there)
        self.end_hooks: list[Callable[[ActiveRequest], None]] = []
        self.live = False
        self._threads: list[threading.Thread] = []
        self._in_pipeline = 0  # requests submitted and not yet on a lane's backlog (nor ended)
        self._lock = threading.Lock()

    def new_lane(self, backlog_size: int, steps_per_item: int = 1) -> Lane:
        """A lane whose step thread may run ``detokenizing_blocks`` decode steps ahead of its detokenizer,
        counted in steps: a lane sending blocks of ``steps_per_item`` steps queues that many times fewer
        items. Counted in blocks, a TPU engine of 4-step blocks ran 32 steps ahead, which on the 8B shape
        is half a second of queued device work that every prefill and first token waited behind."""
        return Lane(backlog_size, -(-self.detokenizing_blocks // max(1, steps_per_item)))

    @property
    def in_pipeline(self) -> int:
        return self._in_pipeline

    # ------------------------------------------------------------------ lifecycle
    def start(self, threads: Iterable[tuple[Callable[..., None], tuple, str]]) -> None:
        self.live = True
        for fn, args, name in threads:
            t = threading.Thread(target=fn, args=args, name=f"vsurge-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, lanes: Iterable[Lane]) -> None:
        """Join every thread, then abort whatever is left in a queue (it was never started)."""
        self.live = False
        for t in self._threads:
            t.join(timeout=30)
        self._threads.clear()
        queues: list[Any] = [self.prefill_q]
        for lane in lanes:
            queues += [lane.backlog, lane.detok]
            drain(lane.release)  # releases still queued were for the step thread
        for q in queues:
            for item in drain(q):
                for req in requests_of(item):
                    self.finish(req, "abort")

    # ------------------------------------------------------------------ requests
    def submit(self, request: ActiveRequest, max_n: int) -> None:
        if not isinstance(request, ActiveRequest):
            raise TypeError(f"submit_request takes an ActiveRequest, got {type(request).__name__}")
        if not self.live:
            raise RuntimeError("driver is not running; call start() first")
        if request.params.n > max_n:
            raise ValueError(f"n={request.params.n} exceeds max_concurrent_decodes")
        with self._lock:
            request.in_pipeline = True
            self._in_pipeline += 1
        try:
            self.prefill_q.put_nowait(request)
        except queue.Full:
            self.left_pipeline(request)
            raise QueueFullError(
                f"prefill queue is full ({self.prefill_q.maxsize} requests waiting)"
            ) from None
        self.metrics.request_started(request)

    def next_request(self, timeout: float = 0.1) -> ActiveRequest | None:
        """The next request of the prefill queue, or None after ``timeout`` seconds without one (a feeder
        thread's loop checks ``live`` in between)."""
        try:
            return self.prefill_q.get(timeout=timeout)
        except queue.Empty:
            return None

    def left_pipeline(self, req: ActiveRequest) -> None:
        """The request reached a lane or ended: it no longer counts as on its way (once per request)."""
        with self._lock:
            if req.in_pipeline:
                req.in_pipeline = False
                self._in_pipeline -= 1

    def _finalize(self, req: ActiveRequest) -> bool:
        """True exactly once per request: its end is counted and its channel closed once."""
        with req._lock:
            if req.finalized:
                return False
            req.finalized = True
        for hook in self.end_hooks:
            try:
                hook(req)
            except Exception:  # a hook's bug must not keep the request from ending
                log.exception("end hook failed for request %s", req.id)
        return True

    def finish(self, req: ActiveRequest, reason: str) -> None:
        """End a request that did not finish on its own (e.g. 'abort'); idempotent."""
        self.left_pipeline(req)
        if not self._finalize(req):
            return
        req.finish_all(reason)
        deltas = req.take_deltas()
        if deltas:
            req.channel.put(deltas)
        self.metrics.request_finished(req, time.time())  # before close: a consumer sees final figures
        req.channel.close()

    def fail(self, req: ActiveRequest, reason: str) -> None:
        """End one request with an error; the driver and the other requests go on."""
        self.left_pipeline(req)
        log.warning("request %s failed: %s", req.id, reason)
        if not self._finalize(req):
            return
        self.metrics.request_finished(req, time.time())
        req.fail(reason)

    def put(self, q: queue.Queue, item: Any) -> bool:
        """Put into a bounded queue, waiting while it is full; False when the pipeline stops first."""
        while self.live:
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    # ------------------------------------------------------------------ step thread
    def step_loop(self, lane: Lane, stepper: Stepper) -> None:
        """The step thread: plan, dispatch step n+1, hand step n to the detokenizer."""
        loop = StepLoop(self, lane)
        state = stepper.init_state()
        while self.live:
            started = time.perf_counter()
            state, due = stepper.plan(state, loop)
            if not due:
                continue
            try:
                state, out, owners = stepper.step(state)
            except Exception as e:  # a device failure takes every running request with it, not the driver
                log.exception("decode step failed")
                loop.pending = None
                state = stepper.lose_state(f"decode failed: {e}")
                continue
            for leaf in out:
                leaf.copy_to_host_async()
            kind, engine = getattr(stepper, "step_kind", "decode"), getattr(stepper, "engine", stepper)
            timing = self.clock.dispatched(kind, engine, time.perf_counter() - started)
            loop.flush()
            loop.pending = Step(out, owners, timing)
            stepper.stepped()
        loop.flush()
        lane.detok.put(STOP)  # unbounded wait: the detokenizer is draining this queue
        stepper.stopped()

    # ------------------------------------------------------------------ detokenize thread
    def detokenize_loop(
        self, lane: Lane, max_length: int, on_preempt: Callable[[Any], None] | None = None
    ) -> None:
        """Account each step's tokens to their samples and flush deltas to the consumers."""
        while True:
            item = lane.detok.get()
            if item is STOP:
                return
            if isinstance(item, Abort):
                self.finish(item.req, "abort")
            elif isinstance(item, Preempt):
                if on_preempt is not None:
                    on_preempt(item.seq)
            elif isinstance(item, FirstToken):
                owner = item.owner
                if owner.index == 0 and not owner.req.samples[0].prompt_info_sent:
                    owner.req.num_cached_tokens = owner.cached_tokens  # usage.prompt_tokens_details
                tokens, logprob, top_ids, top_lps = (np.asarray(x) for x in item.result)
                self.clock.ready(item.timing)
                self._take(lane, owner, int(tokens[0]), logprob[0], top_ids[0], top_lps[0], max_length)
                self._flush([owner.req])
            else:
                self._flush(self._take_step(lane, item, max_length))

    def _take_step(self, lane: Lane, item: Step, max_length: int) -> Iterable[ActiveRequest]:
        """Account a decode step (one token per row) or a verify step (1..K+1 tokens per row: the
        accepted draft and one more); returns the requests that got tokens."""
        host = [np.asarray(x) for x in item.result]
        self.clock.ready(item.timing)
        tokens, logprob, top_ids, top_lps = host[:4]
        multi = tokens.ndim == 2  # a VerifyStep: its fifth leaf is the accepted count per row
        per_token_top = top_ids.ndim == 3  # a decode block: top logprobs for each of a row's tokens
        touched: dict[int, ActiveRequest] = {}
        for row, owner in enumerate(item.owners[: len(tokens)]):
            if owner is None:
                continue
            for t in range(int(host[4][row]) + 1 if multi else 1):
                tok, lp = (
                    (int(tokens[row, t]), logprob[row, t]) if multi else (int(tokens[row]), logprob[row])
                )
                tid, tlp = (
                    (top_ids[row, t], top_lps[row, t]) if per_token_top else (top_ids[row], top_lps[row])
                )
                if not self._take(lane, owner, tok, lp, tid, tlp, max_length):
                    break
                touched[id(owner.req)] = owner.req
                if owner.req.samples[owner.index].done:
                    break  # finished (EOS, stop string, max_tokens) inside the draft: the rest is dropped
        return touched.values()

    def _take(
        self,
        lane: Lane,
        owner: Any,
        token: int,
        logprob: float,
        top_ids: np.ndarray,
        top_lps: np.ndarray,
        max_length: int,
    ) -> bool:
        """Add one token to the owner's sample; True when it was taken."""
        req = owner.req
        if req.cancelled:
            # a sample the step thread released on its own (max_tokens reached) may never be seen there
            # again: end the request here (idempotent), or nobody would
            self.finish(req, "abort")
            return False
        if req.samples[owner.index].done or req.error is not None:
            return False
        try:
            finish = req.add_token(owner.index, token, logprob, top_ids, top_lps, max_length)
        except Exception as e:
            self.fail(req, f"detokenization failed: {e}")
            req.cancel()  # the step thread frees its slots or pages
            return False
        self.metrics.tokens(1)
        if finish is not None:
            lane.release.put(owner)
        return True

    def _flush(self, reqs: Iterable[ActiveRequest]) -> None:
        for req in reqs:
            if req.error is not None:
                continue
            deltas = req.take_deltas()
            if deltas:
                req.channel.put(deltas)
            if req.done and self._finalize(req):
                req.metadata.finished_at = time.time()
                self.metrics.request_finished(req, req.metadata.finished_at)
                req.channel.close()


def drain(q: Any, limit: int | None = None) -> list[Any]:
    """Everything in a queue now (at most ``limit`` items), without waiting."""
    items = []
    while limit is None or len(items) < limit:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            break
    return items
