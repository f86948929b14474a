"""Bad checkpoints raise CheckpointError naming the file and the problem."""

import json
import os
import shutil

import pytest

import vsurge
from vsurge.models import CheckpointError


@pytest.fixture
def ckpt_copy(tiny_checkpoint, tmp_path):
    src, _ = tiny_checkpoint("llama")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_missing_config(ckpt_copy):
    os.remove(ckpt_copy / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json.*missing|missing config\.json"):
        vsurge.load_model(ckpt_copy)


def test_unsupported_architecture(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported architecture.*GPT2LMHeadModel"):
        vsurge.load_model(ckpt_copy)


def test_truncated_safetensors(ckpt_copy):
    f = ckpt_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        vsurge.load_model(ckpt_copy)


def test_shape_does_not_match_config(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape",
    ):
        vsurge.load_model(ckpt_copy)


def test_missing_tensor(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\."):
        vsurge.load_model(ckpt_copy)


def test_no_such_source(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        vsurge.load_model(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a model directory or a .gguf file"):
        vsurge.load_model(tmp_path / "weights.bin")
