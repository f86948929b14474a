"""GGUF tensors -> Hugging Face parameter names and shapes, dequantized to float32 on access.

llama.cpp's converter interleaves the rows of the q/k projections of the `llama` architecture (for its
rotary kernel); this module undoes it, so the weights are exactly the Hugging Face ones.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vsurge.models.errors import CheckpointError
from vsurge.models.registry import architecture_for

from .reader import _Tensor

__all__ = ["SUPPORTED_TENSOR_TYPES", "GGUFTensorInfo", "GGUFTensors"]

# GGML tensor types this reader dequantizes (numpy, through the `gguf` package).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

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

    def int8_blocks(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """A Q8_0 tensor as it is stored, for int8 serving (models/quantization.py): (q int8 [rows, cols],
        scale float32 [rows, cols / 32]) in the Hugging Face shape, rows un-permuted like `self[name]`;
        None for any other type (those are dequantized, then quantized per channel)."""
        info = self.info[name]
        if info.ggml_type != "Q8_0" or len(info.shape) != 2:
            return None
        q, scale = _q8_0_blocks(self._by_gguf_name[info.gguf_name].data, info.shape)
        if info.unpermute_heads is not None:
            q, scale = _unpermute_rows(q, info.unpermute_heads), _unpermute_rows(scale, info.unpermute_heads)
        return q, scale

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
    family = architecture_for(config["model_type"])
    if family.qkv_bias:  # qwen2
        required |= {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    elif family.qk_norm:  # qwen3
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


_Q8_0_BLOCK = 32  # values per block; each block is an f16 scale then 32 int8 values (34 bytes)


def _q8_0_blocks(data: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = shape
    blocks = np.asarray(data).reshape(rows, cols // _Q8_0_BLOCK, 2 + _Q8_0_BLOCK)
    scale = blocks[:, :, :2].copy().view(np.float16).reshape(rows, cols // _Q8_0_BLOCK)
    q = blocks[:, :, 2:].copy().view(np.int8).reshape(rows, cols)
    return q, scale.astype(np.float32)


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows [r0, r_half, r1, r_half+1, ...] -> [r0, r1, ...].

    llama.cpp maps the Hugging Face rows of each head (first half, second half) to interleaved pairs;
    the inverse views them as (heads, head_dim/2, 2) and swaps the last two axes back.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))
