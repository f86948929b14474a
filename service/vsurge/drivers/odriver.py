"""oDriver: continuous batching over a paged oEngine, with vDriver's threads, queues and lifecycle.

    submit -> [prefill queue] -> prefill thread -> [backlog] -> generate thread -> [detokenize queue]
           -> detokenize thread -> each request's ReturnChannel
                 ^                                                  |
                 +------ [requeue]: preempted sequences, recomputed -+

The prefill thread does the host work of a new request off the generate thread: prefix keys of its pages
and the device inputs of its sampler. The generate thread owns the paged cache and every device step, so
chunked prefill and decode never race for the pages: each loop admits waiting sequences whose pages fit,
runs about one largest bucket of prefill chunks, gives decoding sequences their next page (preempting the
youngest when pages run out), and dispatches decode step n+1 before step n's tokens are read.

A preempted sequence's tokens are known only to the detokenize thread (the device runs ahead), so the
generate thread hands it there after every step that included it; the detokenizer, which then has every
token the sequence produced, queues its recompute (prompt + those tokens, same sampler key and step).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import jax
import numpy as np

from ..engines.oengine import oEngine
from ..engines.page_scheduler import Chunk, PageScheduler, Seq
from ..engines.paging import page_hashes
from .active_request import ActiveRequest
from .lanes import STOP, Abort, FirstToken, Preempt, Prepared, Step
from .metrics import DriverMetrics
from .vdriver import _DEFAULTS, vDriver

log = logging.getLogger(__name__)


class oDriver(vDriver):  # noqa: N801 - the seed's name
    """vDriver's request lifecycle (submit, cancel, fail alone, graceful stop, metrics) over an oEngine."""

    def __init__(
        self,
        engine: oEngine,
        detokenizing_blocks: int = _DEFAULTS.detokenizing_blocks,
        max_queue_size: int = _DEFAULTS.max_queue_size,
    ):
        super().__init__(
            engine, engine, detokenizing_blocks=detokenizing_blocks, max_queue_size=max_queue_size
        )
        self._engine = engine
        self._lane = self._lanes[0]
        self._sched = PageScheduler(
            engine.manager, engine.max_concurrent_decodes, engine.max_length, engine.max_prefill_length
        )
        self._requeue: queue.SimpleQueue = queue.SimpleQueue()

    # ------------------------------------------------------------------ seed API
    @property
    def driver_name(self) -> str:
        return f"odriver-{self._engine.model_name}"

    @property
    def engine(self) -> oEngine:
        return self._engine

    @property
    def scheduler(self) -> PageScheduler:
        return self._sched

    @property
    def num_used_slots(self) -> int:
        return self._sched.num_used_slots

    def metrics(self) -> DriverMetrics:
        m, sched, mgr = self._metrics, self._sched, self._engine.manager
        used, total = self.num_used_slots, self.get_total_concurrent_requests()
        backlog = self._lane.backlog.qsize() + len(sched.waiting) + self._requeue.qsize()
        waiting = self._prefill_q.qsize() + backlog
        return DriverMetrics(
            slots_used=used,
            slots_total=total,
            slot_occupancy=used / total if total else 0.0,
            prefill_queue_size=self._prefill_q.qsize(),
            transfer_queue_size=0,
            generate_backlog_size=backlog,
            requests_running=max(0, m.running - waiting),
            requests_waiting=waiting,
            prompt_tokens_total=m.prompt_tokens,
            generation_tokens_total=m.generated_tokens,
            finished_total=dict(m.finished),
            pages_used=mgr.num_used,
            pages_total=mgr.num_pages,
            preemptions_total=sched.preemptions,
            prefix_cache_hits_total=mgr.hits,
        )

    # ------------------------------------------------------------------ lifecycle
    def compile(self, progress=None) -> float:
        seconds = self._engine.compile(progress)
        if self._live:  # the generate thread already holds a state: do not keep a second cache alive
            self._engine._spare = None
        return seconds

    def start(self) -> None:
        if self._live:
            return
        self._live = True
        for fn, name in (
            (self._prepare_loop, "prefill-0"),
            (self._generate_loop, "generate-0"),
            (self._detokenize_loop, "detokenize-0"),
        ):
            t = threading.Thread(target=fn, args=(self._lane,), name=f"vsurge-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop every thread; requests queued, waiting or running end with 'abort' and every page returns."""
        if not self._live:
            return
        super().stop()  # joins the threads and aborts what is left in the queues
        left = list(self._sched.waiting) + self._sched.running
        while True:
            try:
                left.append(self._requeue.get_nowait())
            except queue.Empty:
                break
        for seq in left:
            self._finish(seq.req, "abort")
        self._sched.waiting.clear()
        self._sched.reset()

    # ------------------------------------------------------------------ sequences
    def _make_seq(self, req: ActiveRequest, index: int, generated: list[int], keys=None) -> Seq:
        eng = self._engine
        n = len(req.prompt_ids)
        if n < 1:
            raise ValueError("empty prompt")
        if n >= eng.max_length:
            raise ValueError(
                f"prompt of {n} tokens leaves no room to generate within max_length {eng.max_length}"
            )
        tokens = np.asarray(req.prompt_ids + list(generated), np.int32)
        if keys is None:
            keys = page_hashes(tokens, eng.page_size)
        inputs = eng.seq_inputs(req.params, sorted(req.stop_ids), req.keys[index], req.prompt_ids, generated)
        return Seq(req, index, tokens, keys, len(generated), n, req.params.max_tokens, inputs)

    def _prepare_loop(self, lane) -> None:
        while self._live:
            try:
                req = self._prefill_q.get(timeout=0.1)
            except queue.Empty:
                continue
            if req.cancelled:
                self._finish(req, "abort")
                continue
            try:
                first = self._make_seq(req, 0, [])
                seqs = [first] + [self._make_seq(req, i, [], first.keys) for i in range(1, req.params.n)]
                if req.params.prompt_logprobs is not None:  # a dense pass of its own, off the generate thread
                    req.prompt_logprobs = self._engine.score_prompt(
                        req.prompt_ids, req.params.prompt_logprobs
                    )
            except Exception as e:  # one bad request must not take the driver down
                self._fail(req, f"prefill failed: {e}")
                continue
            if not self._put_blocking(lane.backlog, Prepared(req, seqs)):
                self._finish(req, "abort")

    # ------------------------------------------------------------------ generate thread
    def _take_arrivals(self, lane, wait: float = 0.0) -> None:
        sched = self._sched
        back = []
        while True:
            try:
                back.append(self._requeue.get_nowait())
            except queue.Empty:
                break
        for seq in reversed(back):  # recomputes go first, in the order they were preempted
            sched.add(seq, front=True)
        # prepared requests wait in the bounded backlog, not here, so the queues stay bounded
        while len(sched.waiting) < sched.num_slots:
            try:
                seqs = (lane.backlog.get(timeout=wait) if wait else lane.backlog.get_nowait()).seqs
            except queue.Empty:
                break
            wait = 0.0
            for seq in seqs:
                sched.add(seq)

    def _drop_ended(self, lane) -> None:
        """Free what the detokenizer finished, and everything of cancelled requests."""
        sched = self._sched
        while True:
            try:
                sched.release(lane.release.get_nowait())
            except queue.Empty:
                break
        aborted = {}
        for seq in sched.running:
            if seq.req.cancelled:
                sched.release(seq)
                aborted[id(seq.req)] = seq.req
        for seq in sched.drop_waiting(lambda s: s.req.cancelled or s.req.error is not None):
            aborted[id(seq.req)] = seq.req
        for req in aborted.values():
            self._lane_put(lane, Abort(req))

    def _run_chunk(self, lane, state, chunk: Chunk):
        sched, seq = self._sched, chunk.seq
        if not sched.holds(seq):
            return state  # an earlier chunk of it failed
        md = seq.req.metadata
        if md.prefill_started_at is None:
            md.prefill_started_at = time.time()
        try:
            state, first = self._engine.prefill_chunk(
                state, seq.inputs, seq.tokens, chunk.start, chunk.length, sched.row(seq), seq.slot
            )
        except Exception as e:
            log.exception("prefill chunk failed")
            if any(x.is_deleted() for x in jax.tree.leaves(state)):
                return self._lose_state(f"prefill failed: {e}")
            sched.release(seq)
            self._fail(seq.req, f"prefill failed: {e}")
            seq.req.cancel()  # frees its other samples on the next loop
            return state
        sched.written(seq, chunk.start + chunk.length)
        if chunk.final:
            md.prefill_done_at = time.time()
            self._lane_put(lane, FirstToken(seq, first))
            if not sched.start_decoding(seq):
                sched.release(seq)  # its first token was its last
        return state

    def _lose_state(self, reason: str):
        """A device step consumed the state and failed: every running sequence fails, the cache restarts."""
        for seq in self._sched.reset():
            self._fail(seq.req, reason)
            seq.req.cancel()
        return self._engine.init_decode_state()

    def _preempted(self, lane, seqs: list[Seq]) -> None:
        for seq in seqs:
            if seq.decoding:
                # its tokens so far are in flight to the detokenizer, which queues the recompute
                self._lane_put(lane, Preempt(seq))
            else:
                self._sched.add(seq.fresh(), front=True)

    def _generate_loop(self, lane) -> None:
        eng, sched = self._engine, self._sched
        state = eng.init_decode_state()
        pending = None  # (device SampleResult, per-slot sequences) of the step in flight
        dev_table, version = None, -1
        while self._live:
            self._drop_ended(lane)
            idle = sched.num_used_slots == 0 and not sched.waiting
            self._take_arrivals(lane, wait=0.05 if idle and pending is None else 0.0)
            sched.admit()
            for chunk in sched.plan_prefill():
                state = self._run_chunk(lane, state, chunk)
            preempted = sched.grow() if sched.any_decoding() else []
            if preempted or not sched.any_decoding():
                if pending is not None:  # everything a preempted sequence produced goes out first
                    self._lane_put(lane, pending)
                    pending = None
                self._preempted(lane, preempted)
            if not sched.any_decoding():
                continue
            if version != sched.table_version:
                version = sched.table_version
                dev_table = jax.device_put(sched.table.copy(), eng._replicated())
            try:
                state, out = eng.decode(state, dev_table, sched.decode_rows(), sched.decode_tokens())
            except Exception as e:  # a device failure takes every running request with it, not the driver
                log.exception("decode step failed")
                state, pending, version = self._lose_state(f"decode failed: {e}"), None, -1
                continue
            for leaf in out:
                leaf.copy_to_host_async()
            if pending is not None:
                self._lane_put(lane, pending)
            pending = Step(out, sched.decoding(out.tokens.shape[0]))
            sched.stepped()  # sequences whose last token this was are released now
        if pending is not None:
            self._lane_put(lane, pending)
        self._lane_put(lane, STOP, force=True)

    # ------------------------------------------------------------------ detokenize thread
    def _detokenize_loop(self, lane) -> None:
        max_length = self._engine.max_length
        while True:
            item = lane.detok.get()
            if item is STOP:
                return
            if isinstance(item, Abort):
                self._finish(item.req, "abort")
            elif isinstance(item, Preempt):
                self._recompute(item.seq)
            elif isinstance(item, FirstToken):
                seq, first = item.owner, item.result
                if seq.index == 0 and not seq.req.samples[0].prompt_info_sent:
                    seq.req.num_cached_tokens = seq.cached_tokens  # usage.prompt_tokens_details
                self._take_token(lane, seq, [np.asarray(x) for x in first], 0, max_length)
                self._flush(lane, [seq.req])
            else:
                seqs = item.owners
                host = [np.asarray(x) for x in item.result]
                touched = {}
                for slot, seq in enumerate(seqs):
                    if seq is not None and self._take_token(lane, seq, host, slot, max_length):
                        touched[id(seq.req)] = seq.req
                self._flush(lane, list(touched.values()))

    def _take_token(self, lane, seq: Seq, host, row: int, max_length: int) -> bool:
        req = seq.req
        if req.cancelled:
            # a sequence the generate thread released on its own (max_tokens reached) may never be seen
            # there again: end the request here (idempotent), or nobody would
            self._finish(req, "abort")
            return False
        if req.samples[seq.index].done or req.error is not None:
            return False
        tokens, logprob, top_ids, top_lps = host
        try:
            finish = req.add_token(
                seq.index, int(tokens[row]), logprob[row], top_ids[row], top_lps[row], max_length
            )
        except Exception as e:
            self._fail(req, f"detokenization failed: {e}")
            req.cancel()  # the generate thread frees its slots and pages
            return False
        self._metrics.tokens(1)
        if finish is not None:
            lane.release.put(seq)
        return True

    def _recompute(self, seq: Seq) -> None:
        """Queue a preempted sequence again: its prompt and every token it produced, same key and step."""
        req = seq.req
        if req.cancelled or not self._live:
            self._finish(req, "abort")
            return
        sample = req.samples[seq.index]
        if sample.done or req.error is not None:
            return
        try:
            self._requeue.put(self._make_seq(req, seq.index, list(sample.token_ids)))
        except Exception as e:
            self._fail(req, f"recompute failed: {e}")
            req.cancel()
