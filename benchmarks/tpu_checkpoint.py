"""Random-weight checkpoints of real model shapes, written as a user's would be: Hugging Face config.json,
bf16 safetensors shards and a byte-level BPE tokenizer.json, for `vsurge.load_model` to read.

    python benchmarks/tpu_bench.py checkpoint 1b64 /tmp/ckpt-1b64

The weights are N(0, 0.02) blocks tiled over each tensor (fast to write: a 16 GB 8B checkpoint is disk
speed, not random-number speed); norms are ones. The tokenizer has the model's whole vocabulary (256 byte
symbols, then merges of earlier tokens), so every id a random model emits detokenizes as it would with a
real Llama tokenizer, at a real tokenizer's cost.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

# Hugging Face configs of the shapes the TPU benchmark runs (random weights: only the shapes matter)
SHAPES: dict[str, dict[str, Any]] = {
    "1b64": dict(  # Llama-3.2-1B
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "1b128": dict(  # the same sizes with 16 heads of 128
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "8b": dict(  # Llama-3.1-8B
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "tinyvocab": dict(  # the host's work at a real vocabulary: a model too small to keep a CPU busy
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=2048,
        tie_word_embeddings=True,
    ),
}
SHARD_BYTES = 2 << 30
# weights' scale: real shapes at 0.02; the correctness model larger, so its greedy tokens vary (at 0.02 a
# tiny model repeats one token, and every path would agree on it)
WEIGHT_STD = {"tiny": 0.25}


def hf_config(shape: str) -> dict[str, Any]:
    base = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
    )
    return {**base, **SHAPES[shape]}


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes ([out, in] for linear weights)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nh, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (nh * hd, h),
                p + "self_attn.k_proj.weight": (kv * hd, h),
                p + "self_attn.v_proj.weight": (kv * hd, h),
                p + "self_attn.o_proj.weight": (h, nh * hd),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
    out["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    return out


def _filled(shape: tuple[int, ...], block: np.ndarray) -> np.ndarray:
    import ml_dtypes

    if len(shape) == 1:
        return np.ones(shape, ml_dtypes.bfloat16)
    n = int(np.prod(shape))
    reps = -(-n // block.size)
    return np.tile(block, reps)[:n].reshape(shape)


def write_weights(directory: str, cfg: dict[str, Any], seed: int = 0, std: float = 0.02) -> int:
    """bf16 safetensors shards of at most SHARD_BYTES and their index; returns the bytes written."""
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    block = (std * rng.standard_normal(1 << 22)).astype(ml_dtypes.bfloat16)
    shapes = tensor_shapes(cfg)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = _filled(shape, np.roll(block, len(name)))
        size += nbytes
    index, total = {}, 0
    for k, tensors in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        index.update(dict.fromkeys(tensors, fname))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
    return total


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what byte-level BPE vocabularies are made of)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def write_tokenizer(directory: str, vocab_size: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer.json of exactly ``vocab_size`` ids: the 256 byte symbols, then tokens
    made by merging two earlier ones (each merge listed), and the special tokens <s> (0) and </s> (1)."""
    rng = np.random.default_rng(seed)
    symbols = _byte_symbols()
    letters = [symbols[b] for b in b"etaoinshrdlucmfwypvbgkjqxz ETAOINSHRDLU.,"]
    tokens: list[str] = ["<s>", "</s>"] + symbols
    seen = set(tokens)
    merges: list[list[str]] = []
    pool = list(letters)
    while len(tokens) < vocab_size:
        a = pool[int(rng.integers(len(pool)))]
        b = letters[int(rng.integers(len(letters)))]
        t = a + b
        if t in seen or len(t) > 12:
            continue
        seen.add(t)
        tokens.append(t)
        merges.append([a, b])
        pool.append(t)
    spec = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in enumerate(tokens[:2])
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
            },
            f,
        )


# a chat template as a user's checkpoint has one: the serving benchmark (serving.py --serve) sends chat
# requests through the server, and vLLM refuses a chat request without a template
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_checkpoint(shape: str, directory: str, seed: int = 0) -> int:
    """The whole checkpoint directory (skipped when one of the same shape is already there)."""
    os.makedirs(directory, exist_ok=True)
    cfg = hf_config(shape)
    marker = os.path.join(directory, "config.json")
    if os.path.exists(marker):
        with open(marker) as f:
            same = json.load(f) == cfg
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            if same and "chat_template" in json.load(f):  # one written before the template: rewritten
                return 0
    write_tokenizer(directory, cfg["vocab_size"], seed)
    total = write_weights(directory, cfg, seed, WEIGHT_STD.get(shape, 0.02))
    with open(marker, "w") as f:
        json.dump(cfg, f)
    return total
