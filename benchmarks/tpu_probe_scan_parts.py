# ruff: noqa: B023 - the probe's closures run inside the loop iteration that made them
"""tpu_probe_layer_scan's pieces: the programs' plan per shape, the scan variant's attention over a stacked
cache, and one shape's models (U: the model's unrolled forward; S: its layer under one lax.scan) with the
programs built on them."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from device_check import random_model, weight_bytes  # noqa: E402
from flax import nnx  # noqa: E402
from tpu_probe_harness import SHAPES, TINY  # noqa: E402

from vsurge.models.attention import (  # noqa: E402
    _NEG,
    DenseDecodeAttention,
    PrefillAttention,
    _allowed,
    _load_as,
    kv_store,
    read_chunk,
    to_flat,
)
from vsurge.models.llama import LlamaForCausalLM  # noqa: E402

# the reduced (CPU) shape: TINY with 4 layers, so the scan has something to loop over
TINY_SCAN = replace(TINY, num_layers=4)
PROGRAMS = ("prefill_small", "decode", "prefill_big")  # the order they run in (the costliest last)


@dataclasses.dataclass(frozen=True)
class Plan:
    prefill: dict[str, tuple[int, int]]  # program -> (rows, tokens per row)
    batch: int
    max_len: int
    context: int


def plan_for(shape: str, reduced: bool) -> Plan:
    if reduced:
        return Plan({"prefill_small": (2, 16), "prefill_big": (1, 32)}, 8, 64, 32)
    big = SHAPES[shape].num_layers > 16 or SHAPES[shape].hidden_size > 2048
    return Plan({"prefill_small": (16, 128), "prefill_big": (1, 1024)}, 64, 512 if big else 1024, 400)


def program_label(program: str, plan: Plan) -> str:
    if program == "decode":
        return f"decode b{plan.batch} m{plan.max_len}"
    r, t = plan.prefill[program]
    return f"prefill {r}x{t}"


# ------------------------------------------------------------------------------- the S variant's pieces


@dataclasses.dataclass(frozen=True)
class StackedDecodeAttention:
    """`DenseDecodeAttention` over the stacked flat cache K, V [L, S, M, KVH * D] of a layer scan.

    cache: (K, V, layer) — the scan's carry and the layer index; meta (positions [S], lengths [S]) as the
    engine's. The new token's K/V are scattered into the carry at [layer, row, position] and the layer's
    rows are read through dynamic slices of the carry in `flat_read_rows`'s chunked online softmax, so
    no layer of the cache is ever copied out or written back whole."""

    window: int | None = None
    chunk: int | None = None

    def __call__(self, q, k, v, cache, meta):
        kc, vc, layer = cache
        positions, lengths = meta
        s, _, h, d = q.shape
        kvh = k.shape[2]
        g = h // kvh
        rows = jnp.arange(s)
        kc = kc.at[layer, rows, positions].set(kv_store(to_flat(k[:, 0]), kc.dtype))
        vc = vc.at[layer, rows, positions].set(kv_store(to_flat(v[:, 0]), vc.dtype))
        n = kc.shape[2]
        need = jnp.minimum(lengths, n)
        qg = q[:, 0].reshape(s, 1, kvh, g, d).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
        out = stacked_read(qg, positions[:, None], need, kc, vc, layer, window=self.window, chunk=self.chunk)
        return out.reshape(s, 1, h, d).astype(q.dtype), (kc, vc, layer)


def stacked_read(qj, pj, need, kc, vc, layer, *, window, chunk):
    """attention.flat_read_rows (the TPU reader, block-diagonal queries against flat rows) over layer
    `layer` of the stacked cache: each chunk is a dynamic slice [layer, :R, start:start + c, :]."""
    r, t, kvh, g, d = qj.shape
    lanes = kc.shape[-1]
    dt = jnp.bfloat16 if kc.dtype in (jnp.uint16, jnp.bfloat16) else jnp.float32
    n = kc.shape[2]
    c = min(read_chunk(chunk), n)
    most = -(-n // c)
    eye = jnp.eye(kvh, dtype=dt)
    qb = (qj.astype(dt)[..., None, :] * eye[:, None, :, None]).reshape(r, t * kvh * g, lanes)
    q_pos = jnp.repeat(pj, kvh * g, axis=1)[:, :, None]
    zero = jnp.zeros((), jnp.int32)

    def body(i, carry):
        m, denom, acc = carry
        start = jnp.minimum(i * c, n - c)
        at = (layer, zero, start, zero)
        ks = jax.lax.dynamic_slice(kc, at, (1, r, c, lanes))[0]
        vs = jax.lax.dynamic_slice(vc, at, (1, r, c, lanes))[0]
        ks, vs = _load_as(ks, dt), _load_as(vs, dt)
        k_pos = start + jnp.arange(c)
        ok = _allowed(q_pos, k_pos, window) & (k_pos >= i * c) & (k_pos < need[:, None, None])
        scores = jnp.einsum("rqc,rnc->rqn", qb, ks, preferred_element_type=jnp.float32)
        scores = jnp.where(ok, scores, _NEG)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.where(ok, jnp.exp(scores - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        pv = jnp.einsum("rqn,rnc->rqc", p.astype(dt), vs, preferred_element_type=jnp.float32)
        return m_new, denom * scale + p.sum(-1), acc * scale[..., None] + pv

    trips = jnp.clip((jnp.max(need) + c - 1) // c, 0, most)
    th = t * kvh * g
    init = (
        jnp.full((r, th), _NEG, jnp.float32),
        jnp.zeros((r, th), jnp.float32),
        jnp.zeros((r, th, lanes), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, trips, body, init)
    out = (acc / jnp.maximum(denom, 1e-30)[..., None]).reshape(r, t, kvh, g, kvh, d)
    return jnp.einsum("rtkgjd,kj->rtkgd", out, eye.astype(jnp.float32))


def head_logits(embed, lm_head, hidden):
    """The model's own compute_logits, given its embedding and lm_head modules only."""
    shell = SimpleNamespace(lm_head=lm_head, model=SimpleNamespace(embed_tokens=embed))
    return LlamaForCausalLM.compute_logits(shell, hidden)


# ------------------------------------------------------------------------------------------ one shape


class Shape:
    """A random model at a shape: U's (graphdef, state), the non-layer modules split for S, and after
    `stack` the layers' parameters stacked [L, ...]."""

    def __init__(self, name: str, reduced: bool, quantization: str):
        self.name = name
        self.cfg = TINY_SCAN if reduced else SHAPES[name]
        self.dtype = jnp.float32 if reduced else jnp.bfloat16
        self.quantization = quantization
        self.plan = plan_for(name, reduced)
        self.model = random_model(self.cfg, self.dtype, quantization)
        self.graphdef, self.state = nnx.split(self.model)
        self.wbytes = weight_bytes(self.model)
        m = self.model
        self.embed_gd, embed_st = nnx.split(m.model.embed_tokens)
        self.norm_gd, norm_st = nnx.split(m.model.norm)
        self.head_gd, head_st = nnx.split(m.lm_head) if m.lm_head is not None else (None, None)
        self.outer = (embed_st, norm_st, head_st)  # the same arrays as U's state
        self.layer_gd, _ = nnx.split(m.model.layers[0])
        self.layer_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(m.model.layers)))
        self.stacked = None
        self.u_alive = True
        p = self.plan
        self.kv_dtype = self.dtype  # the engine's cache holds the model's dtype (dense_state.cache_dtype)
        self.kv_shape = (p.batch, p.max_len, self.cfg.num_kv_heads * self.cfg.head_dim)
        self.kv_bytes = (
            2 * self.cfg.num_layers * int(np.prod(self.kv_shape)) * jnp.dtype(self.kv_dtype).itemsize
        )
        self.outputs: dict[tuple[str, str], dict[str, np.ndarray]] = {}

    def fits_both(self) -> bool:
        """U's layers and S's stacked copy, and the largest cache, on the device at once?"""
        stats = jax.devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
        if not limit:
            return True
        return self.wbytes + self.layer_bytes + 1.2 * self.kv_bytes + 1.5e9 < limit

    def stack(self, free: bool) -> dict[str, Any]:
        """Stack the layers' parameters [L, ...], leaf by leaf; `free`: delete U's per-layer arrays as each
        leaf is stacked (U cannot run after), so the copy never needs more than one leaf's stack extra."""
        t0 = time.perf_counter()
        states = [nnx.split(layer)[1] for layer in self.model.model.layers]
        leaves = [jax.tree.leaves(s) for s in states]
        treedef = jax.tree.structure(states[0])
        out = []
        for i in range(len(leaves[0])):
            parts = [lv[i] for lv in leaves]
            out.append(jax.block_until_ready(jnp.stack(parts)))
            if free:
                for x in parts:
                    x.delete()
        self.stacked = jax.tree.unflatten(treedef, out)
        if free:
            self.u_alive = False
        return dict(stack_s=time.perf_counter() - t0, freed_u=free, stacked_gb=self.layer_bytes / 1e9)

    # ------------------------------------------------------------------------------ inputs

    def prefill_args(self, program: str):
        r, t = self.plan.prefill[program]
        tokens = jax.random.randint(jax.random.key(1), (r, t), 0, self.cfg.vocab_size, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
        segments = jnp.zeros((r, t), jnp.int32)
        totals = jnp.full((r,), t, jnp.int32)
        return tokens, positions, segments, totals

    def decode_inputs(self):
        p = self.plan
        tokens = jax.random.randint(jax.random.key(2), (p.batch,), 0, self.cfg.vocab_size, jnp.int32)
        positions = (p.context - 1 - jnp.arange(p.batch, dtype=jnp.int32) % 8).astype(jnp.int32)
        return tokens, positions

    def caches_u(self):
        layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        return [
            (
                _kv_fill(layers[i], 0, self.kv_shape, self.kv_dtype),
                _kv_fill(layers[i], 1, self.kv_shape, self.kv_dtype),
            )
            for i in range(self.cfg.num_layers)
        ]

    def caches_s(self):
        layers = self.cfg.num_layers
        return (
            _kv_fill_stacked(layers, 0, self.kv_shape, self.kv_dtype),
            _kv_fill_stacked(layers, 1, self.kv_shape, self.kv_dtype),
        )

    # ------------------------------------------------------------------------------ the programs

    def make(self, program: str, variant: str):
        """A fresh (new function object) program body and its donated argnums."""
        cfg, L = self.cfg, self.cfg.num_layers
        window = cfg.sliding_window
        gd, layer_gd, embed_gd, norm_gd, head_gd = (
            self.graphdef,
            self.layer_gd,
            self.embed_gd,
            self.norm_gd,
            self.head_gd,
        )

        def outer_modules(outer):
            embed = nnx.merge(embed_gd, outer[0])
            norm = nnx.merge(norm_gd, outer[1])
            head = nnx.merge(head_gd, outer[2]) if head_gd is not None else None
            return embed, norm, head

        if program != "decode" and variant == "U":

            def f(state, tokens, positions, segments, totals):
                model = nnx.merge(gd, state)
                backend = PrefillAttention(window=window)
                hidden, kv = model(tokens, positions, backend, [None] * L, (positions, totals, segments))
                return hidden[:, -1], kv

            return f, ()
        if program != "decode":

            def f(outer, stacked, tokens, positions, segments, totals):
                embed, norm, _ = outer_modules(outer)
                backend = PrefillAttention(window=window)
                meta = (positions, totals, segments)

                def body(x, layer_state):
                    layer = nnx.merge(layer_gd, layer_state)
                    x, kv = layer(x, positions, backend, None, meta)
                    return x, kv

                x, kv = jax.lax.scan(body, embed(tokens), stacked)
                return norm(x)[:, -1], kv

            return f, ()
        if variant == "U":

            def f(state, caches, tokens, positions):
                model = nnx.merge(gd, state)
                backend = DenseDecodeAttention(window=window)
                hidden, caches = model(
                    tokens[:, None], positions[:, None], backend, caches, (positions, positions + 1)
                )
                hidden = hidden[:, 0]
                nxt = jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32)
                return nxt, hidden, [tuple(c) for c in caches]

            return f, (1,)

        def f(outer, stacked, kc, vc, tokens, positions):
            embed, norm, head = outer_modules(outer)
            backend = StackedDecodeAttention(window=window)
            meta = (positions, positions + 1)

            def body(carry, layer_state):
                x, kc, vc, layer_i = carry
                layer = nnx.merge(layer_gd, layer_state)
                x, (kc, vc, _) = layer(x, positions[:, None], backend, (kc, vc, layer_i), meta)
                return (x, kc, vc, layer_i + 1), None

            (x, kc, vc, _), _ = jax.lax.scan(body, (embed(tokens[:, None]), kc, vc, jnp.int32(0)), stacked)
            hidden = norm(x)[:, 0]
            nxt = jnp.argmax(head_logits(embed, head, hidden), axis=-1).astype(jnp.int32)
            return nxt, hidden, kc, vc

        return f, (2, 3)

    def logits(self, hidden):
        return np.asarray(_logits(self.embed_gd, self.head_gd, self.outer[0], self.outer[2], hidden))


@partial(jax.jit, static_argnums=(2, 3))
def _kv_fill(layer, which, shape, dtype):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(7), which), layer)
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _kv_fill_stacked(layers, which, shape, dtype):
    """[L, *shape]: layer l as `_kv_fill` makes it, written in place one layer at a time (no f32 temp of
    the whole stack: the 8B shape's would not fit beside its weights)."""

    def body(layer, acc):
        return jax.lax.dynamic_update_index_in_dim(acc, _kv_fill(layer, which, shape, dtype), layer, 0)

    return jax.lax.fori_loop(0, layers, body, jnp.zeros((layers, *shape), dtype))


@partial(jax.jit, static_argnums=(0, 1))
def _logits(embed_gd, head_gd, embed_st, head_st, hidden):
    embed = nnx.merge(embed_gd, embed_st)
    head = nnx.merge(head_gd, head_st) if head_gd is not None else None
    return head_logits(embed, head, hidden)


@jax.jit
def _written_u(caches, positions):
    rows = jnp.arange(positions.shape[0])
    return jnp.stack([kc[rows, positions] for kc, _ in caches]), jnp.stack(
        [vc[rows, positions] for _, vc in caches]
    )


@jax.jit
def _written_s(kc, vc, positions):
    rows = jnp.arange(positions.shape[0])
    return kc[:, rows, positions], vc[:, rows, positions]
