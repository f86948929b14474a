"""DenseEngine (the core of vEngine): one dense KV row per decode slot.

State lives on the device and is donated to every jitted step, so the cache is updated in place.
Prefill is padded to `prefill_lengths` buckets; decode covers the leading slots up to the highest live
one (a few static row buckets) and reads each row's cache in chunks up to the longest live sequence (a
trip count on the device, so no length buckets). Every shape is compiled in `compile()`; a live request
only ever hits compiled programs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import numpy as np

from ...contracts.engine_config import EngineConfig
from ...contracts.sampling_params import SamplingParams
from ..aot_program import program
from ..chunked_prefill import ChunkedPrefill
from ..engine_base import EngineBase, resolve_token_budget
from ..sampling import (
    DEFAULT_MAX_STOP_IDS,
    SampleResult,
    SlotSampling,
    make_slot_sampling,
)
from ..sampling.state import prompt_mask_words
from .bf16_weights import bf16_kernels, decode_weights
from .decode_block import DecodeBlocks
from .layered_prefill import LayeredPrefill
from .mixed_step import DenseMixedStep
from .prefill_rows import first_fit, row_counts, rows_needed
from .programs import (  # GenerationState, Prefix, resolve_decode_steps: read from here as always
    GenerationState,
    Prefix,
    _decode_impl,
    _first_impl,
    _firsts_impl,
    _forward_impl,
    _insert_impl,
    _long_prefix_impl,
    resolve_decode_steps,
)
from .slot_moves import move_args, move_rows_program
from .spec_verify import SpeculativeVerifier, VerifyStep
from .state import DenseCache
from .warmup import compile_engine, warm_structured

log = logging.getLogger(__name__)


class DenseEngine(DenseCache, EngineBase):
    """Dense-cache engine: prefill, insert into a slot, decode all slots, free a slot. The public vEngine
    (vsurge/seed_api/engines.py) is this with the seed's constructor and steps."""

    def __init__(self, model: Any, processor: Any, config: EngineConfig):
        # smallest_rows=1: one live row: XLA:CPU's matrix-vector path is ~25% faster than 4 rows
        self._setup(model, processor, config, smallest_rows=1)
        num_top_logprobs = self.num_top_logprobs
        self._state_shardings = self._make_state_shardings()
        tp = self.mesh.shape["tp"] if self.mesh is not None else 1
        if self.model_config.num_kv_heads % tp:
            # correct but costly: every tp device holds the whole dense cache; said, never silent
            log.warning(
                "the model's %d kv heads do not split over tp=%d: the dense KV cache is replicated on "
                "every device of the tp axis (use a tp that divides %d, or the paged driver, which refuses)",
                self.model_config.num_kv_heads,
                tp,
                self.model_config.num_kv_heads,
            )
        self._pos = np.zeros(self.max_concurrent_decodes, np.int64)  # host mirror, picks the decode bucket
        self._active = np.zeros(self.max_concurrent_decodes, bool)

        logits_sharding = self.logits_sharding
        self.dispatch_lock = threading.Lock()  # see LayeredPrefill
        self._prefill = LayeredPrefill(self)  # one program per part of the model (layered_prefill.py)
        self._bf16 = bf16_kernels(self.params, self.model.dtype, config.prefill_dtype, config.decode_dtype)
        self.prefill_params = self._bf16 if self._wants_bf16("prefill_dtype") else self.params
        # per row bucket: the weights its decode (and verify) step runs on (decode_dtype)
        self._step_params = {
            rows: decode_weights(self.params, self._bf16, config.decode_dtype, rows)
            for rows in self.decode_rows
        }
        self._first = program(
            partial(_first_impl, self.graphdef, num_top=num_top_logprobs, logits_sharding=logits_sharding)
        )
        self._firsts = program(
            partial(_firsts_impl, self.graphdef, num_top=num_top_logprobs, logits_sharding=logits_sharding)
        )
        self._insert = program(partial(_insert_impl, shardings=self._state_shardings), donate_argnums=(1,))
        # packs stay small: on XLA:CPU prefill costs least per token at 128-256 tokens, and a small pack
        # reaches the decode batch sooner (measured: 128 beats 64 and 512 by 3-8% at 32 concurrent)
        self.prefill_pack_tokens = min(config.prefill_pack_tokens, self.max_prefill_length)
        # rows of prefill_pack_tokens a call may hold when prompts queue up (prefill_rows.py); each row
        # holds a prompt at least, and prompts beyond the slots wait for one anyway
        most = min(self.max_concurrent_prefill, self.max_concurrent_decodes)
        self.pack_rows = [r for r in row_counts(config.prefill_pack_rows) if r <= most]
        self._decode = {
            rows: program(
                partial(
                    _decode_impl,
                    self.graphdef,
                    rows=rows,
                    logits_sharding=logits_sharding,
                    num_top=num_top_logprobs,
                    shardings=self._state_shardings,
                ),
                donate_argnums=(1,),
            )
            for rows in self.decode_rows
        }
        # K decode steps per program (decode_block.py): the host's work per token shrinks K-fold
        # (speculation reads every step's tokens on the host: its steps stay single)
        self.decode_steps = 1 if config.speculative != "none" else resolve_decode_steps(config.decode_steps)
        self.blocks = (
            DecodeBlocks(
                self,
                self.decode_steps,
                _decode_impl,
                logits_sharding=logits_sharding,
                num_top=num_top_logprobs,
                shardings=self._state_shardings,
            )
            if self.decode_steps > 1
            else None
        )
        # structured output's split step: the model, then the sampler with the token mask (per row count)
        self._forward = {
            rows: program(
                partial(_forward_impl, self.graphdef, rows=rows, logits_sharding=logits_sharding),
                donate_argnums=(1,),
            )
            for rows in self.decode_rows
        }
        self._sample_masked = self._samplers(self._state_shardings)
        # live slots moved down into free ones so decode covers fewer rows (slot_moves.py)
        self._move = move_rows_program(self._state_shardings)
        self._specs: Any = None  # (state, prefix) shapes, from compile()
        self.structured_ready = threading.Event()  # warm_structured has run
        self._zeros = None
        self.chunked = self._make_chunked(self.prefill_params)
        self._long_prefix = program(
            partial(
                _long_prefix_impl, entries=self.max_concurrent_prefill, vocab=self.model_config.vocab_size
            )
        )
        # n-gram speculative decoding: the verify step per row bucket (spec_verify.py)
        self.speculator = (
            SpeculativeVerifier(self, config.num_speculative_tokens)
            if config.speculative == "ngram"
            else None
        )
        # max_num_batched_tokens set: prompts are prefilled in place, chunk by chunk, inside the decode
        # steps (dense/mixed_step.py) instead of on the driver's prefill thread
        budget = config.max_num_batched_tokens
        self.mixed = (
            None
            if budget is None
            else DenseMixedStep(self, resolve_token_budget(budget, self.max_concurrent_decodes))
        )
        self.compiled = False
        self.executable_store = None  # compile()'s, where one is on (models/compiled/executable_store.py)

    # ------------------------------------------------------------------ state
    def _wants_bf16(self, knob: str) -> bool:
        return getattr(self.engine_config, knob) == "bfloat16" and self._bf16 is not None

    def step_params(self, rows: int) -> Any:
        """The weights of the decode / verify / forward step of bucket ``rows``."""
        return self._step_params[rows]

    # ------------------------------------------------------------------ steps
    @property
    def max_prompt_length(self) -> int:
        """Longest prompt: the context less one generated token (longer than a bucket: chunked)."""
        return self.max_length - 1

    @property
    def prefill_waited(self) -> float:
        """Seconds the prefill chains have waited for the device so far: on XLA:CPU a chain keeps only a
        few programs queued (dispatch_window.py), so a prefill call returns once most of it has run."""
        return self._prefill.window.waited + self.chunked.window.waited

    def check_prompt(self, tokens: Sequence[int]) -> int:
        """The prompt's length if this engine can prefill it, else ValueError with the reason."""
        if len(tokens) < 1:
            raise ValueError("empty prompt")
        if len(tokens) > self.max_prompt_length:
            raise ValueError(f"prompt of {len(tokens)} tokens leaves no room in max_length {self.max_length}")
        return len(tokens)

    def needs_chunks(self, tokens: Sequence[int], params: SamplingParams) -> bool:
        """True when a prompt must be prefilled alone, chunk by chunk (prefill_chunked): too long for a
        bucket, or its prompt logprobs are wanted."""
        return len(tokens) > self.max_prefill_length or params.prompt_logprobs is not None

    def prefill(
        self, tokens: Sequence[int], params: SamplingParams | None = None, stop_ids: Sequence[int] = ()
    ) -> Prefix:
        """Prefill one prompt (entry 0 of the returned Prefix)."""
        params = params or SamplingParams()
        if len(tokens) > self.max_prefill_length:
            return self.prefill_chunked(tokens, params, stop_ids)[0]
        return self.prefill_many([tokens], [params], [stop_ids])

    def prefill_chunked(
        self, tokens: Sequence[int], params: SamplingParams, stop_ids: Sequence[int] = (), adapter: int = -1
    ) -> tuple[Prefix, list[Any] | None]:
        """Prefill one prompt of any length up to max_prompt_length chunk by chunk; returns the Prefix
        (entry 0) and, when params.prompt_logprobs is set, the prompt's logprobs (see ChunkedPrefill).
        ``adapter``: its LoRA bank slot (-1: the base model)."""
        n = self.check_prompt(tokens)
        want = params.prompt_logprobs is not None
        rows, last, parts = self.chunked.run(tokens, want, adapter)
        k = self.max_concurrent_prefill
        words = prompt_mask_words([tokens], k, self.model_config.vocab_size)
        stops = [list(stop_ids)[:DEFAULT_MAX_STOP_IDS]] + [[]] * (k - 1)
        sampling = make_slot_sampling([params] + [None] * (k - 1), stop_ids=stops, adapters=[adapter])
        prefix = self._long_prefix(rows, last, words, np.int32(n), sampling)
        lps = ChunkedPrefill.prompt_logprobs(tokens, parts, params.prompt_logprobs) if want else None
        return prefix, lps

    def prefill_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        stop_ids: Sequence[Sequence[int]] | None = None,
        adapters: Sequence[int] | None = None,
    ) -> Prefix:
        """Prefill up to `max_concurrent_prefill` prompts in one call, packed one after another into the
        smallest bucket that holds them all (no padding per prompt). Dispatched asynchronously (on XLA:CPU
        it returns with the last two of its programs queued: dispatch_window.py).
        ``adapters``: each prompt's LoRA bank slot (default: none, the base model)."""
        return self._prefill(self.prefill_params, *self._pack(prompts, params, stop_ids, adapters))

    def pack_rows_for(self, lengths: Sequence[int], max_rows: int | None = None) -> int | None:
        """The rows of the call that prefills prompts of these lengths together: 1 (one row, the bucket
        that holds them all), a compiled multi-row count (at most max_rows; default the largest), or None
        when they do not fit one call. Prompts beyond prefill_pack_tokens in all go into rows of that
        length when each fits one."""
        total = sum(lengths)
        rows = [r for r in self.pack_rows if max_rows is None or r <= max_rows]
        if len(lengths) > 1 and total > self.prefill_pack_tokens and rows:
            need = rows_needed(lengths, self.prefill_pack_tokens)
            if need is not None and need <= rows[-1]:
                return next(r for r in rows if r >= need)
        return 1 if total <= self.max_prefill_length else None

    def _pack(self, prompts, params, stop_ids, adapters=None) -> tuple:
        k = self.max_concurrent_prefill
        if not 1 <= len(prompts) <= k or len(params) != len(prompts):
            raise ValueError(f"prefill_many takes 1..{k} prompts with one SamplingParams each")
        lengths = [self.check_prompt(p) for p in prompts]
        rows = self.pack_rows_for(lengths)
        if rows == 1 or rows is None:
            # a prompt longer than every bucket goes to prefill_chunked; bucket_for says so
            width, where = self.bucket_for(sum(lengths)), [0] * len(prompts)
        else:
            width, where = self.prefill_pack_tokens, first_fit(lengths, self.prefill_pack_tokens)
        rows = rows or 1
        tokens = np.full((rows, width), self.pad_token_id, np.int32)
        positions = np.zeros((rows, width), np.int32)
        segments = np.full((rows, width), k, np.int32)
        totals = np.zeros(rows, np.int32)
        starts = np.zeros(k, np.int32)
        lens = np.zeros(k, np.int32)
        for j, (p, n, r) in enumerate(zip(prompts, lengths, where, strict=True)):
            at = int(totals[r])
            tokens[r, at : at + n] = p
            positions[r, at : at + n] = np.arange(n)
            segments[r, at : at + n] = j
            starts[j], lens[j] = r * width + at, n
            totals[r] += n
        stops = [list(s)[:DEFAULT_MAX_STOP_IDS] for s in (stop_ids or [()] * len(prompts))]
        pad = k - len(prompts)
        sampling = make_slot_sampling(
            list(params) + [None] * pad, stop_ids=stops + [[]] * pad, adapters=adapters
        )
        words = prompt_mask_words(prompts, k, self.model_config.vocab_size)
        return tokens, positions, segments, totals, starts, lens, words, sampling

    def insert(
        self,
        prefix: Prefix,
        decode_state: GenerationState,
        slot: int,
        key: np.ndarray | None = None,
        index: int = 0,
        length: int | None = None,
        token_mask: np.ndarray | None = None,
        first: SampleResult | None = None,
    ):
        """Put entry `index` of a prefix into `slot`; returns (state, first token SampleResult[1]).
        key: u32[2] per sample (default: the entry's own); length: the prompt's length when the caller
        knows it (saves a read from the device); token_mask: i32[1, ceil(V/32)] of a structured request;
        first: what `sample_first` returned for this entry and key (sampled before a slot was free)."""
        j = np.int32(index)
        key = self._host_key(prefix, key, index)
        if first is None:
            first = self.sample_first(prefix, key, index, token_mask)
        # a host scalar either way (the early tokens are on the host): one jit signature
        token = np.asarray(first.tokens, np.int32)[0]
        state = self._insert(prefix, decode_state, j, np.int32(slot), key, token)
        self._pos[slot] = int(prefix.lengths[index]) if length is None else length
        self._active[slot] = True
        return state, first

    def bulk_insert(
        self,
        prefix: Prefix,
        decode_state: GenerationState,
        slots: Sequence[int],
        keys=None,
        index: int = 0,
        length: int | None = None,
        token_masks: Sequence[np.ndarray | None] | None = None,
        firsts: Sequence[SampleResult] | None = None,
    ):
        """Insert entry `index` of a prefix into several slots (n samples sharing one prefill)."""
        out = []
        for i, slot in enumerate(slots):
            key = None if keys is None else keys[i]
            mask = None if token_masks is None else token_masks[i]
            first = None if firsts is None else firsts[i]
            decode_state, first = self.insert(prefix, decode_state, slot, key, index, length, mask, first)
            out.append(first)
        return decode_state, out

    def sample_first(
        self,
        prefix: Prefix,
        key: np.ndarray | None = None,
        index: int = 0,
        token_mask: np.ndarray | None = None,
    ) -> SampleResult:
        """The first token of entry `index` (SampleResult[1]), without a slot: the same token `insert`
        would sample with this key, so a driver can stream it while the request still waits for a slot."""
        key = self._host_key(prefix, key, index)
        masked = () if token_mask is None else (np.asarray(token_mask, np.int32).reshape(1, -1),)
        return self._first(
            self.params, prefix.hidden, prefix.sampling, prefix.prompt_mask, np.int32(index), key, *masked
        )

    def sample_firsts(self, prefix: Prefix, entries: Sequence[int], keys: np.ndarray) -> SampleResult:
        """First tokens of up to max_concurrent_prefill samples of one prefix in one program call: entry
        ``entries[i]`` with key ``keys[i]`` (u32[n, 2]) is row i of the result (M rows; those past n
        repeat row 0). One call reads the embedding once for the logits of all of them, where a call per
        sample (`sample_first`) reads it per sample. The rows sample as `sample_first` does; the logits
        come from one matmul of M rows, so they may differ from it in the last bits."""
        m, n = self.max_concurrent_prefill, len(entries)
        if not 1 <= n <= m or len(keys) != n:
            raise ValueError(f"sample_firsts takes 1..{m} entries with one key each")
        js = np.full(m, entries[0], np.int32)
        js[:n] = entries
        ks = np.repeat(np.asarray(keys[:1], np.uint32), m, axis=0)
        ks[:n] = keys
        return self._firsts(self.params, prefix.hidden, prefix.sampling, prefix.prompt_mask, js, ks)

    def make_sampling_row(
        self, params: SamplingParams | None, stop_ids: Sequence[int], adapter: int = -1
    ) -> SlotSampling:
        """One request's sampler row (host arrays), as a prefill builds it: for `DenseMixedStep.seat`."""
        stops = [list(stop_ids)[:DEFAULT_MAX_STOP_IDS]]
        return make_slot_sampling([params], stop_ids=stops, adapters=[adapter])

    def entry_keys(self, prefix: Prefix) -> np.ndarray:
        """u32[K, 2]: each entry's own sampling key, on the host."""
        return np.asarray(prefix.sampling.key, np.uint32)

    @staticmethod
    def _host_key(prefix: Prefix, key: np.ndarray | None, index: int) -> np.ndarray:
        # always a host array: a device array here is another jit signature, i.e. a compile on a live request
        return np.asarray(prefix.sampling.key[index] if key is None else key, np.uint32)

    def decode_bucket(self) -> int:
        """The row bucket the next step runs: the smallest compiled one covering the highest live slot."""
        live = np.flatnonzero(self._active)
        return self.rows_for(int(live[-1]) + 1 if live.size else 1)

    def rows_for(self, rows: int) -> int:
        """The smallest compiled row bucket that holds ``rows`` leading slots."""
        return next((r for r in self.decode_rows if r >= rows), self.max_concurrent_decodes)

    def read_lengths(self, rows: int, ahead: int = 1) -> np.ndarray:
        """i32[rows]: how many cache positions each of the first `rows` slots reads in the next step (its
        length + `ahead` new tokens; 0 for a free slot, which the step then does not read)."""
        return np.where(self._active[:rows], self._pos[:rows] + ahead, 0).astype(np.int32)

    def decode(self, decode_state: GenerationState) -> tuple[GenerationState, SampleResult]:
        """One token for every live slot. Runs the smallest compiled row bucket that covers the highest
        live slot, each row reading its own length of the cache; results have one row per decoded slot."""
        live = np.flatnonzero(self._active)
        rows = self.decode_bucket()
        lengths = self.read_lengths(rows)
        with self.dispatch_lock:
            state, out = self._decode[rows](self._step_params[rows], decode_state, lengths)
        self._pos[live] += 1
        return state, out

    def decode_block(self, decode_state: GenerationState) -> tuple[GenerationState, VerifyStep]:
        """``decode_steps`` tokens for every live slot in one program (decode_block.py): a VerifyStep whose
        rows hold each slot's K tokens, all accepted."""
        if self.blocks is None:
            raise RuntimeError("this engine decodes one step per program (decode_steps=1)")
        live = np.flatnonzero(self._active)
        rows = self.decode_bucket()
        lengths = self.read_lengths(rows)
        with self.dispatch_lock:
            state, out = self.blocks.programs[rows](self._step_params[rows], decode_state, lengths)
        self._pos[live] += self.decode_steps
        return state, out

    def verify(
        self, decode_state: GenerationState, draft: np.ndarray, num_draft: np.ndarray
    ) -> tuple[GenerationState, VerifyStep]:
        """A speculative step (``speculative="ngram"``): every live slot scores its last token and its
        draft (draft i32[S, K], num_draft i32[S]; 0 for rows without one) and advances by 1..K+1 tokens.
        Blocks until the accepted counts are known."""
        if self.speculator is None:
            raise RuntimeError("this engine was built without speculative decoding")
        return self.speculator.step(decode_state, draft, num_draft)

    def decode_logits(self, decode_state: GenerationState) -> tuple[GenerationState, jax.Array]:
        """The first half of a structured step: dispatch the model over the live rows, as `decode` would,
        and return the logits (rows of the bucket) for `decode_sample`."""
        live = np.flatnonzero(self._active)
        rows = self.decode_bucket()
        lengths = self.read_lengths(rows)
        with self.dispatch_lock:
            state, logits = self._forward[rows](self._step_params[rows], decode_state, lengths)
        self._pos[live] += 1
        return state, logits

    def decode_sample(
        self, decode_state: GenerationState, logits: jax.Array, token_mask: np.ndarray
    ) -> tuple[GenerationState, SampleResult]:
        """The second half: sample the rows of `decode_logits` under the packed token mask
        (i32[>= rows, ceil(V/32)] host array; unconstrained rows all ones)."""
        rows = logits.shape[0]
        # a copy: jit reads a numpy argument in place, after dispatch, and the driver resets the row of a
        # slot it frees right after this call (its last token was then sampled without its mask)
        return self._sample_masked[rows](decode_state, logits, np.array(token_mask[:rows], np.int32))

    def move_slots(self, state: GenerationState, moves: Sequence[tuple[int, int]]) -> GenerationState:
        """Move each live slot ``a`` of ``moves`` [(a, b)] into the free slot ``b`` (its whole state row);
        ``a`` is free afterwards. The driver plans them (`slot_moves.plan_moves`)."""
        if not moves:
            return state
        state = self._move(state, *move_args(moves, self.max_concurrent_decodes))
        for a, b in moves:
            self._pos[b], self._active[b] = self._pos[a], self._active[a]
            self.free_resource(a)
        return state

    def free_resource(self, slot: int) -> bool:
        """Release a slot: it stops counting toward the decode bucket. Its row is overwritten on insert."""
        was = bool(self._active[slot])
        self._active[slot] = False
        self._pos[slot] = 0
        return was

    # ------------------------------------------------------------------ warm-up (dense/warmup.py)
    def compile(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile every program a live request can hit, and run each once on the real state; returns
        seconds (dense/warmup.compile_engine)."""
        return compile_engine(self, progress)

    def warm_structured(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile what structured output adds, on a throwaway state; the driver calls it on a background
        thread when the first constrained request arrives (dense/warmup.warm_structured)."""
        return warm_structured(self, progress)
