"""What vEngine and oEngine share: length planning, the per-row-count sampler step, and the seed API's
tokenizer-facing properties. The engines differ only in their cache and the programs that touch it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..contracts.engine_config import MAX_LENGTH_CAP, EngineConfig, driver_default
from ..models.compiled.cache_reads import serialize_cache_reads
from ..models.compiled.cache_writes import skipping_jax_cache_writes
from ..models.compiled.executable_store import release_prefetched
from ..models.lora import attach_bank, detach_bank
from ..models.sharding import place_params
from ..models.target import target_backend
from .aot_program import AotProgram, program
from .chunked_prefill import ChunkedPrefill
from .lora_bank import LoraBank
from .sampling import SlotSampling, sample, set_slot, sharded_sampling


def plan_lengths(
    cfg: Any,
    max_length: int | None,
    prefill_lengths: Sequence[int] | None,
    max_prefill_length: int | None,
    *,
    default_max_prefill: int,
) -> tuple[int, int, list[int]]:
    """(max_length, max_prefill_length, prefill buckets) from the engine arguments."""
    max_len = int(max_length or min(cfg.max_position_embeddings, MAX_LENGTH_CAP))
    lengths = sorted(set(int(x) for x in prefill_lengths)) if prefill_lengths else None
    max_prefill = int(max_prefill_length or (lengths[-1] if lengths else min(default_max_prefill, max_len)))
    if max_prefill > max_len:
        raise ValueError(f"max_prefill_length {max_prefill} exceeds max_length {max_len}")
    buckets = [n for n in (lengths or default_prefill_lengths(max_prefill)) if n <= max_prefill]
    if not buckets or buckets[-1] != max_prefill:
        buckets.append(max_prefill)
    return max_len, max_prefill, buckets


def _doubling(smallest: int, largest: int) -> list[int]:
    out, n = [], min(smallest, largest)
    while n < largest:
        out.append(n)
        n *= 2
    return out + [largest]


def default_prefill_lengths(max_prefill_length: int, backend: str | None = None) -> list[int]:
    """Powers of two up to the largest bucket from 128 on TPU (a short prompt costs about the same in a
    128 bucket there, and each bucket is a program to compile at start). On CPU, where prefill costs by
    the token, from 32, with 1.5x steps between the powers from 128 on (192, 384, 768, ...): prompts of
    32-512 tokens pad 17% on average instead of 33% (serve's defaults under random-24 on 2 cores: 76.2
    -> 87.3 output tok/s, one sitting)."""
    if (backend or target_backend()) == "tpu":
        return _doubling(128, max_prefill_length)
    powers = _doubling(32, max_prefill_length)
    between = [n * 3 // 2 for n in powers if n >= 128 and n * 3 // 2 < max_prefill_length]
    return sorted(set(powers + between))


def decode_buckets(max_length: int, smallest: int = 128) -> list[int]:
    """Cache lengths a paged decode step may read: powers of two from `smallest` up to max_length."""
    return _doubling(smallest, max_length)


def row_buckets(slots: int, smallest: int = 4, backend: str | None = None) -> list[int]:
    """How many leading slots a decode step covers: powers of two up to `slots`; on TPU powers of four
    from 8, since a step's weight reads cost the same for 8 rows or 64 there, and each bucket is a
    program to compile at start (rows still matter when few long rows are live: the KV a step reads)."""
    if (backend or target_backend()) == "tpu":
        out, n = [], min(8, slots)
        while n < slots:
            out.append(n)
            n *= 4
        return out + [slots]
    return _doubling(smallest, slots)


def sampling_context(shardings: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if shardings is None else sharded_sampling()


def constrain(state: Any, shardings: Any) -> Any:
    return state if shardings is None else jax.lax.with_sharding_constraint(state, shardings)


def sample_first_token(model, hidden, row, prompt_mask, *, num_top: int, logits_sharding, token_mask=None):
    """A prompt's first token from its last hidden state [1, hidden]: row is its one-row SlotSampling,
    prompt_mask bool[1, V]; ``token_mask`` (i32[1, ceil(V/32)]) a structured request's first allowed tokens."""
    logits = model.compute_logits(hidden)
    if logits_sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    with sharded_sampling() if logits_sharding is not None else contextlib.nullcontext():
        return sample(
            logits, row, None, prompt_mask, jnp.zeros((1,), jnp.int32), num_top, token_mask=token_mask
        )


def start_slot(state: Any, slot, first_token, length, row: SlotSampling) -> Any:
    """A dense slot starts decoding its prompt: the first token, its position, the step counter, the
    penalty counts and its sampler row (the KV and the prompt mask are the caller's)."""
    return state._replace(
        tokens=state.tokens.at[slot].set(first_token),
        positions=state.positions.at[slot].set(length),
        steps=state.steps.at[slot].set(1),
        counts=state.counts.at[slot].set(0).at[slot, first_token].add(1),
        sampling=set_slot(state.sampling, slot, row),
    )


def sample_step(
    state: Any,
    logits: jax.Array,
    token_mask: jax.Array | None = None,
    *,
    rows: int,
    num_top: int,
    shardings: Any,
):
    """Sample the first `rows` slots and advance them (tokens, positions, steps, penalty counts).

    ``token_mask`` (i32[rows, ceil(V/32)], structured output) is the packed mask of the allowed next tokens;
    None traces the step without it.

    `state` is either engine's decode state: both carry tokens, positions, steps, counts, prompt_mask and
    sampling with one row per slot. Separate from the model forward, so it compiles once per row count.
    """
    sampling = SlotSampling(*(a[:rows] for a in state.sampling))
    with sampling_context(shardings):
        out = sample(
            logits,
            sampling,
            state.counts[:rows],
            state.prompt_mask[:rows],
            state.steps[:rows],
            num_top,
            token_mask=token_mask,
        )
    new = state._replace(
        tokens=state.tokens.at[:rows].set(out.tokens),
        positions=state.positions.at[:rows].add(1),
        steps=state.steps.at[:rows].add(1),
        counts=state.counts.at[jnp.arange(rows), out.tokens].add(1),
    )
    return constrain(new, shardings), out


class EngineBase:
    """Model, parameters (placed on the mesh), limits, and the seed API's tokenizer-facing properties."""

    def _setup(self, model: Any, processor: Any, config: EngineConfig, *, smallest_rows: int = 4) -> None:
        """Model, parameters and limits from ``config`` (its driver's defaults fill the knobs left None)."""
        mesh = config.mesh
        if isinstance(mesh, str):
            from ..models.sharding import make_mesh

            mesh = make_mesh(mesh)
        self.engine_config = config.replace(mesh=mesh)
        self.model = model
        self.model_config = model.config
        self._processor = processor
        self.mesh = mesh
        self.max_concurrent_decodes = config.max_concurrent_decodes
        self.max_concurrent_prefill = config.resolved("max_concurrent_prefill")
        self.max_length, self.max_prefill_length, self.prefill_lengths = plan_lengths(
            model.config,
            config.max_length,
            config.prefill_lengths,
            config.max_prefill_length,
            default_max_prefill=driver_default("max_prefill_length", config.driver),
        )
        self.num_top_logprobs = config.num_top_logprobs
        # the LoRA bank is part of the model's state when asked for, and absent otherwise (models/lora.py)
        if config.enable_lora:
            attach_bank(model, config.max_loras, config.max_lora_rank)
        else:
            detach_bank(model)  # a model an earlier engine gave a bank
        self.graphdef, params = nnx.split(model)
        self.params = place_params(params, self.model_config, mesh) if mesh is not None else params
        self.decode_rows = row_buckets(self.max_concurrent_decodes, smallest_rows)
        self.logits_sharding = NamedSharding(mesh, P()) if mesh is not None else None

    @property
    def lora_bank(self) -> LoraBank | None:
        """This engine's LoRA bank (built on first use, once the engine's weight trees exist), None
        without one (enable_lora off). A multi-host leader reaches it down the step lane by path."""
        if not self.engine_config.enable_lora:
            return None
        bank = self.__dict__.get("_lora_bank")
        if bank is None:
            bank = self._lora_bank = LoraBank([self])
        return bank

    def lora_trees(self) -> list[Any]:
        """The weight trees this engine hands its programs that hold the LoRA bank (lora_bank.py writes
        into each): the model's, and a bfloat16 copy where there is one."""
        bf16 = getattr(self, "_bf16", None)
        return [self.params] + ([bf16] if bf16 is not None else [])

    def _make_chunked(self, params: Any = None) -> ChunkedPrefill:
        """The chunked prefill, on ``params`` (default: the model's weights)."""
        return ChunkedPrefill(
            self.graphdef,
            self.params if params is None else params,
            self.model_config,
            self.prefill_lengths,
            self.max_prefill_length,
            self.max_length,
            self.pad_token_id,
            self.model.dtype,
        )

    def score_prompt(self, tokens: Sequence[int], k: int, adapter: int = -1) -> list[Any]:
        """The prompt's logprobs (None, then each token's given the ones before it, with the top k), under
        LoRA bank slot ``adapter`` (-1: the base model)."""
        _, _, parts = self.chunked.run(tokens, True, adapter)
        return ChunkedPrefill.prompt_logprobs(tokens, parts, k)

    def warm_chunked(self) -> None:
        """Run every chunk program once (compile() of either engine)."""
        scored = [1] * min(self.max_prefill_length, self.max_length - 1)
        for n in self.chunked.buckets:
            self.score_prompt(scored[:n], 0)

    def _samplers(self, shardings: Any) -> dict[int, Any]:
        """The sampler step per row count, the decode state donated."""
        return {
            rows: program(
                partial(sample_step, rows=rows, num_top=self.num_top_logprobs, shardings=shardings),
                donate_argnums=(0,),
            )
            for rows in self.decode_rows
        }

    @property
    def processor(self) -> Any:
        return self._processor

    @property
    def model_name(self) -> str:
        return self.model_config.model_type

    @property
    def eos_token_ids(self) -> list[int]:
        ids = set(self.model_config.eos_token_ids)
        tok = self._processor
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        return sorted(ids)

    @property
    def pad_token_id(self) -> int:
        tok = self._processor
        for v in (getattr(tok, "pad_token_id", None), self.model_config.pad_token_id):
            if v is not None:
                return int(v)
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    @property
    def colocated_cpus(self) -> list[jax.Device] | None:
        return None

    def bucket_for(self, length: int) -> int:
        for n in self.prefill_lengths:
            if length <= n:
                return n
        raise ValueError(f"prompt of {length} tokens exceeds max_prefill_length {self.max_prefill_length}")

    def _replicated(self):
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(self._device())
        return NamedSharding(self.mesh, P())

    def _device(self) -> jax.Device:
        leaf = jax.tree_util.tree_leaves(self.params)[0]
        if isinstance(leaf, jax.ShapeDtypeStruct):  # abstract weights (built to be lowered only)
            return next(iter(leaf.sharding.device_set)) if leaf.sharding is not None else jax.devices()[0]
        return next(iter(leaf.devices()))


def compile_jobs(
    jobs: Sequence[tuple[str, Any, Any]], say: Callable[[str], None], store: Any = None
) -> list[tuple[str, float]]:
    """Lower and compile every (name, program, example arguments or a callable making them) in parallel
    threads (XLA compiles without the GIL), saying each one's time; returns (name, seconds) per job.

    An `AotProgram` (aot_program.py) is handed its executable, so calls with the example's signature run it;
    with a ``store`` (vsurge/models/compiled/executable_store.py) a program kept there is read instead of built (its arguments
    never made), and one built is kept."""

    release_prefetched(store.directory if store is not None else None)

    def kept(name: str, fn: Any) -> bool:
        return store is not None and isinstance(fn, AotProgram) and store.has(name, fn)

    # the arguments of what must compile are made here, before the pool: making one traces the programs
    # before it (a prefill chain's), and in the pool that Python would hold back the decode blocks'
    # lowering (a v5e cold start, 1B shape: 45-46 s against 42 s)
    jobs = [(n, fn, a if kept(n, fn) or not callable(a) else a()) for n, fn, a in jobs]

    def build(job):
        name, fn, args = job
        tic = time.perf_counter()
        keep = store is not None and isinstance(fn, AotProgram)
        compiled = store.load(name, fn) if keep else None
        if compiled is None:
            with skipping_jax_cache_writes(keep):  # the store keeps it (models/compiled/cache_writes.py)
                compiled = fn.lower(*(args() if callable(args) else args)).compile()
            if keep:
                store.save(name, fn, compiled)
        if isinstance(fn, AotProgram):
            fn.use(compiled)
        return name, time.perf_counter() - tic

    if jax.default_backend() == "cpu":
        # XLA:CPU crashed deserializing two cached programs at once (cache_reads.py); on TPU the reads
        # stay parallel: taking turns, a second start of the 1B shape read its 28 programs in 57 s (22 s
        # in parallel)
        serialize_cache_reads()
    out = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for name, sec in pool.map(build, jobs):
            say(f"compiled {name} ({sec:.1f}s)")
            out.append((name, sec))
    return out


def resolve_token_budget(budget: int | None, slots: int) -> int:
    """Tokens per step (decode rows + chunk tokens): the given budget, else 256 or 2 x slots if more."""
    if budget is None:
        return max(256, 2 * slots)
    if budget <= slots:
        raise ValueError(
            f"max_num_batched_tokens {budget} leaves no prefill tokens once {slots} slots decode: "
            "raise it above max_concurrent_decodes"
        )
    return budget
