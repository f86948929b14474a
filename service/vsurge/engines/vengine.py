"""vEngine: one dense KV row per decode slot.

State lives on the device and is donated to every jitted step, so the cache is updated in place.
Prefill is padded to `prefill_lengths` buckets; decode reads only the first `kv_len` positions of each row,
with `kv_len` picked from a few static buckets by the longest live sequence. Every shape is compiled in
`compile()`; a live request only ever hits compiled programs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..models.attention import DenseDecodeAttention, PrefillAttention
from ..models.sharding import kv_cache_sharding, place_params
from ..sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from .sampling import (
    DEFAULT_MAX_STOP_IDS,
    SampleResult,
    SlotSampling,
    make_slot_sampling,
    prompt_mask_from_tokens,
    sample,
    set_slot,
    sharded_sampling,
)

log = logging.getLogger(__name__)


class GenerationState(NamedTuple):
    caches: tuple[tuple[jax.Array, jax.Array], ...]  # per layer K, V [slots, max_length, kv_heads, head_dim]
    tokens: jax.Array  # i32[S] the token each slot feeds to its next decode step
    positions: jax.Array  # i32[S] where that token goes (the slot's current length)
    steps: jax.Array  # i32[S] tokens generated so far: the sampler's per-request step counter
    counts: jax.Array  # i32[S, V] generated-token counts (presence / frequency / repetition penalties)
    prompt_mask: jax.Array  # bool[S, V] tokens of the prompt (repetition penalty)
    sampling: SlotSampling


class Prefix(NamedTuple):
    """A prefilled prompt, ready to be inserted into one or more slots."""

    kv: tuple[tuple[jax.Array, jax.Array], ...]  # per layer k, v [bucket, kv_heads, head_dim]
    logits: jax.Array  # f32[V] at the last prompt token: the first token is sampled at insert
    length: jax.Array  # i32[] true prompt length
    prompt_mask: jax.Array  # bool[V]
    sampling: SlotSampling  # one row


def plan_lengths(
    cfg: Any,
    max_length: int | None,
    prefill_lengths: Sequence[int] | None,
    max_prefill_length: int | None,
    *,
    default_max_prefill: int,
) -> tuple[int, int, list[int]]:
    """(max_length, max_prefill_length, prefill buckets) from the engine arguments, shared by both engines."""
    max_len = int(max_length or min(cfg.max_position_embeddings, 2048))
    lengths = sorted(set(int(x) for x in prefill_lengths)) if prefill_lengths else None
    max_prefill = int(max_prefill_length or (lengths[-1] if lengths else min(default_max_prefill, max_len)))
    if max_prefill > max_len:
        raise ValueError(f"max_prefill_length {max_prefill} exceeds max_length {max_len}")
    buckets = [n for n in (lengths or default_prefill_lengths(max_prefill)) if n <= max_prefill]
    if not buckets or buckets[-1] != max_prefill:
        buckets.append(max_prefill)
    return max_len, max_prefill, buckets


def default_prefill_lengths(max_prefill_length: int) -> list[int]:
    out, n = [], 32
    while n < max_prefill_length:
        out.append(n)
        n *= 2
    return out + [max_prefill_length]


def decode_buckets(max_length: int, smallest: int = 128) -> list[int]:
    out, n = [], min(smallest, max_length)
    while n < max_length:
        out.append(n)
        n *= 2
    return out + [max_length]


def row_buckets(slots: int, smallest: int = 4) -> list[int]:
    """How many leading slots a decode step covers: powers of two up to `slots`."""
    out, n = [], min(smallest, slots)
    while n < slots:
        out.append(n)
        n *= 2
    return out + [slots]


def _prefill_impl(graphdef, params, tokens, length, sampling):
    model = nnx.merge(graphdef, params)
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    backend = PrefillAttention(window=model.config.sliding_window)
    hidden, kv = model(
        tokens[None], positions, backend, [None] * model.config.num_layers, (positions, length[None])
    )
    last = jax.lax.dynamic_index_in_dim(hidden[0], length - 1, keepdims=False)
    logits = model.compute_logits(last)
    mask = prompt_mask_from_tokens(tokens, length, logits.shape[-1])
    kv = tuple((k[0], v[0]) for k, v in kv)
    return Prefix(kv, logits, length, mask, sampling)


def _first_impl(logits, row: SlotSampling, prompt_mask, key, *, num_top: int, sharded: bool):
    """Sample a sample's first token from its prefix's last logits (one compiled shape for all buckets)."""
    row = row._replace(key=key[None])
    with sharded_sampling() if sharded else contextlib.nullcontext():
        return sample(logits[None], row, None, prompt_mask[None], jnp.zeros((1,), jnp.int32), num_top)


def _insert_impl(prefix: Prefix, state: GenerationState, slot, key, first_token, *, shardings):
    row = prefix.sampling._replace(key=key[None])
    caches = tuple(
        (
            jax.lax.dynamic_update_slice(kc, k[None].astype(kc.dtype), (slot, 0, 0, 0)),
            jax.lax.dynamic_update_slice(vc, v[None].astype(vc.dtype), (slot, 0, 0, 0)),
        )
        for (kc, vc), (k, v) in zip(state.caches, prefix.kv, strict=True)
    )
    new = GenerationState(
        caches=caches,
        tokens=state.tokens.at[slot].set(first_token),
        positions=state.positions.at[slot].set(prefix.length),
        steps=state.steps.at[slot].set(1),
        counts=state.counts.at[slot].set(0).at[slot, first_token].add(1),
        prompt_mask=state.prompt_mask.at[slot].set(prefix.prompt_mask),
        sampling=set_slot(state.sampling, slot, row),
    )
    return _constrain(new, shardings)


def _forward_impl(graphdef, params, caches, tokens, positions, *, rows: int, kv_len: int, logits_sharding):
    """The model over the first `rows` slots (slots are handed out lowest first), reading kv_len positions.

    Separate from sampling so the sampler compiles once per row bucket, not once per (rows, kv_len).
    """
    model = nnx.merge(graphdef, params)
    backend = DenseDecodeAttention(window=model.config.sliding_window, kv_len=kv_len)
    pos = positions[:rows]
    hidden, caches = model(tokens[:rows, None], pos[:, None], backend, caches, pos)
    logits = model.compute_logits(hidden[:, 0])
    if logits_sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    return tuple(tuple(c) for c in caches), logits


def _sample_impl(state: GenerationState, logits, *, rows: int, num_top: int, shardings):
    sampling = SlotSampling(*(a[:rows] for a in state.sampling))
    with _sampling_context(shardings):
        out = sample(
            logits, sampling, state.counts[:rows], state.prompt_mask[:rows], state.steps[:rows], num_top
        )
    new = state._replace(
        tokens=state.tokens.at[:rows].set(out.tokens),
        positions=state.positions.at[:rows].add(1),
        steps=state.steps.at[:rows].add(1),
        counts=state.counts.at[jnp.arange(rows), out.tokens].add(1),
    )
    return _constrain(new, shardings), out


def _sampling_context(shardings):
    return contextlib.nullcontext() if shardings is None else sharded_sampling()


def _constrain(state, shardings):
    return state if shardings is None else jax.lax.with_sharding_constraint(state, shardings)


class vEngine:  # noqa: N801 - the seed's name
    """Dense-cache engine: prefill, insert into a slot, decode all slots, free a slot."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        max_concurrent_decodes: int | None = None,
        max_concurrent_prefill: int | None = None,
        prefill_lengths: Sequence[int] | None = None,
        max_prefill_length: int | None = None,
        max_length: int | None = None,
        batch_size: int | None = None,
        seed: int = 894,
        mesh: Mesh | None = None,
        num_top_logprobs: int = MAX_TOP_LOGPROBS,
    ):
        cfg = model.config
        self.model = model
        self.config = cfg
        self._processor = processor
        self.mesh = mesh
        self.max_concurrent_decodes = int(max_concurrent_decodes or 16)
        self.max_concurrent_prefill = int(max_concurrent_prefill or 1)
        self.max_length, self.max_prefill_length, self.prefill_lengths = plan_lengths(
            cfg, max_length, prefill_lengths, max_prefill_length, default_max_prefill=1024
        )
        self.decode_lengths = decode_buckets(self.max_length)
        self.batch_size = batch_size
        self.samples_per_slot = 1
        self.num_top_logprobs = num_top_logprobs
        self.prng_key = jax.random.PRNGKey(seed)

        self.graphdef, params = nnx.split(model)
        self.params = place_params(params, cfg, mesh) if mesh is not None else params
        self._state_shardings = self._make_state_shardings()
        self._pos = np.zeros(self.max_concurrent_decodes, np.int64)  # host mirror, picks the decode bucket
        self._active = np.zeros(self.max_concurrent_decodes, bool)

        self._prefill = jax.jit(partial(_prefill_impl, self.graphdef))
        self._first = jax.jit(partial(_first_impl, num_top=num_top_logprobs, sharded=mesh is not None))
        self._insert = jax.jit(partial(_insert_impl, shardings=self._state_shardings), donate_argnums=(1,))
        self.decode_rows = row_buckets(self.max_concurrent_decodes)
        logits_sharding = NamedSharding(mesh, P()) if mesh is not None else None
        self._forward = {
            (rows, n): jax.jit(
                partial(_forward_impl, self.graphdef, rows=rows, kv_len=n, logits_sharding=logits_sharding),
                donate_argnums=(1,),
            )
            for rows in self.decode_rows
            for n in self.decode_lengths
        }
        self._sample = {
            rows: jax.jit(
                partial(_sample_impl, rows=rows, num_top=num_top_logprobs, shardings=self._state_shardings),
                donate_argnums=(0,),
            )
            for rows in self.decode_rows
        }
        self.compiled = False

    # ------------------------------------------------------------------ properties of the seed's API
    @property
    def processor(self) -> Any:
        return self._processor

    @property
    def model_name(self) -> str:
        return self.config.model_type

    @property
    def eos_token_ids(self) -> list[int]:
        ids = set(self.config.eos_token_ids)
        tok = self._processor
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        return sorted(ids)

    @property
    def pad_token_id(self) -> int:
        tok = self._processor
        for v in (getattr(tok, "pad_token_id", None), self.config.pad_token_id):
            if v is not None:
                return int(v)
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    @property
    def colocated_cpus(self) -> list[jax.Device] | None:
        return None

    # ------------------------------------------------------------------ state
    def _replicated(self):
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(self._device())
        return NamedSharding(self.mesh, P())

    def _device(self) -> jax.Device:
        leaf = jax.tree_util.tree_leaves(self.params)[0]
        return next(iter(leaf.devices()))

    def _cache_shape(self) -> tuple[int, ...]:
        c = self.config
        return (self.max_concurrent_decodes, self.max_length, c.num_kv_heads, c.head_dim)

    def _make_state_shardings(self) -> GenerationState | None:
        if self.mesh is None:
            return None
        kv = kv_cache_sharding(self.mesh, self._cache_shape())
        rep = NamedSharding(self.mesh, P())
        return GenerationState(
            caches=tuple((kv, kv) for _ in range(self.config.num_layers)),
            tokens=rep,
            positions=rep,
            steps=rep,
            counts=rep,
            prompt_mask=rep,
            sampling=SlotSampling(*([rep] * len(SlotSampling._fields))),
        )

    def get_state_shardings(self, is_decode: bool = False):
        return self._state_shardings if is_decode else self.get_prefix_destination_sharding()

    def get_prefix_destination_sharding(self) -> Any:
        """Where a prefix must live to be inserted here (used by the transfer thread)."""
        if self.mesh is None:
            return self._replicated()
        c = self.config
        kv = NamedSharding(
            self.mesh, P(None, "tp", None) if c.num_kv_heads % self.mesh.shape["tp"] == 0 else P()
        )
        rep = NamedSharding(self.mesh, P())
        return Prefix(
            kv=tuple((kv, kv) for _ in range(c.num_layers)),
            logits=rep,
            length=rep,
            prompt_mask=rep,
            sampling=SlotSampling(*([rep] * len(SlotSampling._fields))),
        )

    def init_decode_state(self, *args, **kwargs) -> GenerationState:
        s, v = self.max_concurrent_decodes, self.config.vocab_size
        dtype = self.model.dtype
        rep = self._replicated()
        kv_sharding = kv_cache_sharding(self.mesh, self._cache_shape()) if self.mesh is not None else rep
        zeros = jax.jit(lambda: jnp.zeros(self._cache_shape(), dtype), out_shardings=kv_sharding)
        caches = tuple((zeros(), zeros()) for _ in range(self.config.num_layers))
        put = partial(jax.device_put, device=rep)
        sampling = make_slot_sampling([None] * s, max_stop_ids=DEFAULT_MAX_STOP_IDS)
        self._pos[:] = 0
        self._active[:] = False
        return GenerationState(
            caches=caches,
            tokens=put(np.zeros(s, np.int32)),
            positions=put(np.zeros(s, np.int32)),
            steps=put(np.zeros(s, np.int32)),
            counts=put(np.zeros((s, v), np.int32)),
            prompt_mask=put(np.zeros((s, v), bool)),
            sampling=jax.tree.map(put, sampling),
        )

    # ------------------------------------------------------------------ steps
    def bucket_for(self, length: int) -> int:
        for n in self.prefill_lengths:
            if length <= n:
                return n
        raise ValueError(f"prompt of {length} tokens exceeds max_prefill_length {self.max_prefill_length}")

    def sampling_row(self, params: SamplingParams, stop_ids: Sequence[int] = ()) -> SlotSampling:
        return make_slot_sampling([params], stop_ids=[list(stop_ids)[:DEFAULT_MAX_STOP_IDS]])

    def prefill(self, tokens: Sequence[int], sampling: SlotSampling) -> Prefix:
        """Prefill one prompt (padded to its bucket). Dispatched asynchronously."""
        n = len(tokens)
        if n < 1:
            raise ValueError("empty prompt")
        bucket = self.bucket_for(n)
        padded = np.full(bucket, self.pad_token_id, np.int32)
        padded[:n] = tokens
        return self._prefill(self.params, padded, np.int32(n), sampling)

    def insert(self, prefix: Prefix, decode_state: GenerationState, slot: int, key: np.ndarray | None = None):
        """Put a prefix into `slot`; returns (state, first token SampleResult[1]). key: u32[2] per sample."""
        if key is None:
            key = prefix.sampling.key[0]
        first = self._first(prefix.logits, prefix.sampling, prefix.prompt_mask, key)
        state = self._insert(prefix, decode_state, np.int32(slot), key, first.tokens[0])
        self._pos[slot] = int(prefix.length)
        self._active[slot] = True
        return state, first

    def bulk_insert(self, prefix: Prefix, decode_state: GenerationState, slots: Sequence[int], keys=None):
        """Insert one prefix into several slots (n samples sharing one prefill)."""
        firsts = []
        for i, slot in enumerate(slots):
            decode_state, first = self.insert(prefix, decode_state, slot, None if keys is None else keys[i])
            firsts.append(first)
        return decode_state, firsts

    def decode(self, decode_state: GenerationState) -> tuple[GenerationState, SampleResult]:
        """One token for every live slot. Runs the smallest compiled (rows, kv_len) that covers the
        highest live slot and the longest live sequence; results have one row per decoded slot."""
        live = np.flatnonzero(self._active)
        need_rows = int(live[-1]) + 1 if live.size else 1
        need_len = int(self._pos[live].max()) + 1 if live.size else 1
        rows = next((r for r in self.decode_rows if r >= need_rows), self.max_concurrent_decodes)
        kv_len = next((n for n in self.decode_lengths if n >= need_len), self.max_length)
        s = decode_state
        caches, logits = self._forward[(rows, kv_len)](self.params, s.caches, s.tokens, s.positions)
        state, out = self._sample[rows](s._replace(caches=caches), logits)
        self._pos[live] += 1
        return state, out

    def free_resource(self, slot: int) -> bool:
        """Release a slot: it stops counting toward the decode bucket. Its row is overwritten on insert."""
        was = bool(self._active[slot])
        self._active[slot] = False
        self._pos[slot] = 0
        return was

    # ------------------------------------------------------------------ warm-up
    def compile(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile every program a live request can hit; returns seconds.

        The expensive programs (prefill buckets, forward per (rows, kv_len), sampler per rows) are lowered
        and compiled in parallel threads (XLA compiles without the GIL); then each program runs once on
        the real state, so the jit caches hold exactly the signatures live requests use.
        """
        say = progress or log.info
        t0 = time.perf_counter()
        state = self.init_decode_state()
        row = self.sampling_row(SamplingParams(temperature=0.0, max_tokens=1))
        v = self.config.vocab_size
        logits_sharding = NamedSharding(self.mesh, P()) if self.mesh is not None else self._replicated()
        jobs = [
            (f"prefill bucket {n}", self._prefill, (self.params, np.ones(n, np.int32), np.int32(n), row))
            for n in self.prefill_lengths
        ]
        jobs += [
            (f"decode slots={r} kv_len={n}", fn, (self.params, state.caches, state.tokens, state.positions))
            for (r, n), fn in self._forward.items()
        ]
        jobs += [
            (
                f"sampler slots={r}",
                fn,
                (state, jax.device_put(jnp.zeros((r, v), jnp.float32), logits_sharding)),
            )
            for r, fn in self._sample.items()
        ]

        def build(job):
            name, fn, args = job
            t = time.perf_counter()
            fn.lower(*args).compile()
            return f"compiled {name} ({time.perf_counter() - t:.1f}s)"

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for line in pool.map(build, jobs):
                say(line)
        for n in self.prefill_lengths:  # warm every program on the real state
            state, first = self.insert(self.prefill([1] * n, row), state, 0)
        for (r, _n), fn in self._forward.items():
            caches, logits = fn(self.params, state.caches, state.tokens, state.positions)
            state, out = self._sample[r](state._replace(caches=caches), logits)
        jax.block_until_ready(out)
        self.free_resource(0)
        del state
        self.compiled = True
        say(f"compiled {len(jobs)} programs in {time.perf_counter() - t0:.1f}s")
        return time.perf_counter() - t0
