"""PagedEngine (the core of oEngine): the model over a paged KV cache (PagedAttentionCache and
HBMPageManager).

Jitted programs, each taking the pages (or the whole decode state) donated so they update in place:

* the mixed step (what oDriver runs; mixed_step.py): every decoding row plus prefill chunks of up to
  ``step_seqs`` sequences within ``max_num_batched_tokens``, one forward per (rows, chunk tokens) bucket,
  then the sampler for the rows and ``seat`` for each final chunk (`step`); a step with a constrained
  row (structured output) runs in two halves, `step_logits` then `step_sample` under the token masks,
  whose masked programs `warm_structured` compiles on first need (paged/structured_output.py);

The per-sequence programs below remain for direct use (``prefill_chunk`` / ``decode``; compiled on first
call unless ``legacy_programs`` is set before ``compile()``):

* prefill: one sequence's chunk of up to T tokens (T a prefill bucket) at absolute positions, written into
  its pages and attending to every page before it (a cached prefix, earlier chunks); then ``seat`` samples
  the token after the chunk and puts the sequence in its decode slot (only the final chunk's token is
  used; seating after every chunk keeps one program for all);
* decode, as in vEngine: a forward over the first ``rows`` slots, then the sampler per row count.

Programs read only the first ``num_pages`` columns of a page table, ``num_pages`` from a few static buckets;
every (chunk bucket, page bucket) pair that can occur and every (rows, page bucket) of decode is compiled
in ``compile()``. Which pages a sequence gets, and when, is decided on the host (drivers/paged/page_scheduler.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ...contracts.engine_config import EngineConfig
from ...contracts.sampling_params import SamplingParams
from ...models.pallas_sharded import configure as configure_attention
from ...models.target import target_backend
from ..engine_base import EngineBase, _doubling, compile_jobs, decode_buckets, resolve_token_budget
from ..host_arrays import put_host
from ..sampling import DEFAULT_MAX_STOP_IDS, SampleResult, SlotSampling, make_slot_sampling
from .kernel_fallback import compile_with_fallback
from .mixed_step import ChunkWork, MetaLayout, mixed_forward, pack_meta, seat_chunk
from .paging import HBMPageManager, PagedAttentionCache
from .programs import (
    PagedState,
    SeqInputs,
    forward_impl,
    prefill_impl,
    program_jobs,
    sampler_rows,
    step_metas,
    with_rows,
)
from .seat import first_of_chunk, place, seat
from .structured_output import StructuredSpecs, masked_programs, warm_structured

log = logging.getLogger(__name__)


# Prefill chunks one mixed step packs at most (more sequences per step would multiply the chunk walk's
# work, each chunk's keys meeting every query of the step).
STEP_SEQS = 4


def step_token_buckets(budget: int, smallest: int = 32) -> list[int]:
    """Prefill tokens a mixed step may carry: 0 (decode only) and powers of two up to the budget."""
    return [0] + _doubling(min(smallest, budget), budget)


def page_buckets(max_length: int, page_size: int, smallest_tokens: int = 128) -> list[int]:
    """How many page-table columns a step may read: the pages of vEngine's kv_len buckets."""
    return sorted({-(-n // page_size) for n in decode_buckets(max_length, smallest_tokens)})


class PagedEngine(EngineBase):
    """Paged-cache engine: chunked prefill into pages, decode over page tables. The public oEngine
    (vsurge/seed_api/engines.py) is this with the seed's constructor and steps."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        config: EngineConfig,
        storage: PagedAttentionCache | None = None,
        manager: HBMPageManager | None = None,
    ):
        """``storage`` / ``manager``: a cache and page manager to use instead of new ones (None: made
        here)."""
        cfg = model.config
        # the largest bucket is the largest chunk; longer prompts are prefilled in several chunks
        self._setup(model, processor, config)
        if self.decode_rows[0] > 1 and target_backend() == "cpu":
            # one live row runs a 1-row step: XLA:CPU's matrix-vector path (one stream 0.46 -> 0.60x the raw
            # loop); not 2 too, as each row bucket is a mixed program per chunk bucket to compile
            self.decode_rows = [1, *self.decode_rows]
        # before the cache (the backend picks its layout); refuses kv heads no tp layout can split
        configure_attention(config.attention, self.mesh, cfg, model.dtype)
        mesh, page_size, min_decode_tokens = self.mesh, config.page_size, config.min_decode_tokens
        if storage is None:
            storage = PagedAttentionCache.create(
                cfg,
                page_size,
                config.hbm_utilization,
                config.kv_cache_bytes,
                dtype=model.dtype,
                mesh=mesh,
                device=None if mesh is not None else self._device(),
            )
        self.storage = storage
        self.manager = manager or HBMPageManager.for_cache(
            storage, prefix_caching=config.enable_prefix_caching
        )
        if self.manager.page_size != storage.page_size or self.manager.num_pages > storage.num_pages:
            raise ValueError("the page manager does not match the cache (page size or page count)")
        self.page_size = storage.page_size
        self.table_width = -(-self.max_length // self.page_size)
        if self.manager.num_pages < self.table_width:
            # the oldest sequence must always be able to finish alone, or preemption could deadlock
            raise ValueError(
                f"the KV cache holds {self.manager.num_pages} pages of {self.page_size} tokens but one "
                f"sequence of max_length {self.max_length} needs {self.table_width}: raise kv_cache_bytes / "
                "hbm_utilization or lower max_length"
            )
        self.page_buckets = page_buckets(self.max_length, self.page_size, min_decode_tokens)
        self.token_budget = resolve_token_budget(config.max_num_batched_tokens, self.max_concurrent_decodes)
        self.step_seqs = min(STEP_SEQS, self.max_concurrent_decodes)
        # a step's chunk tokens never exceed the budget, nor usefully max_length (one prompt's worth)
        self.step_tokens = step_token_buckets(min(self.token_budget, self.max_length))
        # a prefill-only step runs with the smallest row count, all rows idle: one program fewer per
        # chunk bucket to compile, for the cost of a few idle rows
        self.step_rows = list(self.decode_rows)
        self._slot_adapter = np.full(self.max_concurrent_decodes, -1, np.int32)
        self._make_programs()
        # compile() also covers prefill_chunk/decode when set (oDriver runs only the mixed step; the
        # per-sequence programs stay for direct use and compile on first call)
        self.legacy_programs = False
        self.chunked = self._make_chunked()  # prompt logprobs only (prefill itself is paged)
        self._zeros_v: jax.Array | None = None
        self._spare: PagedState | None = None
        self.structured_ready = threading.Event()  # warm_structured has run (paged/structured_output.py)
        self._structured_specs: StructuredSpecs | None = None  # what it compiles for, seen by compile()
        self.compiled = False

    def _make_programs(self) -> None:
        """The jitted programs over the cache (again after a fall back from the kernel: the pages' tree
        and shardings change with their layout)."""
        ps, num_top_logprobs = self.page_size, self.num_top_logprobs
        self._state_shardings = self._make_state_shardings()
        shardings = self._state_shardings
        # the model programs are per shape; the sampler is compiled once per row count (it dominates
        # compile time), and seating a sequence once in all
        self._prefill = {
            n: jax.jit(partial(prefill_impl, self.graphdef, page_size=ps, num_pages=n), donate_argnums=(1,))
            for n in self.page_buckets
        }
        self._seat = jax.jit(
            partial(seat, num_top=num_top_logprobs, shardings=shardings), donate_argnums=(0,)
        )
        logits_sharding = self.logits_sharding
        self._forward = {
            (rows, n): jax.jit(
                partial(
                    forward_impl,
                    self.graphdef,
                    rows=rows,
                    page_size=ps,
                    num_pages=n,
                    logits_sharding=logits_sharding,
                ),
                donate_argnums=(1,),
            )
            for rows in self.decode_rows
            for n in self.page_buckets
        }
        self._sample = self._samplers(shardings)
        # the mixed step (mixed_step.py): (decode rows, chunk tokens) programs, and seating after a chunk
        self._mixed = {
            (r, p): jax.jit(
                partial(mixed_forward, self.graphdef, layout=self._layout(r, p), page_size=ps),
                donate_argnums=(1,),
            )
            for r in self.step_rows
            for p in self.step_tokens
        }
        self._seat_chunk = jax.jit(
            partial(seat_chunk, seat=partial(seat, num_top=num_top_logprobs, shardings=shardings)),
            donate_argnums=(0,),
        )
        # the seed layer's prefill / insert (seed_api/paged_prefix.py): the seat's two parts apart; first call compiles
        self._first = jax.jit(partial(first_of_chunk, num_top=num_top_logprobs, shardings=shardings))
        self._place = jax.jit(partial(place, shardings=shardings), donate_argnums=(0,))
        # structured output: the samplers under token masks, compiled by warm_structured only
        self._sample_masked, self._seat_masked = masked_programs(self)

    # ------------------------------------------------------------------ sizes
    @property
    def max_prompt_length(self) -> int:
        """Prompts are chunked, so any prompt that leaves room for one generated token is accepted."""
        return self.max_length - 1

    def pages_bucket(self, num_tokens: int) -> int:
        """The smallest page bucket covering positions [0, num_tokens)."""
        need = -(-num_tokens // self.page_size)
        return next((n for n in self.page_buckets if n >= need), self.page_buckets[-1])

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (chunk bucket, page bucket) a chunk can hit: a chunk of bucket T holds more than the
        previous bucket's tokens, so it needs at least that many positions."""
        out, prev = [], 0
        for t in self.prefill_lengths:
            least = self.pages_bucket(prev + 1)
            out += [(t, n) for n in self.page_buckets if n >= least]
            prev = t
        return out

    def _layout(self, rows: int, tokens: int) -> MetaLayout:
        return MetaLayout(rows, tokens, self.step_seqs, self.table_width, self.engine_config.enable_lora)

    def step_shape(self, num_rows: int, num_tokens: int) -> tuple[int, int]:
        """The (rows, chunk tokens) program covering ``num_rows`` leading slots and ``num_tokens``."""
        r = next((r for r in self.step_rows if r >= num_rows), None)
        p = next((p for p in self.step_tokens if p >= num_tokens), None)
        if r is None or p is None:
            raise ValueError(f"no step program for {num_rows} rows and {num_tokens} chunk tokens")
        return r, p

    # ------------------------------------------------------------------ state
    def _make_state_shardings(self) -> PagedState | None:
        if self.mesh is None:
            return None
        rep = NamedSharding(self.mesh, P())
        return PagedState(
            pages=self.storage.layer_shardings(),
            tokens=rep,
            positions=rep,
            steps=rep,
            counts=rep,
            prompt_mask=rep,
            sampling=SlotSampling(*([rep] * len(SlotSampling._fields))),
        )

    def get_state_shardings(self, is_decode: bool = False):
        return self._state_shardings

    def init_decode_state(self, *args, **kwargs) -> PagedState:
        """The decode state with zeroed pages (the one compile() warmed up, if it is still unused)."""
        if self._spare is not None:
            state, self._spare = self._spare, None
            return state
        s, v = self.max_concurrent_decodes, self.model_config.vocab_size
        put = partial(put_host, sharding=self._replicated())  # no collective across processes
        sampling = make_slot_sampling([None] * s, max_stop_ids=DEFAULT_MAX_STOP_IDS)
        return PagedState(
            pages=self.storage.allocate(),
            tokens=put(np.zeros(s, np.int32)),
            positions=put(np.zeros(s, np.int32)),
            steps=put(np.zeros(s, np.int32)),
            counts=put(np.zeros((s, v), np.int32)),
            prompt_mask=put(np.zeros((s, v), bool)),
            sampling=jax.tree.map(put, sampling),
        )

    def seq_inputs(
        self,
        params: SamplingParams,
        stop_ids: Sequence[int],
        key: np.ndarray,
        prompt_ids: Sequence[int],
        generated_ids: Sequence[int] = (),
        adapter: int = -1,
    ) -> SeqInputs:
        """Device inputs for sampling a sequence's next token after its prefill (or recompute)."""
        v, stops = self.model_config.vocab_size, [list(stop_ids)[:DEFAULT_MAX_STOP_IDS]]
        put = partial(put_host, sharding=self._replicated())  # no collective across processes
        row = make_slot_sampling([params], keys=[key], stop_ids=stops, adapters=[adapter])
        mask = np.zeros(v, bool)
        mask[np.asarray(prompt_ids, np.int64)] = True
        if generated_ids:
            counts = put(np.bincount(np.asarray(generated_ids, np.int64), minlength=v).astype(np.int32))
        else:
            if self._zeros_v is None:  # shared by every new request: no per-request upload of V zeros
                self._zeros_v = put(np.zeros(v, np.int32))
            counts = self._zeros_v
        return SeqInputs(jax.tree.map(put, row), put(mask), counts, put(np.int32(len(generated_ids))))

    # ------------------------------------------------------------------ steps
    def prefill_chunk(
        self,
        state: PagedState,
        inputs: SeqInputs,
        tokens: np.ndarray,
        start: int,
        length: int,
        row: np.ndarray,
        slot: int,
    ) -> tuple[PagedState, SampleResult]:
        """Prefill tokens[start:start+length] into the pages of ``row`` and seat the sequence in ``slot``.

        Returns the state and the token sampled after the chunk (meaningful for the final chunk).
        """
        bucket = self.bucket_for(length)
        padded = np.full(bucket, self.pad_token_id, np.int32)
        padded[:length] = tokens[start : start + length]
        end = np.int32(start + length)
        fn = self._prefill[self.pages_bucket(start + length)]
        pages, logits = fn(self.params, state.pages, padded, np.int32(start), end, row)
        return self._seat(state._replace(pages=pages), logits, np.int32(slot), end, inputs)

    def decode(self, state: PagedState, table: jax.Array | np.ndarray, num_rows: int, num_tokens: int):
        """One token for each of the first ``num_rows`` slots (slots are handed out lowest first), reading
        the page columns that cover ``num_tokens`` positions. Results have one row per decoded slot."""
        rows = next((r for r in self.decode_rows if r >= num_rows), self.max_concurrent_decodes)
        fn = self._forward[(rows, self.pages_bucket(num_tokens))]
        pages, logits = fn(self.params, state.pages, state.tokens, state.positions, table)
        return self._sample[rows](state._replace(pages=pages), logits)

    def step(
        self,
        state: PagedState,
        table: jax.Array | np.ndarray,
        active: np.ndarray,
        chunks: Sequence[ChunkWork] = (),
    ) -> tuple[PagedState, SampleResult | None, list[tuple[int, SampleResult]]]:
        """One mixed step: a token for every slot marked in ``active`` (decoding, bool per leading slot)
        and the prefill ``chunks`` (at most ``step_seqs``), in one forward.

        Returns the state, the decode rows' result (one row per leading slot covered; None if none
        decodes) and, per final chunk (by index in ``chunks``), the first token sampled after it; that
        sequence is seated in its slot and decodes from the next step on.
        """
        state, logits = self.step_logits(state, table, active, chunks)
        return self.step_sample(state, logits, active, chunks)

    def step_logits(
        self,
        state: PagedState,
        table: jax.Array | np.ndarray,
        active: np.ndarray,
        chunks: Sequence[ChunkWork] = (),
    ) -> tuple[PagedState, tuple[jax.Array, jax.Array | None]]:
        """The first half of `step`: dispatch the forward; returns the state and (decode logits, chunk
        logits or None) for `step_sample`. A structured step fills its masks in between."""
        num_rows = int(np.flatnonzero(active)[-1]) + 1 if np.any(active) else 0
        rows, tokens = self.step_shape(num_rows, sum(len(c.tokens) for c in chunks))
        mask = np.zeros(rows, np.int32)
        mask[:num_rows] = active[:num_rows]
        self._slot_adapter[[c.slot for c in chunks]] = [c.adapter for c in chunks]  # LoRA, by slot
        meta = pack_meta(self._layout(rows, tokens), chunks, mask, self._slot_adapter)
        fn = self._mixed[(rows, tokens)]
        pages, dec_logits, pf_logits = fn(
            self.params, state.pages, state.tokens, state.positions, table, meta
        )
        return state._replace(pages=pages), (dec_logits, pf_logits)

    def step_sample(
        self,
        state: PagedState,
        logits: tuple[jax.Array, jax.Array | None],
        active: np.ndarray,
        chunks: Sequence[ChunkWork] = (),
        token_mask: np.ndarray | None = None,
    ) -> tuple[PagedState, SampleResult | None, list[tuple[int, SampleResult]]]:
        """The second half of `step` (same ``active`` and ``chunks``): the decode rows' tokens, under
        ``token_mask`` (i32[>= rows, ceil(V/32)] host array, unconstrained rows all ones) when given, and
        each final chunk's first token, under its ``ChunkWork.token_mask`` when set (structured output:
        the masked programs of paged/structured_output.py, on the state without its pages)."""
        (dec_logits, pf_logits), out = logits, None
        if np.any(active):
            rows = dec_logits.shape[0]
            if token_mask is None:
                state, out = self._sample[rows](state, dec_logits)
            else:
                # a copy: jit reads a numpy argument in place, after dispatch (the driver refills its mask)
                mask = np.array(token_mask[:rows], np.int32)
                samplers, out = self._sample_masked[rows](sampler_rows(state), dec_logits, mask)
                state = with_rows(state, samplers)
        firsts = []
        for k, c in enumerate(chunks):
            if c.final:
                where = (
                    pf_logits,
                    np.int32(k),
                    np.int32(c.slot),
                    np.int32(c.start + len(c.tokens)),
                    c.inputs,
                )
                if c.token_mask is None:
                    state, first = self._seat_chunk(state, *where)
                else:
                    mask = np.asarray(c.token_mask, np.int32).reshape(1, -1)
                    samplers, first = self._seat_masked(sampler_rows(state), *where, mask)
                    state = with_rows(state, samplers)
                firsts.append((k, first))
        return state, out, firsts

    def run_mixed(
        self,
        state: PagedState,
        table: jax.Array | np.ndarray,
        active: np.ndarray,
        chunks: Sequence[ChunkWork] = (),
    ) -> tuple[PagedState, SampleResult | None, jax.Array | None]:
        """`step` without seating (the seed layer's prefill): the forward and the decode rows' sampler.
        Returns the state, the decode rows' result (None if none decodes) and the logits at each chunk's
        last token ([step_seqs, V]; None without chunks)."""
        state, (dec_logits, pf_logits) = self.step_logits(state, table, active, chunks)
        out = None
        if np.any(active):
            state, out = self._sample[dec_logits.shape[0]](state, dec_logits)
        return state, out, pf_logits

    # ------------------------------------------------------------------ warm-up
    def compile(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile every program a live request can hit; returns seconds.

        As in vEngine: the programs are lowered and compiled in parallel threads, then each runs once on
        the real state (page tables all scratch, so nothing real is written). That state is kept for the
        driver, so the cache is never allocated twice. If the TPU kernel's programs fail to lower or
        compile, the engine falls back to the pure-JAX path, logged with the reason (kernel_fallback.py).
        """
        return compile_with_fallback(self, partial(self._compile, progress))  # kernel_fallback.py

    def _compile(self, progress: Callable[[str], None] | None) -> float:
        say = progress or log.info
        t0 = time.perf_counter()
        state = self.init_decode_state()
        inputs = self.seq_inputs(
            SamplingParams(temperature=0.0, max_tokens=1), [], np.zeros(2, np.uint32), [0]
        )
        row = np.zeros(self.table_width, np.int32)
        rep = self._replicated()
        # committed to the device like the driver's table: jit keys on that, and a miss is a compile
        table = jax.device_put(np.zeros((self.max_concurrent_decodes, self.table_width), np.int32), rep)
        zero, legacy = np.int32(0), self.legacy_programs
        logits = jax.device_put(jnp.zeros((self.model_config.vocab_size,), jnp.float32), rep)
        jobs = program_jobs(
            self, state, inputs, table, lambda shape, dt: jax.device_put(jnp.zeros(shape, dt), rep)
        )
        metas = step_metas(self)

        compile_jobs(jobs, say)
        for t, n in self.prefill_shapes() if legacy else []:  # warm every program on the real state
            pages, logits = self._prefill[n](
                self.params, state.pages, np.ones(t, np.int32), zero, np.int32(t), row
            )
            state = state._replace(pages=pages)
        state, first = self._seat(state, logits, zero, np.int32(1), inputs)
        for (r, _n), fn in self._forward.items() if legacy else []:
            pages, logits = fn(self.params, state.pages, state.tokens, state.positions, table)
            state, out = self._sample[r](state._replace(pages=pages), logits)
        specs = StructuredSpecs()  # what warm_structured compiles for, if it is ever called
        for (r, p), fn in self._mixed.items():  # page rows all scratch: nothing real is written
            pages, dec_logits, pf_logits = fn(
                self.params, state.pages, state.tokens, state.positions, table, metas[(r, p)]
            )
            specs.saw(dec_logits if r else None, pf_logits if p else None)
            state = state._replace(pages=pages)
            if r:
                state, out = self._sample[r](state, dec_logits)
            if p:
                state, first = self._seat_chunk(state, pf_logits, zero, zero, zero, inputs)
        jax.block_until_ready((first, out))
        specs.state(state)
        self._structured_specs = specs
        self.warm_chunked()
        self._spare = state
        self.compiled = True
        say(f"compiled {len(jobs)} programs in {time.perf_counter() - t0:.1f}s")
        return time.perf_counter() - t0

    def warm_structured(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile what structured output adds, on a throwaway state without pages; the driver calls it on
        a background thread when the first constrained request arrives (paged/structured_output.py)."""
        return warm_structured(self, progress)
