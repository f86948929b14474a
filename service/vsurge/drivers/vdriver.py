"""vDriver: continuous batching over vEngines with threads joined by bounded queues.

    submit -> [prefill queue] -> prefill thread(s) -> [transfer queue] -> transfer thread
           -> [backlog per decode engine] -> generate thread -> [detokenize queue] -> detokenize thread
           -> each request's ReturnChannel

A prefill thread packs the prompts waiting in the queue (up to the engine's max_concurrent_prefill, within
its prefill_pack_tokens) into one prefill call: under load the prompt work is batched, while a lone
prompt goes at once.

The generate thread owns the decode state and the slots (plain integers). It dispatches decode step n+1
before it reads the tokens of step n, so the device never waits for Python. Finished samples are handed
back by the detokenize thread through a release queue; cancelled requests are noticed on the next step.
"""

from __future__ import annotations

import collections
import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..engine_config import EngineConfig
from ..engines.vengine import vEngine
from ..request import QueueFullError
from .active_request import ActiveRequest
from .lanes import STOP, Abort, FirstToken, Prefilled, PrefilledPack, Step
from .metrics import DriverMetrics, MetricsRecorder

log = logging.getLogger(__name__)
_DEFAULTS = EngineConfig()  # the driver knobs' defaults live in EngineConfig


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


class _DecodeLane:
    """One decode engine with its slots, backlog and the queues of its generate/detokenize threads."""

    def __init__(self, engine: vEngine, backlog_size: int):
        self.engine = engine
        self.backlog: queue.Queue = queue.Queue(backlog_size)
        self.detok: queue.Queue = queue.Queue(8)  # bounds how far decode may run ahead of detokenization
        self.release: queue.SimpleQueue = queue.SimpleQueue()
        self.owners: list[tuple[ActiveRequest, int] | None] = [None] * engine.max_concurrent_decodes
        # a heap: the lowest free slot goes first, so live slots stay packed and decode covers few rows
        self.free = list(range(engine.max_concurrent_decodes))
        self.waiting: collections.deque = collections.deque()

    @property
    def used(self) -> int:
        return self.engine.max_concurrent_decodes - len(self.free)


class vDriver:  # noqa: N801 - the seed's name
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
        self._prefill_q: queue.Queue = queue.Queue(max_queue_size)
        self._transfer_q: queue.Queue = queue.Queue(max(4, 2 * len(self._decode_engines)))
        self._lanes = [
            _DecodeLane(e, backlog_size=2 * e.max_concurrent_decodes) for e in self._decode_engines
        ]
        self._metrics = MetricsRecorder()
        self._threads: list[threading.Thread] = []
        self._live = False
        self._may_prefill = threading.Event()  # interleaved mode: set by the generate thread once per step
        # Prompts first: while prompts are being prefilled for free slots, decode waits up to this long
        # (seconds) between steps. Prefill and decode share the device, so running them side by side only
        # slows both; letting the prompts in first means the batch decodes together, full. 0 disables.
        self.max_decode_stall = max_decode_stall
        self._in_pipeline = 0  # requests submitted and not yet on a lane's backlog (nor ended)
        self._pipeline_lock = threading.Lock()
        self._rr = 0

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
        return self._live

    def compile(self, progress: Callable[[str], None] | None = None) -> float:
        return sum(e.compile(progress) for e in self.engines)

    @property
    def num_used_slots(self) -> int:
        return sum(lane.used for lane in self._lanes)

    def get_total_concurrent_requests(self) -> int:
        return sum(e.max_concurrent_decodes for e in self._decode_engines)

    def add_observer(self, fn) -> None:
        self._metrics.observers.append(fn)

    def submit_request(self, request: Any) -> None:
        if not isinstance(request, ActiveRequest):
            raise TypeError(f"submit_request takes an ActiveRequest, got {type(request).__name__}")
        self.place_request_on_prefill_queue(request)

    def place_request_on_prefill_queue(self, request: ActiveRequest) -> None:
        if not self._live:
            raise RuntimeError("driver is not running; call start() first")
        if request.params.n > self._lanes[0].engine.max_concurrent_decodes:
            raise ValueError(f"n={request.params.n} exceeds max_concurrent_decodes")
        with self._pipeline_lock:
            request.in_pipeline = True
            self._in_pipeline += 1
        try:
            self._prefill_q.put_nowait(request)
        except queue.Full:
            self._left_pipeline(request)
            raise QueueFullError(
                f"prefill queue is full ({self._prefill_q.maxsize} requests waiting)"
            ) from None
        self._metrics.request_started(request)

    def metrics(self) -> DriverMetrics:
        used = self.num_used_slots
        total = self.get_total_concurrent_requests()
        m = self._metrics
        # the transfer queue holds packs, not requests, and a prefill thread holds some in its hands: the
        # pipeline count is exact for everything before the lanes
        waiting = self._in_pipeline
        waiting += sum(lane.backlog.qsize() + len(lane.waiting) for lane in self._lanes)
        return DriverMetrics(
            slots_used=used,
            slots_total=total,
            slot_occupancy=used / total if total else 0.0,
            prefill_queue_size=self._prefill_q.qsize(),
            transfer_queue_size=self._transfer_q.qsize(),
            generate_backlog_size=sum(lane.backlog.qsize() + len(lane.waiting) for lane in self._lanes),
            requests_running=max(0, m.running - waiting),
            requests_waiting=waiting,
            prompt_tokens_total=m.prompt_tokens,
            generation_tokens_total=m.generated_tokens,
            finished_total=dict(m.finished),
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._live:
            return
        self._live = True
        spawn = [(self._prefill_loop, (e,), f"prefill-{i}") for i, e in enumerate(self._prefill_engines)]
        spawn.append((self._transfer_loop, (), "transfer"))
        for i, lane in enumerate(self._lanes):
            spawn.append((self._generate_loop, (lane,), f"generate-{i}"))
            spawn.append((self._detokenize_loop, (lane,), f"detokenize-{i}"))
        for fn, args, name in spawn:
            t = threading.Thread(target=fn, args=args, name=f"vsurge-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop every thread; requests still queued or running end with finish_reason 'abort'."""
        if not self._live:
            return
        self._live = False
        for t in self._threads:
            t.join(timeout=30)
        self._threads.clear()
        # whatever is left in a queue or waiting for a slot was never started: abort it
        for lane in self._lanes:
            while lane.waiting:
                self._finish(lane.waiting.popleft().req, "abort")
            # a stopped driver holds no slot (releases still queued were for the generate thread)
            for slot, owner in enumerate(lane.owners):
                if owner is not None:
                    self._release(lane, slot)
            while True:
                try:
                    lane.release.get_nowait()
                except queue.Empty:
                    break
        for q in [self._prefill_q, self._transfer_q] + [lane.backlog for lane in self._lanes]:
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                reqs = item.batch if isinstance(item, PrefilledPack) else [getattr(item, "req", item)]
                for req in reqs:
                    if isinstance(req, ActiveRequest):
                        self._finish(req, "abort")

    # ------------------------------------------------------------------ threads
    def _finalize(self, req: ActiveRequest) -> bool:
        """True exactly once per request: its end is counted and its channel closed once."""
        with req._lock:
            if req.finalized:
                return False
            req.finalized = True
            return True

    def _finish(self, req: ActiveRequest, reason: str) -> None:
        self._left_pipeline(req)
        if not self._finalize(req):
            return
        req.finish_all(reason)
        deltas = req.take_deltas()
        if deltas:
            req.channel.put(deltas)
        self._metrics.request_finished(req, time.time())  # before close: a consumer sees final figures
        req.channel.close()

    def _fail(self, req: ActiveRequest, reason: str) -> None:
        self._left_pipeline(req)
        log.warning("request %s failed: %s", req.id, reason)
        if not self._finalize(req):
            return
        self._metrics.request_finished(req, time.time())
        req.fail(reason)

    def _admit_prefill(self, engine: vEngine, req: ActiveRequest) -> bool:
        """False when the request ends here (cancelled, or a prompt this engine cannot prefill)."""
        if req.cancelled:
            self._finish(req, "abort")
            return False
        try:
            engine.check_prompt(req.prompt_ids)
        except Exception as e:  # one bad request must not take the driver down
            self._fail(req, f"prefill failed: {e}")
            return False
        return True

    def _take_batch(self, engine: vEngine, carry: ActiveRequest | None):
        """The requests of the next prefill call: what is waiting, up to max_concurrent_prefill prompts
        within prefill_pack_tokens (a longer prompt goes alone). Returns (batch, the request that did not fit, for the next call)."""
        batch: list[ActiveRequest] = []
        tokens = 0
        while len(batch) < engine.max_concurrent_prefill:
            if carry is not None:
                req, carry = carry, None
            else:
                try:
                    req = self._prefill_q.get(timeout=0.1) if not batch else self._prefill_q.get_nowait()
                except queue.Empty:
                    break
            if not self._admit_prefill(engine, req):
                continue
            alone = engine.needs_chunks(req.prompt_ids, req.params)  # chunk by chunk, in its own call
            if batch and (alone or tokens + len(req.prompt_ids) > engine.prefill_pack_tokens):
                return batch, req
            batch.append(req)
            tokens += len(req.prompt_ids)
            if alone:
                break
        return batch, carry

    def _prefill_loop(self, engine: vEngine) -> None:
        carry, batch = None, []
        while self._live:
            batch, carry = self._take_batch(engine, carry)
            if not batch:
                continue
            handed_off = self._prefill_batch(engine, batch)
            if not handed_off:
                break
            batch = []
        for req in batch + ([carry] if carry is not None else []):
            self._finish(req, "abort")

    def _prefill_batch(self, engine: vEngine, batch: list[ActiveRequest]) -> bool:
        """Prefill one pack and hand it to the transfer thread; False when stopping (the batch is not
        handed off and the caller aborts it)."""
        if self.interleaved_mode:
            # one prefill per decode step keeps token latency steady
            while self._live and not self._may_prefill.wait(timeout=0.1):
                pass
            self._may_prefill.clear()
            if not self._live:
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
                self._fail(req, f"prefill failed: {e}")
            batch.clear()  # failed, not aborted
            return True
        # stopping: the hand-off never happened
        return self._put_blocking(self._transfer_q, PrefilledPack(batch, engine, prefix))

    def _put_blocking(self, q: queue.Queue, item) -> bool:
        while self._live:
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _transfer_loop(self) -> None:
        while self._live:
            try:
                pack = self._transfer_q.get(timeout=0.1)
            except queue.Empty:
                continue
            self._transfer(pack.batch, pack.engine, pack.prefix)

    def _transfer(self, batch: list[ActiveRequest], src: vEngine, prefix) -> None:
        lane = max(self._lanes, key=lambda ln: len(ln.free) - ln.backlog.qsize())
        try:
            if lane.engine is not src:
                prefix = jax.device_put(prefix, lane.engine.get_prefix_destination_sharding())
            jax.block_until_ready(prefix.hidden)
        except Exception as e:
            for req in batch:
                self._fail(req, f"transfer failed: {e}")
            return
        now = time.time()
        for j, req in enumerate(batch):
            req.metadata.prefill_done_at = now
            if self._put_blocking(lane.backlog, Prefilled(req, prefix, j)):
                self._left_pipeline(req)
            else:
                self._finish(req, "abort")

    def _left_pipeline(self, req: ActiveRequest) -> None:
        """The request reached a lane or ended: decode no longer waits for it (once per request)."""
        with self._pipeline_lock:
            if req.in_pipeline:
                req.in_pipeline = False
                self._in_pipeline -= 1

    def _release(self, lane: _DecodeLane, slot: int) -> None:
        lane.owners[slot] = None
        lane.engine.free_resource(slot)
        heapq.heappush(lane.free, slot)

    def _generate_loop(self, lane: _DecodeLane) -> None:
        engine = lane.engine
        state = engine.init_decode_state()
        pending = None  # (device SampleResult, owners snapshot) of the step in flight
        last_step = time.monotonic()
        while self._live:
            # slots handed back by the detokenizer, and slots of cancelled requests
            while True:
                try:
                    slot, req = lane.release.get_nowait()
                except queue.Empty:
                    break
                if lane.owners[slot] is not None and lane.owners[slot][0] is req:
                    self._release(lane, slot)
            cancelled = {}
            for slot, owner in enumerate(lane.owners):
                if owner is not None and owner[0].cancelled:
                    self._release(lane, slot)
                    cancelled[id(owner[0])] = owner[0]
            for req in cancelled.values():
                self._lane_put(lane, Abort(req))
            # admit prefilled requests while their n samples fit
            while True:
                try:
                    lane.waiting.append(lane.backlog.get_nowait())
                except queue.Empty:
                    break
            while lane.waiting and len(lane.free) >= lane.waiting[0].req.params.n:
                ready = lane.waiting.popleft()
                req, prefix, j = ready.req, ready.prefix, ready.index
                if req.cancelled:
                    self._lane_put(lane, Abort(req))
                    continue
                slots = [heapq.heappop(lane.free) for _ in range(req.params.n)]
                try:
                    state, firsts = engine.bulk_insert(
                        prefix, state, slots, keys=req.keys, index=j, length=len(req.prompt_ids)
                    )
                except Exception as e:
                    for s in slots:
                        heapq.heappush(lane.free, s)
                    self._fail(req, f"insert failed: {e}")
                    continue
                for i, (slot, first) in enumerate(zip(slots, firsts, strict=True)):
                    lane.owners[slot] = (req, i)
                    req.samples[i].slot = slot
                    self._lane_put(lane, FirstToken((req, i, slot), first))
            idle = all(o is None for o in lane.owners)
            stall = 0.0 if idle else self._decode_stall(lane, last_step)
            if idle or stall > 0:
                self._may_prefill.set()
                if pending is not None:
                    self._lane_put(lane, pending)
                    pending = None
                try:
                    lane.waiting.append(lane.backlog.get(timeout=0.05 if idle else stall))
                except queue.Empty:
                    pass
                continue
            last_step = time.monotonic()
            try:
                state, out = engine.decode(state)
            except Exception as e:  # a device failure takes every running request with it, not the driver
                log.exception("decode step failed")
                for slot, owner in enumerate(lane.owners):
                    if owner is not None:
                        self._fail(owner[0], f"decode failed: {e}")
                        self._release(lane, slot)
                state, pending = engine.init_decode_state(), None
                continue
            for leaf in out:
                leaf.copy_to_host_async()
            self._may_prefill.set()
            if pending is not None:
                self._lane_put(lane, pending)
            pending = Step(out, list(lane.owners))
        if pending is not None:
            self._lane_put(lane, pending)
        self._lane_put(lane, STOP, force=True)
        for owner in {o[0] for o in lane.owners if o is not None}:
            if not owner.done:
                self._finish(owner, "abort")

    def _decode_stall(self, lane: _DecodeLane, last_step: float) -> float:
        """Seconds the next decode step should wait for prompts still being prefilled (0: decode now).

        Only while this lane has free slots for them, prompts are on their way (queued, prefilling or in
        transfer), and the running requests have not already waited max_decode_stall since their last
        step. Not in interleaved mode, where prefill itself waits for decode steps."""
        if self.interleaved_mode or self.max_decode_stall <= 0 or not lane.free or lane.waiting:
            return 0.0
        if not (self._in_pipeline or lane.backlog.qsize()):  # landed since the admission pass: admit first
            return 0.0
        return max(0.0, self.max_decode_stall - (time.monotonic() - last_step))

    def _lane_put(self, lane: _DecodeLane, item, force: bool = False) -> None:
        if force:
            lane.detok.put(item)
        else:
            self._put_blocking(lane.detok, item)

    def _detokenize_loop(self, lane: _DecodeLane) -> None:
        max_length = lane.engine.max_length
        while True:
            item = lane.detok.get()
            if item is STOP:
                return
            if isinstance(item, Abort):
                self._finish(item.req, "abort")
                continue
            if isinstance(item, FirstToken):
                req, i, slot = item.owner
                host = [np.asarray(x) for x in item.result]
                self._account(lane, req, i, slot, host, 0, max_length)
                self._flush(lane, [req])
                continue
            owners = item.owners
            host = [np.asarray(x) for x in item.result]
            touched = []
            for slot, owner in enumerate(owners[: len(host[0])]):  # the step decoded the leading slots
                if owner is None:
                    continue
                req, i = owner
                if req.samples[i].done or req.cancelled:
                    continue
                self._account(lane, req, i, slot, host, slot, max_length)
                touched.append(req)
            self._flush(lane, list(dict.fromkeys(touched)))

    def _account(
        self, lane: _DecodeLane, req: ActiveRequest, i: int, slot: int, host, row: int, max_length: int
    ):
        tokens, logprob, top_ids, top_lps = host
        try:
            finish = req.add_token(i, int(tokens[row]), logprob[row], top_ids[row], top_lps[row], max_length)
        except Exception as e:
            self._fail(req, f"detokenization failed: {e}")
            for s in req.samples:
                if s.slot is not None:
                    lane.release.put((s.slot, req))
            return
        self._metrics.tokens(1)
        if finish is not None:
            lane.release.put((slot, req))

    def _flush(self, lane: _DecodeLane, reqs: Sequence[ActiveRequest]) -> None:
        for req in reqs:
            if req.error is not None:
                continue
            deltas = req.take_deltas()
            if deltas:
                req.channel.put(deltas)
            if req.done and self._finalize(req):
                req.metadata.finished_at = time.time()
                self._metrics.request_finished(req, req.metadata.finished_at)
                req.channel.close()
