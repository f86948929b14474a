"""oDriver: continuous batching over a paged oEngine, on the shared pipeline.

    submit -> [prefill queue] -> prepare thread -> [backlog] -> step thread -> [detokenize queue]
           -> detokenize thread -> each request's ReturnChannel
                 ^                                                  |
                 +------ [requeue]: preempted sequences, recomputed -+

The queues, threads, request lifecycle and detokenizer are the pipeline's (pipeline.py). What is oDriver's
own: the prepare thread does the host work of a new request off the step thread (prefix keys of its pages,
the device inputs of its sampler), and ``PagedSteps`` plans each step over the pages. The step thread owns
the paged cache and every device step, so prefill and decode never race for the pages: each loop admits
waiting sequences whose pages fit, gives decoding sequences their next page (preempting the youngest when
pages run out), and dispatches one mixed step (engines/paged/mixed_step.py): every decoding row plus prefill
chunks of up to a few sequences within the token budget (``max_num_batched_tokens``), so decode never
waits for a whole prompt. Step n+1 is dispatched before step n's tokens are read.

A preempted sequence's tokens are known only to the detokenize thread (the device runs ahead), so the step
thread hands it there after every step that included it; the detokenizer, which then has every token the
sequence produced, queues its recompute (prompt + those tokens, same sampler key and step).

Structured output (grammars): a step with a constrained sequence runs the forward, fills the token masks
while it runs and then samples under them; steps without one are unchanged (paged/grammars.py).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ...contracts.engine_config import EngineConfig
from ...engines.host_arrays import put_host
from ...engines.paged.mixed_step import ChunkWork
from ...engines.paged.oengine import PagedEngine
from ...engines.paged.paging import page_hashes
from ..active_request import ActiveRequest
from ..lora_adapters import adapters_for, left, lora_figures, pin_request, submit_request
from ..metrics import DriverMetrics
from ..pipeline import Lane, Pipeline, StepLoop, drain
from ..queue_messages import Abort, FirstToken, Preempt, Prepared
from .grammars import PagedGrammars
from .page_scheduler import Chunk, PageScheduler, Seq

log = logging.getLogger(__name__)
_DEFAULTS = EngineConfig()


class PagedSteps:
    """The paged cache's step planning: oDriver's Stepper (pipeline.py)."""

    def __init__(self, driver: oDriver, lane: Lane):
        self.driver, self.lane = driver, lane
        self.pipeline = driver.pipeline
        self.engine: PagedEngine = driver.engine
        self.sched: PageScheduler = driver.scheduler
        self.requeue: queue.SimpleQueue[Seq] = driver._requeue
        self._table: jax.Array | None = None  # the page table on the device, re-sent when it changes
        self._version = -1
        self._loop: StepLoop | None = None
        self._chunks: list[Chunk] = []  # planned for the next step
        self._firsts: list[tuple[Chunk, Any]] = []  # final chunks of the step just dispatched
        # structured output: matchers and token masks of the constrained sequences (paged/grammars.py)
        self.grammars = PagedGrammars(self.pipeline, self.engine, self.sched)

    # ------------------------------------------------------------------ Stepper
    def init_state(self) -> Any:
        return self.engine.init_decode_state()

    def plan(self, state: Any, loop: StepLoop) -> tuple[Any, bool]:
        sched = self.sched
        self._drop_ended(loop)
        idle = sched.num_used_slots == 0 and not sched.waiting
        self._take_arrivals(wait=0.05 if idle and loop.pending is None else 0.0)
        self._loop = loop
        sched.admit()
        preempted = sched.grow() if sched.any_decoding() else []
        if preempted or not sched.any_decoding():
            loop.flush()  # everything a preempted sequence produced goes out before its Preempt
            self._preempted(preempted, loop)
        eng = self.engine
        self._chunks = sched.plan_step(eng.token_budget, eng.step_seqs, eng.step_tokens[-1])
        if sched.any_decoding():
            return state, True  # the pipeline dispatches the step (decode rows + these chunks)
        if self._chunks:  # prefill only: no decode rows, so no tokens for the pipeline to hand on
            started = time.perf_counter()
            try:
                state, _, _ = self._dispatch(state, np.zeros(0, bool))
            except Exception as e:
                log.exception("prefill step failed")
                return self.lose_state(f"prefill failed: {e}"), False
            took = time.perf_counter() - started
            self._seat_finals(loop, self.pipeline.clock.dispatched("prefill", self.engine, took))
        return state, False

    def step(self, state: Any) -> tuple[Any, Any, list[Seq | None]]:
        sched = self.sched
        active = sched.active_rows()
        state, out, rows = self._dispatch(state, active)
        if out is None:  # the chunks failed alone and no decode row was left: a decode-only step
            state, out, rows = self._dispatch(state, active)
        return state, out, sched.decoding(rows)

    def stepped(self) -> None:
        self.sched.stepped()  # sequences whose last token this was are released now
        if self._loop is not None:
            self._seat_finals(self._loop)

    def _dispatch(self, state: Any, active: np.ndarray) -> tuple[Any, Any, int]:
        """One mixed step of the planned chunks and the ``active`` decode rows: (state, decode result or
        None, rows it covered). A failure that left the state intact fails the chunks' requests alone."""
        sched, eng = self.sched, self.engine
        chunks, self._chunks = [c for c in self._chunks if sched.holds(c.seq)], []
        if self._version != sched.table_version:
            self._version = sched.table_version
            self._table = put_host(sched.table.copy(), eng._replicated())
        now = time.time()
        self.step_kind = "mixed" if chunks else "decode"  # for its timing (step_timing.py)
        work = []
        for c in chunks:
            seq = c.seq
            if seq.req.metadata.prefill_started_at is None:
                seq.req.metadata.prefill_started_at = now
            tokens = seq.tokens[c.start : c.start + c.length]
            inputs = seq.inputs if c.final else None
            work.append(
                ChunkWork(tokens, c.start, sched.row(seq), seq.slot, inputs, adapter=seq.req.adapter_slot)
            )
        try:
            if self.grammars.wanted(chunks):  # the forward, the masks while it runs, then the samplers
                state, out, firsts = self.grammars.step(state, self._table, active, chunks, work)
            else:
                state, out, firsts = eng.step(state, self._table, active, work)
        except Exception as e:
            if not chunks or any(x.is_deleted() for x in jax.tree.leaves(state)):
                raise  # the pipeline fails everything running and restarts the cache
            log.exception("prefill step failed")
            for c in chunks:
                sched.release(c.seq)
                self.pipeline.fail(c.seq.req, f"prefill failed: {e}")
                c.seq.req.cancel()  # frees its other samples on the next loop
            return state, None, 0
        for c in chunks:
            sched.written(c.seq, c.start + c.length)
        self._firsts = [(chunks[k], first) for k, first in firsts]
        return state, out, 0 if out is None else out.tokens.shape[0]

    def _seat_finals(self, loop: StepLoop, timing: Any = None) -> None:
        """Sequences whose final chunk went out in the last step: their first token, then decoding.
        ``timing``: the step's (a prefill-only step), read ready with its first token."""
        firsts, self._firsts = self._firsts, []
        now = time.time()
        for k, (chunk, first) in enumerate(firsts):
            seq = chunk.seq
            seq.req.metadata.prefill_done_at = now
            loop.send(FirstToken(seq, first, timing if k == 0 else None))
            if not self.sched.start_decoding(seq):
                self.sched.release(seq)  # its first token was its last

    def lose_state(self, reason: str) -> Any:
        """A device step consumed the state and failed: every running sequence fails, the cache restarts."""
        self._version, self._chunks, self._firsts = -1, [], []
        self.grammars.reset()
        for seq in self.sched.reset():
            self.pipeline.fail(seq.req, reason)
            seq.req.cancel()
        return self.engine.init_decode_state()

    def stopped(self) -> None:
        pass  # oDriver.stop() aborts what the scheduler still holds, once the threads are joined

    # ------------------------------------------------------------------ planning
    def _take_arrivals(self, wait: float = 0.0) -> None:
        sched, grammars = self.sched, self.grammars
        # constrained requests that waited for the structured-output programs, ahead of new arrivals
        for seq in reversed(grammars.ready()):
            sched.add(seq, front=True)
        for seq in reversed(drain(self.requeue)):  # recomputes go first, in the order they were preempted
            sched.add(seq, front=True)
        # prepared requests wait in the bounded backlog, not here, so the queues stay bounded
        while len(sched.waiting) + grammars.num_held < sched.num_slots:
            try:
                item = self.lane.backlog.get(timeout=wait) if wait else self.lane.backlog.get_nowait()
            except queue.Empty:
                break
            wait = 0.0
            if grammars.hold(item):  # until the masked programs are compiled
                continue
            for seq in item.seqs:
                sched.add(seq)

    def _drop_ended(self, loop: StepLoop) -> None:
        """Free what the detokenizer finished, and everything of cancelled requests."""
        sched = self.sched
        for seq in drain(self.lane.release):
            sched.release(seq)
        aborted = {}
        for seq in sched.running:
            if seq.req.cancelled:
                sched.release(seq)
                aborted[id(seq.req)] = seq.req
        for seq in sched.drop_waiting(lambda s: s.req.cancelled or s.req.error is not None):
            aborted[id(seq.req)] = seq.req
        for req in self.grammars.drop_cancelled():
            aborted[id(req)] = req
        for req in aborted.values():
            loop.send(Abort(req))

    def _preempted(self, seqs: list[Seq], loop: StepLoop) -> None:
        for seq in seqs:
            if seq.decoding:
                # its tokens so far are in flight to the detokenizer, which queues the recompute
                loop.send(Preempt(seq))
            else:
                self.sched.add(seq.fresh(), front=True)


class oDriver:  # noqa: N801 - the seed's name
    """Continuous batching over one oEngine: the pipeline's request lifecycle (submit, cancel, fail alone,
    graceful stop, metrics) with paged KV, prefix caching and preemption."""

    supports_structured_output = True  # token masks in PagedGrammars (paged/grammars.py)

    def __init__(
        self,
        engine: PagedEngine,
        detokenizing_blocks: int = _DEFAULTS.detokenizing_blocks,
        max_queue_size: int = _DEFAULTS.max_queue_size,
    ):
        self._engine = engine
        self.detokenizing_blocks = detokenizing_blocks
        self.pipeline = Pipeline(max_queue_size, detokenizing_blocks)
        self._sched = PageScheduler(
            engine.manager, engine.max_concurrent_decodes, engine.max_length, engine.max_prefill_length
        )
        self._requeue: queue.SimpleQueue[Seq] = queue.SimpleQueue()
        self._lane = self.pipeline.new_lane(2 * engine.max_concurrent_decodes)
        self._steps = PagedSteps(self, self._lane)
        # LoRA adapters (drivers/lora_adapters.py): None unless the engine carries an adapter bank
        self.lora = adapters_for([engine])
        self.pipeline.end_hooks.append(left(self.lora))

    # ------------------------------------------------------------------ seed API
    @property
    def driver_name(self) -> str:
        return f"odriver-{self._engine.model_name}"

    @property
    def engine(self) -> PagedEngine:
        return self._engine

    @property
    def engines(self) -> list[PagedEngine]:
        return [self._engine]

    @property
    def processor(self) -> Any:
        return self._engine.processor

    @property
    def scheduler(self) -> PageScheduler:
        return self._sched

    @property
    def live(self) -> bool:
        return self.pipeline.live

    @property
    def num_used_slots(self) -> int:
        return self._sched.num_used_slots

    def get_total_concurrent_requests(self) -> int:
        return self._engine.max_concurrent_decodes

    def add_observer(self, fn) -> None:
        self.pipeline.metrics.observers.append(fn)

    def submit_request(self, request: Any) -> None:
        n = self._engine.max_concurrent_decodes
        submit_request(self.lora, request, lambda: self.pipeline.submit(request, n))

    def place_request_on_prefill_queue(self, request: ActiveRequest) -> None:
        self.submit_request(request)

    def metrics(self) -> DriverMetrics:
        m, sched, mgr = self.pipeline.metrics, self._sched, self._engine.manager
        used, total = self.num_used_slots, self.get_total_concurrent_requests()
        queued = self.pipeline.prefill_q.qsize()
        held = self._steps.grammars.num_held  # constrained, waiting for the masked programs
        backlog = self._lane.backlog.qsize() + len(sched.waiting) + self._requeue.qsize() + held
        waiting = queued + backlog
        return DriverMetrics(
            slots_used=used,
            slots_total=total,
            slot_occupancy=used / total if total else 0.0,
            prefill_queue_size=queued,
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
            **lora_figures(self.lora),
        )

    # ------------------------------------------------------------------ lifecycle
    def compile(self, progress: Callable[[str], None] | None = None) -> float:
        seconds = self._engine.compile(progress)
        if self.lora is not None:
            self.lora.bank.warm()  # the bank's update programs: loading an adapter compiles nothing
        if self.live:  # the step thread already holds a state: do not keep a second cache alive
            self._engine._spare = None
        return seconds

    def start(self) -> None:
        if self.live:
            return
        p, lane = self.pipeline, self._lane
        p.start(
            [
                (self._prepare_loop, (), "prefill-0"),
                (p.step_loop, (lane, self._steps), "generate-0"),
                (p.detokenize_loop, (lane, self._engine.max_length, self._recompute), "detokenize-0"),
            ]
        )

    def stop(self) -> None:
        """Stop every thread; requests queued, waiting or running end with 'abort' and every page returns."""
        if not self.live:
            return
        self.pipeline.stop([self._lane])  # joins the threads and aborts what is left in the queues
        for seq in list(self._sched.waiting) + self._sched.running + drain(self._requeue):
            self.pipeline.finish(seq.req, "abort")
        self._sched.waiting.clear()
        self._steps.grammars.abort_held(self.pipeline.finish)
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
        if keys is None:  # an adapter's KV is its own: its pages are keyed apart from the base's
            seed = (
                b"" if req.adapter is None or self.lora is None else self.lora.identity(req.adapter).encode()
            )
            keys = page_hashes(tokens, eng.page_size, seed)
        inputs = eng.seq_inputs(
            req.params, sorted(req.stop_ids), req.keys[index], req.prompt_ids, generated, req.adapter_slot
        )
        return Seq(req, index, tokens, keys, len(generated), n, req.budget(eng.max_length), inputs)

    def _prepare_loop(self) -> None:
        p = self.pipeline
        while p.live:
            req = p.next_request()
            if req is None:
                continue
            if req.cancelled:
                p.finish(req, "abort")
                continue
            # its adapter's bank slot; waiting here is safe: the slots are pinned by requests already
            # handed to the step thread, which end without this thread
            if not pin_request(self.lora, req, True, lambda: p.live):
                if not req.finalized:
                    p.finish(req, "abort")  # stopping
                continue
            try:
                first = self._make_seq(req, 0, [])
                seqs = [first] + [self._make_seq(req, i, [], first.keys) for i in range(1, req.params.n)]
                if req.params.prompt_logprobs is not None:  # a dense pass of its own, off the step thread
                    req.prompt_logprobs = self._engine.score_prompt(
                        req.prompt_ids, req.params.prompt_logprobs, req.adapter_slot
                    )
            except Exception as e:  # one bad request must not take the driver down
                p.fail(req, f"prefill failed: {e}")
                continue
            if p.put(self._lane.backlog, Prepared(req, seqs)):
                p.left_pipeline(req)
            else:
                p.finish(req, "abort")

    def _recompute(self, seq: Seq) -> None:
        """Queue a preempted sequence again (detokenize thread): its prompt and every token it produced,
        same key and step."""
        req = seq.req
        if req.cancelled or not self.live:
            self.pipeline.finish(req, "abort")
            return
        sample = req.samples[seq.index]
        if sample.done or req.error is not None:
            return
        try:
            self._requeue.put(self._make_seq(req, seq.index, list(sample.token_ids)))
        except Exception as e:
            self.pipeline.fail(req, f"recompute failed: {e}")
            req.cancel()
