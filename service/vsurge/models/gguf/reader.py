"""Read GGUF checkpoints (llama.cpp's format) as Hugging Face configs and float32 numpy tensors.

`read_gguf(path)` parses the header, checks every tensor against the architecture and returns a
`GGUFCheckpoint`:

- `config`: a Hugging Face `config.json`-style dict (`model_type` llama, mistral, qwen2 or qwen3).
- `tensors`: a lazy, read-only mapping from Hugging Face parameter names to dequantized float32 arrays in
  Hugging Face shapes (Linear weights `[out_features, in_features]`). Each access dequantizes that one
  tensor from the memory-mapped file, so a loader can place tensors one by one without holding the
  model twice; nothing is cached.
- `tokenizer_source`: the GGUF path; `load_gguf_tokenizer(path)` builds the transformers tokenizer (with
  the chat template) from the file's `tokenizer.*` metadata, without torch (`gguf_tokenizer.py`).

`read_gguf_metadata(path, decode=keys)` reads the metadata alone, with the long string arrays named in
`decode` (the vocabulary, the merges) read whole.

llama.cpp's converter interleaves the rows of the q/k projections of the `llama` architecture (for its
rotary kernel); this module undoes it, so the weights are exactly the Hugging Face ones. Llama 3 rope
scaling, stored by llama.cpp as a `rope_freqs.weight` tensor of per-frequency divisors, is turned back
into the Hugging Face `rope_scaling` dict (and checked to reproduce that tensor).

Every problem with the file raises `CheckpointError` (a `ValueError`) naming the file and the problem.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vsurge.models.errors import CheckpointError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "CheckpointError",
    "GGUFCheckpoint",
    "GGUFTensorInfo",
    "GGUFTensors",
    "load_gguf_tokenizer",
    "read_gguf",
    "read_gguf_metadata",
]

# GGML tensor types this reader dequantizes (numpy, through the `gguf` package).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

# general.architecture -> (Hugging Face model_type, architectures class)
SUPPORTED_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
_MISTRAL = ("mistral", "MistralForCausalLM")

# GGUF tensor name (inside a block) -> Hugging Face name (inside `model.layers.{i}.`)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ROPE_FREQS = "rope_freqs.weight"
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# llama.cpp writes Llama 3 rope factors with `original_max_position_embeddings` defaulting to 8192.
_LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one Hugging Face parameter lives in the GGUF file."""

    name: str  # Hugging Face name
    gguf_name: str
    ggml_type: str  # e.g. "Q4_K"
    shape: tuple[int, ...]  # Hugging Face shape
    unpermute_heads: int | None = None  # undo llama.cpp's q/k row interleave over this many heads


class GGUFTensors(Mapping[str, np.ndarray]):
    """Read-only mapping: Hugging Face name -> float32 array, dequantized from the file on each access.

    Iteration order is the model's order (embedding, layers 0..n-1, final norm, lm_head). Use `info`
    (or `shape(name)`) for shapes and types without reading any data.
    """

    def __init__(self, path: Path, by_gguf_name: dict[str, _Tensor], infos: dict[str, GGUFTensorInfo]):
        self._path = path
        self._by_gguf_name = by_gguf_name
        self.info: dict[str, GGUFTensorInfo] = infos

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.info[name]
        tensor = self._by_gguf_name[info.gguf_name]
        array = _dequantize(self._path, tensor)
        if array.shape != info.shape:
            array = array.reshape(info.shape)
        if info.unpermute_heads is not None:
            array = _unpermute_rows(array, info.unpermute_heads)
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self.info)

    def __len__(self) -> int:
        return len(self.info)

    def __contains__(self, name: object) -> bool:
        return name in self.info

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info[name].shape

    def nbytes(self) -> int:
        """Bytes of all tensors once dequantized to float32."""
        return sum(4 * math.prod(i.shape) for i in self.info.values())

    def materialize(self) -> dict[str, np.ndarray]:
        """All tensors as a plain dict (dequantizes everything; float32 holds the whole model)."""
        return {name: self[name] for name in self.info}

    def __repr__(self) -> str:
        return f"GGUFTensors({self._path.name!r}, {len(self)} tensors)"


@dataclass
class GGUFCheckpoint:
    """A parsed GGUF checkpoint. `tensors` is lazy: see `GGUFTensors`."""

    path: Path
    config: dict[str, Any]
    tensors: GGUFTensors
    tokenizer_source: Path
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)  # scalar GGUF metadata

    def load_tokenizer(self):
        """The transformers tokenizer, with the chat template, built from this file's metadata."""
        return load_gguf_tokenizer(self.tokenizer_source)


# --------------------------------------------------------------------------------------------------
# Reading


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Parse a GGUF file into a Hugging Face-style config and a lazy mapping of float32 tensors.

    Only the header is read here (and the tensor table checked against the file size); tensor data stays
    in the memory-mapped file until accessed. Raises `CheckpointError` (naming the file) for a missing,
    truncated or corrupt file, an unsupported architecture, missing metadata, unsupported tensor types
    and tensors whose shape does not match the metadata.
    """
    path = Path(path)
    header = _parse(path)
    meta = _Metadata(path, header.metadata)

    arch = meta.get("general.architecture")
    if arch is None:
        raise CheckpointError(f"{path}: missing required GGUF metadata key 'general.architecture'")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    by_name = {t.name: t for t in header.tensors}
    config = _build_config(path, arch, meta, by_name)
    infos = _map_tensors(path, arch, config, header.tensors)
    return GGUFCheckpoint(
        path=path,
        config=config,
        tensors=GGUFTensors(path, by_name, infos),
        tokenizer_source=path,
        metadata=meta.scalars(),
    )


# --------------------------------------------------------------------------------------------------
# The file format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
# magic "GGUF", version u32, tensor count u64, metadata count u64, metadata (key, type, value)*,
# tensor table (name, n_dims u32, dims u64*, ggml type u32, offset u64)*, padding to the alignment, data.
# Everything little-endian. Parsed here with bounds checks, so a short file says where it ends.

_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY_TYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9
_MAX_DIMS = 4
_DECODED_STRING_ARRAY = 4096  # longer string arrays (the vocabulary, merges) are kept as a count only


@dataclass(frozen=True)
class StringArray:
    """A long string array of the metadata (e.g. tokenizer.ggml.tokens), kept as its length only."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class _Tensor:
    name: str
    type_id: int
    type_name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the contiguous (row) dimension
    data: np.ndarray | None  # a view into the memory map; None for types we do not read

    @property
    def shape(self) -> tuple[int, ...]:  # numpy / Hugging Face order
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)


@dataclass
class _Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[_Tensor]


class _Cursor:
    def __init__(self, path: Path, buf: Any, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0
        self.decode_whole = False  # read long string arrays whole instead of as a StringArray count

    def truncated(self, what: str, need: int) -> CheckpointError:
        return CheckpointError(
            f"{self.path}: file is truncated: {what} needs bytes up to offset {need}, the file has {self.size}"
        )

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise self.truncated(what, start + n)
        self.pos = start + n
        return start

    def scalar(self, type_id: int, what: str) -> Any:
        fmt = _SCALAR_FORMATS[type_id]
        value = struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]
        if type_id == _FLOAT32:  # the shortest decimal that is this float32: 1e-05, not 9.99999974e-06
            value = float(str(np.float32(value)))
        return value

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        start = self.take(n, what)
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{self.path}: {what} at offset {start} is not valid UTF-8") from exc

    def strings(self, count: int, what: str) -> list[str]:
        if count > self.size - self.pos:  # each string takes at least its 8-byte length
            raise self.truncated(what, self.pos + count)
        return [self.string(what) for _ in range(count)]

    def value(self, type_id: int, what: str) -> Any:
        if type_id in _SCALAR_FORMATS:
            return self.scalar(type_id, what)
        if type_id == _STRING:
            return self.string(what)
        if type_id != _ARRAY:
            raise CheckpointError(f"{self.path}: {what} has unknown GGUF value type {type_id}")
        item_type, count = self.u32(what), self.u64(what)
        if item_type in _NUMPY_TYPES:
            dtype = np.dtype(_NUMPY_TYPES[item_type])
            start = self.take(count * dtype.itemsize, what)
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).copy()
        if item_type == _STRING:
            if self.decode_whole:
                return self.strings(count, what)
            if count > _DECODED_STRING_ARRAY:
                for _ in range(count):  # skip, checking each length against the file
                    self.take(self.u64(what), what)
                return StringArray(count)
            return [self.string(what) for _ in range(count)]
        if item_type == _ARRAY:
            if count > self.size - self.pos:  # each element takes at least one byte
                raise self.truncated(what, self.pos + count)
            return [self.value(_ARRAY, what) for _ in range(count)]
        raise CheckpointError(f"{self.path}: {what} is an array of unknown GGUF value type {item_type}")


def read_gguf_metadata(path: str | os.PathLike, *, decode: Container[str] = ()) -> dict[str, Any]:
    """The metadata of a GGUF file (its tensor table is not read), with the string arrays named in `decode`
    read whole; other long string arrays are `StringArray` counts, numeric arrays numpy arrays."""
    path = Path(path)
    cur = _open(path)
    try:
        return _read_metadata(cur, decode)[2]
    finally:
        cur.buf.close()


def _open(path: Path) -> _Cursor:
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        magic = f.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, expected b'GGUF')")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after the file is closed
    return _Cursor(path, buf, size)


def _read_metadata(cur: _Cursor, decode: Container[str] = ()) -> tuple[int, int, dict[str, Any]]:
    """(version, tensor count, metadata), leaving the cursor at the tensor table."""
    path, size = cur.path, cur.size
    cur.take(4, "magic")
    version = cur.u32("the version")
    if version & 0xFFFF == 0 and version != 0:
        raise CheckpointError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    if n_tensors > size or n_kv > size:
        raise CheckpointError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        type_id = cur.u32(f"metadata {key!r}")
        if key in metadata:
            raise CheckpointError(f"{path}: duplicate metadata key {key!r}")
        cur.decode_whole = key in decode
        try:
            metadata[key] = cur.value(type_id, f"metadata {key!r}")
        finally:
            cur.decode_whole = False
    return version, n_tensors, metadata


def _parse(path: Path) -> _Header:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _open(path)
    buf, size = cur.buf, cur.size
    version, n_tensors, metadata = _read_metadata(cur)

    table = []
    for i in range(n_tensors):
        name = cur.string(f"tensor #{i} name")
        n_dims = cur.u32(f"tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise CheckpointError(f"{path}: tensor {name!r} has {n_dims} dimensions; corrupt tensor table")
        dims = tuple(cur.u64(f"tensor {name!r}") for _ in range(n_dims))
        type_id = cur.u32(f"tensor {name!r}")
        offset = cur.u64(f"tensor {name!r}")
        table.append((name, dims, type_id, offset))

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: invalid general.alignment {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment

    tensors: list[_Tensor] = []
    seen: set[str] = set()
    for name, dims, type_id, offset in table:
        if name in seen:
            raise CheckpointError(f"{path}: duplicate tensor {name!r}")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            tensors.append(_Tensor(name, type_id, f"unknown type id {type_id}", dims, None))
            continue
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise CheckpointError(
                f"{path}: tensor {name!r} has rows of {dims[0]} values, not a multiple of the "
                f"{qtype.name} block of {block}"
            )
        n_bytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise cur.truncated(
                f"tensor {name!r} ({qtype.name}, shape {list(reversed(dims))})", start + n_bytes
            )
        if qtype.name == "F32":
            data = np.frombuffer(buf, np.float32, math.prod(dims), start)
        elif qtype.name == "F16":
            data = np.frombuffer(buf, np.float16, math.prod(dims), start)
        else:  # block types (BF16 too): rows of bytes, as gguf.quants.dequantize takes them
            data = np.frombuffer(buf, np.uint8, n_bytes, start)
            dims_bytes = (dims[0] // block * type_size, *dims[1:])
            data = data.reshape(tuple(reversed(dims_bytes)))
        if qtype.name in ("F32", "F16"):
            data = data.reshape(tuple(reversed(dims)))
        tensors.append(_Tensor(name, type_id, qtype.name, dims, data))
    return _Header(version, metadata, tensors)


class _Metadata:
    def __init__(self, path: Path, values: dict[str, Any]):
        self.path = path
        self.values = values

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key, default)
        if isinstance(value, np.ndarray):
            return value.tolist()
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: missing required GGUF metadata key {key!r}")
        return value

    def int(self, key: str, default: int | None = None, *, required: bool = False) -> int | None:
        value = self.require(key) if required else self.get(key, default)
        if value is None:
            return None
        if isinstance(value, list):  # per-layer values (e.g. head counts): must all agree here
            if not value or any(v != value[0] for v in value):
                raise CheckpointError(
                    f"{self.path}: GGUF metadata {key!r} varies per layer ({value}); not supported"
                )
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} should be an integer, got {value!r}")
        return int(value)

    def float(self, key: str, default: float | None = None, *, required: bool = False) -> float | None:
        value = self.require(key) if required else self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} should be a number, got {value!r}")
        return float(value)

    def array_len(self, key: str) -> int | None:
        value = self.values.get(key)
        return None if value is None or isinstance(value, str | int | float) else len(value)

    def scalars(self) -> dict[str, Any]:
        return {k: v for k, v in self.values.items() if isinstance(v, str | int | float | bool)}


def _build_config(path: Path, arch: str, meta: _Metadata, by_name: dict) -> dict[str, Any]:
    model_type, architecture = SUPPORTED_ARCHITECTURES[arch]
    name = str(meta.get("general.name") or "") + " " + str(meta.get("general.basename") or "")
    if arch == "llama" and "mistral" in name.lower():
        model_type, architecture = _MISTRAL  # llama.cpp converts Mistral to the llama architecture

    hidden = meta.int(f"{arch}.embedding_length", required=True)
    n_layers = meta.int(f"{arch}.block_count", required=True)
    n_heads = meta.int(f"{arch}.attention.head_count", required=True)
    n_kv_heads = meta.int(f"{arch}.attention.head_count_kv", n_heads)
    intermediate = meta.int(f"{arch}.feed_forward_length", required=True)
    eps = meta.float(f"{arch}.attention.layer_norm_rms_epsilon", required=True)
    context = meta.int(f"{arch}.context_length", required=True)
    rope_theta = meta.float(f"{arch}.rope.freq_base", 10000.0)
    if min(hidden, n_layers, n_heads, n_kv_heads, intermediate, context) <= 0:
        raise CheckpointError(f"{path}: GGUF metadata has a non-positive model dimension")
    if n_heads % n_kv_heads:
        raise CheckpointError(f"{path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    head_dim = meta.int(f"{arch}.attention.key_length", None)
    if head_dim is None:
        if hidden % n_heads:
            raise CheckpointError(
                f"{path}: embedding_length {hidden} is not a multiple of head_count {n_heads}"
            )
        head_dim = hidden // n_heads
    value_dim = meta.int(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise CheckpointError(
            f"{path}: attention key_length {head_dim} != value_length {value_dim}; not supported"
        )
    rope_dim = meta.int(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise CheckpointError(
            f"{path}: partial rotary embedding (rope.dimension_count {rope_dim} < head_dim {head_dim}) "
            "is not supported"
        )

    embd = by_name.get("token_embd.weight")
    if embd is None:
        raise CheckpointError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = embd.shape[0] if len(embd.shape) == 2 else None
    declared_vocab = meta.int(f"{arch}.vocab_size", None)
    if declared_vocab is None:
        declared_vocab = meta.array_len("tokenizer.ggml.tokens")
    if vocab is None or (declared_vocab is not None and declared_vocab != vocab):
        raise CheckpointError(
            f"{path}: tensor 'token_embd.weight' has shape {list(embd.shape)}, "
            f"expected [{declared_vocab}, {hidden}]"
        )

    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "max_position_embeddings": context,
        "tie_word_embeddings": "output.weight" not in by_name,
    }
    if model_type in ("llama", "mistral"):
        has_bias = any(_LAYER_RE.match(n) and n.endswith(".bias") for n in by_name)
        config["attention_bias"] = has_bias
        config["mlp_bias"] = False
    if model_type == "mistral":
        config["sliding_window"] = None
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    if model_type == "qwen3":
        config["attention_bias"] = False

    bos = meta.int("tokenizer.ggml.bos_token_id", None)
    eos = meta.int("tokenizer.ggml.eos_token_id", None)
    stops = [eos] if eos is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = meta.int(key, None)
        if extra is not None and extra not in stops:
            stops.append(extra)
    config["bos_token_id"] = bos
    config["eos_token_id"] = stops[0] if len(stops) == 1 else (stops or None)
    pad = meta.int("tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        config["pad_token_id"] = pad

    rope_scaling = _rope_scaling(path, arch, meta, by_name, rope_theta, head_dim)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(path: Path, arch: str, meta: _Metadata, by_name: dict, theta: float, head_dim: int):
    kind = meta.get(f"{arch}.rope.scaling.type")
    orig_ctx = meta.int(f"{arch}.rope.scaling.original_context_length", None)
    freqs_tensor = by_name.get(_ROPE_FREQS)
    if freqs_tensor is not None:
        if kind not in (None, "none"):
            raise CheckpointError(
                f"{path}: both rope_freqs.weight and rope.scaling.type {kind!r}; not supported"
            )
        if freqs_tensor.type_name != "F32" or freqs_tensor.n_elements != head_dim // 2:
            raise CheckpointError(
                f"{path}: tensor 'rope_freqs.weight' should be F32 with {head_dim // 2} values, got "
                f"{freqs_tensor.type_name} with {freqs_tensor.n_elements}"
            )
        factors = np.asarray(freqs_tensor.data, dtype=np.float64).reshape(-1)
        return _llama3_from_rope_freqs(path, factors, theta, head_dim, orig_ctx)
    if kind in (None, "none"):
        return None
    factor = meta.float(f"{arch}.rope.scaling.factor", required=True)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        if orig_ctx is not None:
            scaling["original_max_position_embeddings"] = orig_ctx
        return scaling
    raise CheckpointError(f"{path}: unsupported rope scaling type {kind!r}")


def _llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, orig: float):
    """Per-frequency divisors, as llama.cpp's converter computes them for Llama 3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _llama3_from_rope_freqs(path: Path, rf: np.ndarray, theta: float, head_dim: int, orig_ctx: int | None):
    """Recover Hugging Face llama3 `rope_scaling` from llama.cpp's rope_freqs tensor.

    The tensor only fixes the frequencies, not the parameters: scaling `original_max_position_embeddings`,
    `low_freq_factor` and `high_freq_factor` together gives the same tensor, so we keep the original context
    at 8192 (what llama.cpp assumes) and solve for the two factors; the result is checked to reproduce
    the tensor.
    """
    if not np.all(np.isfinite(rf)) or np.any(rf <= 0):
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' has non-positive or non-finite values")
    if np.allclose(rf, 1.0, rtol=1e-6, atol=0):
        return None
    orig = float(orig_ctx or _LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
    factor = float(rf.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = orig * inv_freq / (2 * math.pi)  # orig / wavelength, decreasing along the tensor
    is_high = np.isclose(rf, 1.0, rtol=1e-5, atol=0)
    is_low = np.isclose(rf, factor, rtol=1e-5, atol=0)
    mid = ~(is_high | is_low)
    x_low_max = float(x[is_low].max()) if is_low.any() else None  # low frequencies: x < low_freq_factor
    x_high_min = float(x[is_high].min()) if is_high.any() else None  # high frequencies: x > high_freq_factor

    candidates = [(1.0, 4.0)]  # Llama 3.1 / 3.2 values
    if mid.sum() >= 2:
        smooth = (1 / rf[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(x[mid], smooth, 1)
        if slope > 0:
            low = -intercept / slope
            candidates.append((low, low + 1 / slope))
    elif mid.sum() == 1:
        xm = float(x[mid][0])
        s = float((1 / rf[mid][0] - 1 / factor) / (1 - 1 / factor))
        if 0 < s < 1:
            lo_gap = xm - x_low_max if x_low_max is not None else math.inf
            hi_gap = (x_high_min - xm) * s / (1 - s) if x_high_min is not None else math.inf
            delta = 0.5 * min(lo_gap, hi_gap) if min(lo_gap, hi_gap) < math.inf else 0.5 * xm
            low = xm - delta
            candidates.append((low, low + delta / s))
    else:
        lo = x_low_max if x_low_max is not None else 0.0
        hi = x_high_min if x_high_min is not None else (lo + 1.0) * 4
        candidates.append((lo + (hi - lo) / 3, lo + 2 * (hi - lo) / 3))

    for low, high in candidates:
        if not (0 < low < high):
            continue
        if np.allclose(_llama3_factors(theta, head_dim, factor, low, high, orig), rf, rtol=1e-4, atol=1e-6):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": float(low),
                "high_freq_factor": float(high),
                "original_max_position_embeddings": int(orig),
            }
    raise CheckpointError(
        f"{path}: tensor 'rope_freqs.weight' does not match Llama 3 rope scaling; not supported"
    )


def _map_tensors(path: Path, arch: str, config: dict, tensors) -> dict[str, GGUFTensorInfo]:
    n_layers = config["num_hidden_layers"]
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n_heads, n_kv, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    q_out, kv_out = n_heads * head_dim, n_kv * head_dim
    expected_shape = {  # in the order of a Hugging Face state dict
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.q_proj.bias": (q_out,),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.k_proj.bias": (kv_out,),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.bias": (kv_out,),
        "self_attn.o_proj.weight": (hidden, q_out),
        "self_attn.o_proj.bias": (hidden,),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    global_shape = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    permute = arch == "llama"  # llama.cpp interleaves q/k rows of this architecture only

    found: dict[str, GGUFTensorInfo] = {}
    for t in tensors:
        if t.name == _ROPE_FREQS:
            continue  # folded into config["rope_scaling"]
        if t.name in _GLOBAL_TENSORS:
            hf_name = _GLOBAL_TENSORS[t.name]
            shape = global_shape[hf_name]
            layer_key = None
        else:
            m = _LAYER_RE.match(t.name)
            kind = _LAYER_TENSORS.get(m.group(2)) if m else None
            if m is None or kind is None:
                raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for architecture {arch!r}")
            layer = int(m.group(1))
            if layer >= n_layers:
                raise CheckpointError(f"{path}: tensor {t.name!r} is beyond block_count {n_layers}")
            layer_key = f"{kind}.{m.group(3)}"
            if layer_key not in expected_shape:
                raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for architecture {arch!r}")
            hf_name = f"model.layers.{layer}.{layer_key}"
            shape = expected_shape[layer_key]
        gguf_shape = t.shape
        if gguf_shape != shape:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} ({hf_name}) has shape {list(gguf_shape)}, expected {list(shape)} "
                "from the metadata"
            )
        if t.type_name not in SUPPORTED_TENSOR_TYPES:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} has unsupported GGML type {t.type_name} "
                f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
            )
        heads = None
        if permute and layer_key in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            heads = n_heads
        elif permute and layer_key in ("self_attn.k_proj.weight", "self_attn.k_proj.bias"):
            heads = n_kv
        if heads is not None and shape[0] % (2 * heads):
            raise CheckpointError(
                f"{path}: tensor {t.name!r} rows {shape[0]} do not split into {heads} heads"
            )
        found[hf_name] = GGUFTensorInfo(hf_name, t.name, t.type_name, shape, heads)

    required = {
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    optional: set[str] = set()
    if arch == "qwen2":
        required |= {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    elif arch == "qwen3":
        required |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    elif config.get("attention_bias"):
        required |= {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
        optional.add("self_attn.o_proj.bias")

    order = ["model.embed_tokens.weight"]
    for i in range(n_layers):  # each layer in the order of a Hugging Face state dict
        for key in expected_shape:
            name = f"model.layers.{i}.{key}"
            if key in required or (key in optional and name in found):
                order.append(name)
    order += ["model.norm.weight"]
    if not config["tie_word_embeddings"]:
        order.append("lm_head.weight")
    missing = [n for n in order if n not in found]
    if missing:
        raise CheckpointError(
            f"{path}: missing tensors for architecture {arch!r}: {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    extra = sorted(set(found) - set(order))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors for architecture {arch!r}: {', '.join(extra[:5])}")
    return {name: found[name] for name in order}


# --------------------------------------------------------------------------------------------------
# Dequantization


def _dequantize(path: Path, tensor: _Tensor) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        if tensor.type_name in ("F32", "F16"):
            return tensor.data.astype(np.float32)  # a copy out of the memory map
        out = dequantize(tensor.data, GGMLQuantizationType(tensor.type_id))
        return np.asarray(out, dtype=np.float32)
    except Exception as exc:
        raise CheckpointError(
            f"{path}: cannot dequantize tensor {tensor.name!r} of type {tensor.type_name}: {exc}"
        ) from exc


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows [r0, r_half, r1, r_half+1, ...] -> [r0, r1, ...].

    llama.cpp maps the Hugging Face rows of each head (first half, second half) to interleaved pairs;
    the inverse views them as (heads, head_dim/2, 2) and swaps the last two axes back.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


# --------------------------------------------------------------------------------------------------
# Tokenizer


def load_gguf_tokenizer(path: str | os.PathLike):
    """A transformers fast tokenizer with the chat template, from the GGUF's `tokenizer.*` metadata.

    Built without torch from the vocabulary, merges and token types of the file (`gguf_tokenizer.py`).
    `chat_template` is the file's `tokenizer.chat_template`, or None when the file has none (a base model).
    """
    from .tokenizer import load_gguf_tokenizer as build

    return build(path)
