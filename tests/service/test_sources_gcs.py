"""gs:// model sources against fake-gcs-server (a real GCS JSON-API server) through google-cloud-storage."""

from __future__ import annotations

from pathlib import Path

import pytest
from sources_servers import complete_revisions, gcs_upload_dir, same_logits

import vsurge
from vsurge.models.sources import ModelSourceError, download_bytes, resolve


def test_sharded_checkpoint_from_gcs_matches_disk(gcs, sharded_ckpt, tmp_path, caplog):
    gcs_upload_dir(gcs, "models", "llama/tiny", sharded_ckpt)
    gcs.bucket("models").blob("llama/tiny/notes.txt").upload_from_string(b"not needed")
    before = download_bytes().get("gs", 0)
    caplog.set_level("INFO", logger="vsurge.models.sources")
    remote, tok = vsurge.load_model("gs://models/llama/tiny")
    local, _ = vsurge.load_model(sharded_ckpt)
    assert same_logits(remote, local) == 0.0 and tok is not None
    size = sum(p.stat().st_size for p in sharded_ckpt.iterdir())
    assert download_bytes()["gs"] - before == size
    lines = [r.getMessage() for r in caplog.records]
    # one line per file, each verified with the object's MD5 from GCS metadata
    for p in sharded_ckpt.iterdir():
        assert any(
            line.startswith(f"gs://models/llama/tiny: {p.name} ") and "md5 verified" in line for line in lines
        )
    assert any("downloaded" in line and "MB/s" in line for line in lines)
    assert len(complete_revisions(tmp_path / "cache")) == 1
    resolve("gs://models/llama/tiny")  # complete cache: listed, not fetched
    assert download_bytes()["gs"] - before == size


def test_parallel_ranges_of_one_file(gcs, sharded_ckpt, monkeypatch):
    """Small chunks: every file arrives in many ranged reads, in parallel, and still verifies."""
    monkeypatch.setenv("VSURGE_DOWNLOAD_CHUNK_BYTES", "4096")
    monkeypatch.setenv("VSURGE_DOWNLOAD_WORKERS", "6")
    gcs_upload_dir(gcs, "models", "ranged", sharded_ckpt)
    path = resolve("gs://models/ranged")
    for p in sharded_ckpt.iterdir():
        assert (Path(path) / p.name).read_bytes() == p.read_bytes()


def test_missing_bucket_is_a_clear_404(gcs):
    with pytest.raises(
        ModelSourceError, match=r"^gs://no-such-bucket/m: not found \(404, listing gs://no-such-bucket/m\)"
    ):
        vsurge.load_model("gs://no-such-bucket/m")


def test_missing_object_prefix(gcs):
    if not gcs.bucket("emptyb").exists():
        gcs.create_bucket("emptyb")
    with pytest.raises(ModelSourceError, match=r"^gs://emptyb/nothing: nothing found there"):
        vsurge.load_model("gs://emptyb/nothing")


def test_single_gguf_object_is_selected(gcs, tmp_path):
    """gs://bucket/path/file.gguf names one object; a bad GGUF never becomes a cached model."""
    if not gcs.bucket("ggufs").exists():
        gcs.create_bucket("ggufs")
    gcs.bucket("ggufs").blob("m/x.gguf").upload_from_string(b"NOPE" + b"\0" * 100)
    with pytest.raises(ModelSourceError, match=r"^gs://ggufs/m/x.gguf: x.gguf: .*not a GGUF file"):
        resolve("gs://ggufs/m/x.gguf")
    assert complete_revisions(tmp_path / "cache") == []
