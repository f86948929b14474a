"""The LoRA adapter bank inside the model, and the per-row low-rank update (S-LoRA / Punica).

With LoRA on, every adapted projection (a `Linear` named in TARGETS) carries two extra parameters:
``lora_a`` [N, in, R] and ``lora_b`` [N, R, out], the stacked A and B of the N bank slots, zero-padded to
the bank's rank R, with each adapter's scaling folded into B. They are ordinary parameters of the model's
state, so every program already takes them as an argument: loading an adapter writes new values into a
slot and never changes a shape, so nothing recompiles. They sit under the model's partition rules
(sharding.py): B is split like the kernel's output, A like its input.

Each token names its slot (i32, -1: the base model); `lora_delta` adds x @ A[slot] @ B[slot] for every
row in one batched computation. Without LoRA the attributes do not exist: the model's state, its programs
and their cost are exactly those of a model that never heard of adapters.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from .registry import architecture_for
from .sharding import spec_for

# The projections an adapter may target, by their module names in Hugging Face Llama checkpoints (PEFT's
# target_modules use the same names).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS


def target_shape(cfg: Any, module: str) -> tuple[int, int]:
    """(in, out) of projection ``module`` of a model with config ``cfg`` (models/config.py)."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, i),
        "up_proj": (d, i),
        "down_proj": (i, d),
    }
    return shapes[module]


def projections(model: Any) -> Iterator[tuple[int, str, Any]]:
    """(layer index, module name, Linear) of every projection an adapter may target."""
    for n, layer in enumerate(model.model.layers):
        for name in ATTENTION_TARGETS:
            yield n, name, getattr(layer.self_attn, name)
        for name in MLP_TARGETS:
            yield n, name, getattr(layer.mlp, name)


def attach_bank(model: Any, slots: int, rank: int) -> None:
    """Give every target projection of ``model`` an empty bank of ``slots`` adapters of rank ``rank``
    (before the engine splits the model into graph and state). Zeros: an empty slot adds nothing."""
    if slots < 1 or rank < 1:
        raise ValueError(f"a LoRA bank needs slots >= 1 and rank >= 1, got {slots} and {rank}")
    dtype = model.dtype
    rules = None
    for _, name, lin in projections(model):
        din, dout = target_shape(model.config, name)
        # committed where the kernel is, as a bank write's result will be: jit keys on committedness, and
        # an uncommitted first value would make the first load recompile every program
        where = getattr(lin.kernel[...], "sharding", None)
        shapes = {"lora_a": (slots, din, rank), "lora_b": (slots, rank, dout)}
        if isinstance(where, NamedSharding):
            # already where the engine's rules put the bank (placing it again moves nothing), each process
            # filling only its own devices' zeros: no program and no collective, so a multi-host leader
            # builds its engine before its workers do (vsurge/multihost) without waiting for them
            rules = rules or architecture_for(model.config.model_type).partition_rules
            block = "self_attn" if name in ATTENTION_TARGETS else "mlp"
            a, b = (
                _zeros(
                    shape,
                    dtype,
                    NamedSharding(where.mesh, spec_for(f"{block}/{name}/{k}", shape, where.mesh, rules)),
                )
                for k, shape in shapes.items()
            )
        else:
            a, b = (jnp.zeros(shape, dtype) for shape in shapes.values())
            if where is not None:
                a, b = jax.device_put(a, where), jax.device_put(b, where)
        # nnx.data: a new attribute of an existing module is static unless marked as data
        lin.lora_a = nnx.data(nnx.Param(a))
        lin.lora_b = nnx.data(nnx.Param(b))


def _zeros(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.Array:
    zeros = np.zeros(shape, dtype)  # untouched pages: each process reads only its shards' views
    return jax.make_array_from_callback(shape, sharding, lambda index: zeros[index])


def detach_bank(model: Any) -> None:
    """Remove a bank `attach_bank` gave ``model`` (an engine without LoRA built on the same model)."""
    for _, _, lin in projections(model):
        for name in ("lora_a", "lora_b"):
            if getattr(lin, name, None) is not None:
                delattr(lin, name)


def has_bank(model: Any) -> bool:
    """True when ``model`` carries an adapter bank (attach_bank ran before it was split)."""
    first = next(projections(model))[2]
    return getattr(first, "lora_a", None) is not None


def bank_shape(model: Any) -> tuple[int, int] | None:
    """(slots, rank) of the model's bank, or None without one."""
    first = next(projections(model))[2]
    a = getattr(first, "lora_a", None)
    return None if a is None else (a.shape[0], a.shape[2])


def lora_delta(x: jax.Array, ids: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """The low-rank update of each token: x [..., in] with ids [...] (its bank slot, -1: none), bank
    a [N, in, R], b [N, R, out]; returns [..., out] in x's dtype.

    Two forms of the same sum, picked by size at trace time. With no more tokens than slots (a small
    decode step) each token gathers its own A and B (Punica's BGMV): the weights read are those of the
    tokens' adapters only. With more tokens, gathering a copy of A and B per token would read and write
    far more than the bank itself, so every token goes through every slot's A at once ([T, N*R], a
    narrow matmul), a one-hot mask keeps its own slot's R columns, and one matmul with the stacked B
    finishes (the segmented form of S-LoRA, as one dense op): the bank is read once per step.
    """
    lead, din = x.shape[:-1], x.shape[-1]
    n, _, r = a.shape
    xt = x.reshape(-1, din)
    it = ids.reshape(-1)
    t = xt.shape[0]
    if t <= n:
        slot = jnp.clip(it, 0, n - 1)
        xa = jnp.einsum("ti,tir->tr", xt, a[slot], preferred_element_type=jnp.float32)
        xa = xa * (it >= 0)[:, None]
        y = jnp.einsum("tr,tro->to", xa.astype(b.dtype), b[slot], preferred_element_type=jnp.float32)
    else:
        flat_a = jnp.transpose(a, (1, 0, 2)).reshape(din, n * r)
        xa = jnp.dot(xt.astype(a.dtype), flat_a, preferred_element_type=jnp.float32)
        mask = jnp.repeat(jax.nn.one_hot(it, n, dtype=jnp.float32), r, axis=1)  # -1: all zeros
        y = jnp.dot((xa * mask).astype(b.dtype), b.reshape(n * r, -1), preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(*lead, -1)


def token_slots(slots: jax.Array, segments: jax.Array) -> jax.Array:
    """Per token of a packed prefill: the slot of its prompt (``slots`` i32[K] per prompt, ``segments``
    [R, L] the prompt of each token, K for padding, which gets -1)."""
    return jnp.concatenate([slots, jnp.full((1,), -1, slots.dtype)])[segments]
