"""Meshes from short specs and regex partition rules that place parameters and KV caches on them."""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .registry import PartitionRules, architecture_for

AXES = ("dp", "tp")

# Matched against the parameter path joined with "/", e.g. "model/layers/3/self_attn/q_proj/kernel".
# Kernels are [in, out]: column-parallel layers split "out", row-parallel ones split "in".
LLAMA_RULES: tuple[tuple[str, P], ...] = (
    (r"embed_tokens/embedding$", P("tp", None)),
    (r"self_attn/(q|k|v)_proj/kernel$", P(None, "tp")),
    (r"self_attn/(q|k|v)_proj/bias$", P("tp")),
    (r"self_attn/o_proj/kernel$", P("tp", None)),
    (r"mlp/(gate|up)_proj/kernel$", P(None, "tp")),
    (r"mlp/(gate|up)_proj/bias$", P("tp")),
    (r"mlp/down_proj/kernel$", P("tp", None)),
    (r"lm_head/kernel$", P(None, "tp")),
    # int8 scales (models/quantization.py), [G, out] beside a kernel and [vocab, G] beside the embedding:
    # split like the weight they scale (out channels with the out axis, groups of `in` with the in axis)
    (r"embed_tokens/scale$", P("tp", None)),
    (r"self_attn/(q|k|v)_proj/scale$", P(None, "tp")),
    (r"self_attn/o_proj/scale$", P("tp", None)),
    (r"mlp/(gate|up)_proj/scale$", P(None, "tp")),
    (r"mlp/down_proj/scale$", P("tp", None)),
    (r"lm_head/scale$", P(None, "tp")),
    # the LoRA bank (models/lora.py), A [slots, in, R] and B [slots, R, out]: B split like its kernel's
    # output on column-parallel layers, A like its kernel's input on row-parallel ones, the rest whole
    # (S-LoRA's layout: each device computes its shard of the update with no extra collective)
    (r"self_attn/(q|k|v)_proj/lora_b$", P(None, None, "tp")),
    (r"mlp/(gate|up)_proj/lora_b$", P(None, None, "tp")),
    (r"self_attn/o_proj/lora_a$", P(None, "tp", None)),
    (r"mlp/down_proj/lora_a$", P(None, "tp", None)),
    (r".*", P()),
)
# model_type -> rules, as registered (models/registry.py; the Llama family registers LLAMA_RULES).
PARTITION_RULES = PartitionRules()

# Dense KV cache [slots, length, kv_heads, head_dim] and pages [pages, page_size, kv_heads, head_dim].
KV_CACHE_SPEC = P("dp", None, "tp", None)
KV_PAGES_SPEC = P(None, None, "tp", None)


def parse_mesh_spec(spec: str | None) -> dict[str, int]:
    """'tp=8' or 'dp=2,tp=4' -> {'dp': 2, 'tp': 4}. Empty / None -> one device."""
    sizes = {"dp": 1, "tp": 1}
    if not spec:
        return sizes
    for part in spec.split(","):
        name, _, value = part.strip().partition("=")
        if name not in AXES or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(
                f"invalid mesh spec {spec!r}: expected entries like 'tp=8' or 'dp=2,tp=4' (axes: dp, tp)"
            )
        sizes[name] = int(value)
    return sizes


def make_mesh(spec: str | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('dp', 'tp') mesh over the first dp*tp devices (or the given ones)."""
    sizes = parse_mesh_spec(spec)
    need = sizes["dp"] * sizes["tp"]
    devs = list(devices) if devices is not None else jax.devices()
    if devices is None:
        devs = devs[:need]
    if len(devs) != need:
        raise ValueError(f"mesh {spec!r} needs {need} devices, {len(devs)} available")
    return Mesh(np.array(devs).reshape(sizes["dp"], sizes["tp"]), AXES)


def fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Drop the axes that do not divide their dimension: such a tensor stays whole on that axis."""
    parts = []
    for i, axis in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        size = mesh.shape[axis] if axis is not None else 1
        parts.append(axis if axis is not None and shape[i] % size == 0 else None)
    return P(*parts)


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh, rules: Sequence[tuple[str, P]]) -> P:
    for pattern, spec in rules:
        if re.search(pattern, path):
            return fit_spec(spec, shape, mesh)
    return P()


def sharding_for(path: str, shape: tuple[int, ...], mesh: Mesh | None, rules) -> jax.sharding.Sharding:
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, spec_for(path, shape, mesh, rules))


def kv_cache_sharding(
    mesh: Mesh | None, shape: tuple[int, ...], paged: bool = False
) -> jax.sharding.Sharding:
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, fit_spec(KV_PAGES_SPEC if paged else KV_CACHE_SPEC, shape, mesh))


def dense_cache_sharding(
    mesh: Mesh | None, shape: tuple[int, ...], num_kv_heads: int
) -> jax.sharding.Sharding:
    """vEngine's flat cache [S, M, KVH * D]: slots over dp, the flat heads over tp when tp splits whole kv
    heads (each tp shard then holds the heads its query heads read), else whole on every tp shard."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tp = "tp" if num_kv_heads % mesh.shape["tp"] == 0 else None
    return NamedSharding(mesh, fit_spec(P("dp", None, tp), shape, mesh))


def place_params(state, cfg, mesh: Mesh):
    """A copy of an nnx parameter State placed on `mesh` by the architecture's rules (for engines on their own
    devices); abstract parameters (jax.ShapeDtypeStruct) get the sharding they would have there. ``state``
    and the model it came from keep their arrays: two engines built on one model (disaggregated prefill
    and decode, each on its own devices) each keep their own placement. An array already placed so (a
    model loaded onto the mesh, as `vsurge serve` loads it) is the same array, not a copy."""
    from flax import nnx

    rules = architecture_for(cfg.model_type).partition_rules
    state = jax.tree.map(lambda x: x, state)  # new Variables, the same arrays
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        sharding = sharding_for("/".join(map(str, path)), value.shape, mesh, rules)
        if isinstance(value, jax.ShapeDtypeStruct):  # an abstract model (loader.abstract_model): no data
            var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
        else:
            var.set_value(jax.device_put(value, sharding))
    return state
