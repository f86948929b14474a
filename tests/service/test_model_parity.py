"""Our JAX models against transformers (PyTorch CPU) on the same random weights."""

import contextlib
import json
import os

import jax
import numpy as np
import pytest
import torch

import vsurge
from vsurge.models import ModelConfig, greedy_by_recompute, greedy_generate, logits

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "tied"]
PROMPTS = [
    [5, 17, 42, 99, 3, 250, 7],
    [11, 12],
    [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210],
    [64],
]


def hf_greedy(hf, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_checkpoint, arch):
    path, hf = tiny_checkpoint(arch)
    model, _ = vsurge.load_model(path, dtype="float32")
    ids = np.random.RandomState(1).randint(0, 320, (3, 24))
    ours = logits(model, ids)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert ours.shape == ref.shape == (3, 24, 320)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, f"{arch}: relative error {rel}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_32_tokens_match_transformers(tiny_checkpoint, arch):
    path, hf = tiny_checkpoint(arch)
    model, _ = vsurge.load_model(path)
    expected = [hf_greedy(hf, p, 32) for p in PROMPTS]
    cached = greedy_generate(model, PROMPTS, 32)  # one right-padded batch of different lengths
    assert cached == expected
    assert greedy_by_recompute(model, PROMPTS[0], 32) == expected[0]


def test_padding_does_not_change_logits(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen2")
    model, _ = vsurge.load_model(path)
    short = [3, 9, 27, 81]
    alone = logits(model, [short])[0]
    padded = np.array([short + [0] * 6, list(range(10))])
    batched = logits(model, padded, lengths=[4, 10])[0, :4]
    np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-5)


def test_bfloat16_follows_float32(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    f32, _ = vsurge.load_model(path, dtype="float32")
    bf16, _ = vsurge.load_model(path, dtype="bfloat16")
    assert str(bf16.model.layers[0].self_attn.q_proj.kernel[...].dtype) == "bfloat16"
    ids = np.arange(1, 17)[None]
    a, b = logits(f32, ids), logits(bf16, ids)
    assert np.abs(a - b).max() / np.abs(a).max() < 5e-2


def test_both_config_layouts_give_one_config(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    with open(os.path.join(path, "config.json")) as f:
        nested = json.load(f)
    assert "rope_parameters" in nested  # transformers 5 layout
    flat = {k: v for k, v in nested.items() if k != "rope_parameters"}
    rope = dict(nested["rope_parameters"])
    flat["rope_theta"] = rope.pop("rope_theta")
    flat["rope_scaling"] = rope
    a, b = ModelConfig.from_hf(nested), ModelConfig.from_hf(flat)
    assert a == b
    assert a.rope_theta == 500000.0 and a.rope_params["rope_type"] == "llama3"


def test_sharded_checkpoint_with_index(tiny_checkpoint, tmp_path):
    _, hf = tiny_checkpoint("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = vsurge.load_model(tmp_path)
    ids = np.arange(5, 20)[None]
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(logits(model, ids) - ref).max() / np.abs(ref).max() < 1e-4


def test_the_forward_traces_one_layer_and_inlines_it_for_every_layer(tiny_checkpoint, monkeypatch):
    """Every decoder layer has the same shapes: the forward traces the layer once (a warm start lowers
    every program before it can read the persistent cache, and tracing each layer again made that most of
    the start) and inlines its equations per layer, so the program is the unrolled stack, for this
    process and for a TPU alike (a call per layer, which XLA inlines too, ran a TPU decode step 3-4%
    slower: models/llama.py)."""
    from flax import nnx

    from vsurge.models import llama, tpu_lowering
    from vsurge.models.reference import _decode

    path, _ = tiny_checkpoint("llama")
    model, _ = vsurge.load_model(path)
    layers = model.config.num_layers
    assert layers >= 2
    graphdef, state = nnx.split(model)
    caches = [
        (np.zeros((2, 16, model.config.num_kv_heads * model.config.head_dim), np.float32),) * 2
        for _ in range(layers)
    ]
    args = (graphdef, state, caches, np.zeros(2, np.int32), np.zeros(2, np.int32))
    traced = []
    real = llama.DecoderLayer.__call__
    monkeypatch.setattr(llama.DecoderLayer, "__call__", lambda self, *a: traced.append(1) or real(self, *a))

    def lowered() -> str:
        traced.clear()
        return jax.jit(_decode.__wrapped__, static_argnums=0).lower(*args).as_text()

    for target in (contextlib.nullcontext(), tpu_lowering.targeting("v5e")):
        with target:
            text = lowered()
        assert len(traced) == 1, traced  # one trace of the layer for all of them
        assert "@apply" not in text and "func.func private @_one" not in text  # no call per layer
        assert text.count("stablehlo.rsqrt") == 2 * layers + 1  # each layer's two norms and the final one
