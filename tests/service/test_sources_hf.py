"""hf:// model sources: the real huggingface_hub client against a local Hub fixture server (HF_ENDPOINT)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sources_servers import complete_revisions, same_logits

import vsurge
from vsurge.models.sources import ModelSourceError, download_bytes, resolve

EXTRA = {"README.md": b"# tiny", "pytorch_model.bin": b"\0" * 5000, "onnx/model.onnx": b"\1" * 3000}


def test_hub_checkpoint_matches_disk_and_fetches_only_what_it_needs(hub, sharded_ckpt, tmp_path):
    sha = hub.add_repo("acme/tiny-llama", sharded_ckpt, EXTRA)
    remote, tok = vsurge.load_model("hf://acme/tiny-llama")
    local, _ = vsurge.load_model(sharded_ckpt)
    assert same_logits(remote, local) == 0.0 and tok is not None
    assert set(hub.gets) == {p.name for p in sharded_ckpt.iterdir()}  # no README, .bin or onnx/
    (rev,) = complete_revisions(tmp_path / "cache")
    assert rev.name == sha  # cached under the commit the revision resolved to
    n = len(hub.gets)
    pinned, _ = vsurge.load_model(f"hf://acme/tiny-llama@{sha}")
    assert len(hub.gets) == n and same_logits(pinned, local) == 0.0  # same commit: from the cache


def test_unknown_repo_and_revision(hub, sharded_ckpt):
    hub.add_repo("acme/tiny", sharded_ckpt)
    with pytest.raises(ModelSourceError, match=r"^hf://acme/nope: repository not found \(404.*set HF_TOKEN"):
        vsurge.load_model("hf://acme/nope")
    with pytest.raises(ModelSourceError, match=r"^hf://acme/tiny@v9: revision not found \(404"):
        vsurge.load_model("hf://acme/tiny@v9")


def test_private_repo_needs_hf_token(hub, sharded_ckpt, monkeypatch):
    hub.add_repo("acme/private", sharded_ckpt)
    hub.private["acme/private"] = "hf_secret"
    with pytest.raises(ModelSourceError, match=r"^hf://acme/private: "):
        resolve("hf://acme/private")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert resolve("hf://acme/private")


def test_cut_transfer_is_retried_and_verified(hub, sharded_ckpt):
    """The server closes the connection halfway through a shard once: the range is fetched again."""
    hub.add_repo("acme/flaky", sharded_ckpt)
    shard = sorted(p.name for p in sharded_ckpt.glob("model-*.safetensors"))[0]
    hub.truncate[shard] = 1
    path = resolve("hf://acme/flaky")
    assert hub.gets.count(shard) == 2
    assert Path(path, shard).read_bytes() == (sharded_ckpt / shard).read_bytes()


def test_transfer_cut_every_time_is_a_clear_error(hub, sharded_ckpt, tmp_path):
    hub.add_repo("acme/broken", sharded_ckpt)
    shard = sorted(p.name for p in sharded_ckpt.glob("model-*.safetensors"))[0]
    hub.truncate[shard] = 100
    with pytest.raises(ModelSourceError, match=rf"^hf://acme/broken: .*{shard}"):
        resolve("hf://acme/broken")
    assert complete_revisions(tmp_path / "cache") == []


def test_corrupt_bytes_fail_sha256(hub, sharded_ckpt, tmp_path):
    hub.add_repo("acme/corrupt", sharded_ckpt)
    shard = sorted(p.name for p in sharded_ckpt.glob("model-*.safetensors"))[-1]
    hub.corrupt.add(shard)
    with pytest.raises(
        ModelSourceError, match=rf"^hf://acme/corrupt: {shard}: sha256 [0-9a-f]+ does not match"
    ):
        resolve("hf://acme/corrupt")
    assert complete_revisions(tmp_path / "cache") == []
    (staging,) = (tmp_path / "cache").glob("models/*/*.partial")
    kept = {p.name: p.stat().st_size for p in staging.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert shard not in kept and not any(n.endswith(".part") and n.startswith(shard) for n in kept)
    hub.corrupt.clear()  # the next attempt fetches the bad file again, and only the files not yet verified
    before = download_bytes()["hf"]
    path = resolve("hf://acme/corrupt")
    total = sum(p.stat().st_size for p in sharded_ckpt.iterdir())
    verified = sum(size for name, size in kept.items() if not name.endswith((".part", ".part.json")))
    assert download_bytes()["hf"] - before == total - verified
    assert Path(path, shard).read_bytes() == (sharded_ckpt / shard).read_bytes()


def test_hf_source_syntax_errors():
    with pytest.raises(ModelSourceError, match=r"^hf://justone: expected hf://ORG/NAME"):
        resolve("hf://justone")
    with pytest.raises(ModelSourceError, match=r"^hf://a/b@: empty revision"):
        resolve("hf://a/b@")
