"""The architecture registry: a new family is one module + one registration; an unknown one fails clearly."""

import json
import shutil

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import vsurge
from vsurge.models import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    LlamaForCausalLM,
    ModelConfig,
    architecture_for,
    build_model,
    gguf,
    register_architecture,
    registry,
    supported_architectures,
)
from vsurge.models.reference import logits
from vsurge.models.sharding import LLAMA_RULES, PARTITION_RULES

BUILTIN = ("llama", "mistral", "qwen2", "qwen3")


class TinyFamForCausalLM(LlamaForCausalLM):
    """A trivial new family: the Llama model under a model_type of its own."""


# Like LLAMA_RULES, but the MLP is split the other way round (row-parallel gate/up), so the test can see
# that the family's own rules are the ones applied.
TINYFAM_RULES = (
    (r"mlp/(gate|up)_proj/kernel$", P("tp", None)),
    *LLAMA_RULES,
)


@pytest.fixture
def tinyfam():
    (arch,) = register_architecture(
        "tinyfam", TinyFamForCausalLM, TINYFAM_RULES, gguf_architecture="tinyfam-gguf"
    )
    yield arch
    registry.unregister_architecture("tinyfam")


@pytest.fixture
def checkpoints(tiny_checkpoint, tmp_path):
    """(the tiny llama checkpoint, a copy of it whose config names model_type 'tinyfam')."""
    src, _ = tiny_checkpoint("llama")
    dst = tmp_path / "tinyfam"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "tinyfam", ["TinyFamForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return src, dst


def test_builtin_families():
    assert supported_architectures()[:4] == BUILTIN
    assert tuple(SUPPORTED_ARCHITECTURES)[:4] == BUILTIN
    for name in BUILTIN:
        arch = architecture_for(name)
        assert arch.model_cls is LlamaForCausalLM and arch.partition_rules == LLAMA_RULES
        assert PARTITION_RULES[name] == LLAMA_RULES
    assert architecture_for("qwen2").qkv_bias and architecture_for("qwen3").qk_norm
    assert dict(gguf.SUPPORTED_ARCHITECTURES) == {
        "llama": ("llama", "LlamaForCausalLM"),
        "qwen2": ("qwen2", "Qwen2ForCausalLM"),
        "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    }


def test_registered_family_loads_through_the_loader(tinyfam, checkpoints):
    src, dst = checkpoints
    assert "tinyfam" in SUPPORTED_ARCHITECTURES and PARTITION_RULES["tinyfam"] == TINYFAM_RULES
    assert gguf.SUPPORTED_ARCHITECTURES["tinyfam-gguf"] == ("tinyfam", "TinyFamForCausalLM")

    model, tok = vsurge.load_model(dst)
    assert type(model) is TinyFamForCausalLM
    assert model.config.model_type == "tinyfam"
    assert tok is not None

    ref, _ = vsurge.load_model(src)
    assert type(ref) is LlamaForCausalLM
    ids = np.array([[1, 5, 9, 17, 33, 2]], np.int32)
    np.testing.assert_array_equal(logits(model, ids), logits(ref, ids))


def test_registered_family_uses_its_partition_rules(tinyfam, checkpoints):
    _, dst = checkpoints
    model, _ = vsurge.load_model(dst, mesh="tp=2")
    gate = model.model.layers[0].mlp.gate_proj.kernel.get_value()
    q = model.model.layers[0].self_attn.q_proj.kernel.get_value()
    assert gate.sharding.spec == P("tp", None)  # the family's rule
    assert q.sharding.spec == P(None, "tp")  # LLAMA_RULES, after it


def test_unknown_architecture_names_the_supported_ones(checkpoints):
    _, dst = checkpoints  # model_type 'tinyfam', not registered here
    with pytest.raises(CheckpointError) as e:
        vsurge.load_model(dst)
    msg = str(e.value)
    assert "config.json: unsupported architecture ['TinyFamForCausalLM'] (model_type='tinyfam')" in msg
    assert "supported: llama, mistral, qwen2, qwen3" in msg
    assert "tinyfam" not in SUPPORTED_ARCHITECTURES and "tinyfam" not in PARTITION_RULES

    with pytest.raises(CheckpointError, match=r"^unsupported architecture 'gpt2'.*supported: llama, mistral"):
        architecture_for("gpt2")


def test_build_model_looks_the_family_up():
    cfg = ModelConfig(
        model_type="nope",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    with pytest.raises(CheckpointError, match=r"^my\.ckpt: unsupported architecture 'nope'"):
        build_model(cfg, {}, source="my.ckpt")


def test_registering_twice_is_refused(tinyfam):
    with pytest.raises(ValueError, match="already registered"):
        register_architecture("tinyfam", TinyFamForCausalLM, LLAMA_RULES)
    with pytest.raises(ValueError, match="GGUF architecture 'llama' is already read as 'llama'"):
        register_architecture("other", TinyFamForCausalLM, LLAMA_RULES, gguf_architecture="llama")
    assert "other" not in SUPPORTED_ARCHITECTURES
    (again,) = register_architecture("tinyfam", TinyFamForCausalLM, LLAMA_RULES, replace=True)
    assert architecture_for("tinyfam") is again
