"""s3:// model sources against moto's real S3 HTTP server on loopback, through boto3."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest
from sources_servers import complete_revisions, same_logits, upload_dir

import vsurge
from vsurge.models.sources import ModelSourceError, download_bytes, load_phases


def test_sharded_checkpoint_from_s3_matches_disk(s3, sharded_ckpt, tmp_path):
    upload_dir(s3, "models", "tiny-llama", sharded_ckpt)
    s3.put_object(Bucket="models", Key="tiny-llama/README.md", Body=b"not needed")
    s3.put_object(Bucket="models", Key="tiny-llama/pytorch_model.bin", Body=b"x" * 1000)
    before = download_bytes().get("s3", 0)
    remote, tok = vsurge.load_model("s3://models/tiny-llama")
    local, _ = vsurge.load_model(sharded_ckpt)
    assert same_logits(remote, local) == 0.0
    assert tok is not None and tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    weights = sum(p.stat().st_size for p in sharded_ckpt.iterdir())
    got = download_bytes()["s3"] - before
    assert got == weights  # exactly the checkpoint: not README.md, not the .bin
    (rev,) = complete_revisions(tmp_path / "cache")
    assert sorted(p.name for p in rev.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in sharded_ckpt.iterdir()
    )
    phases = load_phases("s3://models/tiny-llama")
    assert phases["download"] > 0 and phases["place"] > 0

    # A complete cache is not fetched again (only listed).
    again, _ = vsurge.load_model("s3://models/tiny-llama")
    assert download_bytes()["s3"] - before == weights
    assert same_logits(again, local) == 0.0


def test_changed_object_is_a_new_revision(s3, sharded_ckpt, tmp_path):
    upload_dir(s3, "models", "changing", sharded_ckpt)
    from vsurge.models.sources import resolve

    first = resolve("s3://models/changing")
    cfg = json.loads((sharded_ckpt / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    s3.put_object(Bucket="models", Key="changing/config.json", Body=json.dumps(cfg).encode())
    second = resolve("s3://models/changing")
    assert first != second and json.loads(Path(second, "config.json").read_text())["rms_norm_eps"] == 1e-5
    assert len(complete_revisions(tmp_path / "cache")) == 2


def test_missing_bucket_is_a_clear_404(s3):
    with pytest.raises(
        ModelSourceError, match=r"^s3://no-such-bucket/m: bucket does not exist \(404 NoSuchBucket"
    ):
        vsurge.load_model("s3://no-such-bucket/m")


def test_empty_prefix_says_nothing_is_there(s3):
    s3.create_bucket(Bucket="empty")
    with pytest.raises(ModelSourceError, match=r"^s3://empty/none: nothing found there"):
        vsurge.load_model("s3://empty/none")


def test_no_config_no_weights(s3, sharded_ckpt):
    s3.create_bucket(Bucket="half")
    s3.upload_file(str(sharded_ckpt / "tokenizer.json"), "half", "m/tokenizer.json")
    with pytest.raises(ModelSourceError, match=r"s3://half/m: not a checkpoint: no config.json and no .gguf"):
        vsurge.load_model("s3://half/m")
    s3.upload_file(str(sharded_ckpt / "config.json"), "half", "m/config.json")
    s3.put_object(Bucket="half", Key="m/pytorch_model.bin", Body=b"x")
    with pytest.raises(
        ModelSourceError, match=r"config.json but no \*.safetensors weights \(found pytorch_model.bin"
    ):
        vsurge.load_model("s3://half/m")


def test_truncated_object_is_an_error_and_never_cached(s3, sharded_ckpt, tmp_path):
    upload_dir(s3, "models", "trunc", sharded_ckpt)
    shard = sorted(sharded_ckpt.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    s3.put_object(Bucket="models", Key=f"trunc/{shard.name}", Body=data[: len(data) // 2])
    with pytest.raises(
        ModelSourceError, match=rf"^s3://models/trunc: {shard.name}: truncated safetensors file"
    ):
        vsurge.load_model("s3://models/trunc")
    assert complete_revisions(tmp_path / "cache") == []
    s3.put_object(Bucket="models", Key=f"trunc/{shard.name}", Body=data)  # fixed upstream: loads now
    model, _ = vsurge.load_model("s3://models/trunc")
    assert len(complete_revisions(tmp_path / "cache")) == 1


@pytest.fixture
def moto_auth(moto_server):
    """Turn on moto's IAM authentication (its /moto-api/reset-auth switch), off again afterwards."""

    def set_count(n: str):
        req = urllib.request.Request(
            f"{moto_server}/moto-api/reset-auth",
            data=n.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(req, timeout=10).read()

    set_count("0")
    yield
    set_count("inf")


def test_wrong_credentials_are_a_clear_403(s3, sharded_ckpt, moto_auth, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
    with pytest.raises(
        ModelSourceError, match=r"^s3://models/tiny: credentials rejected \(403 InvalidAccessKeyId"
    ):
        vsurge.load_model("s3://models/tiny")


def test_missing_credentials(s3, monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ModelSourceError, match=r"^s3://models/tiny: no AWS credentials"):
        vsurge.load_model("s3://models/tiny")


def test_disk_full_before_any_transfer(s3, sharded_ckpt, tmp_path):
    """A cache on a filesystem too small for the checkpoint fails up front with the sizes."""
    if not shutil.which("mount") or os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    small = tmp_path / "small"
    small.mkdir()
    if os.system(f"mount -t tmpfs -o size=256k tmpfs {small} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here (no CAP_SYS_ADMIN)")
    try:
        os.environ["VSURGE_CACHE_DIR"] = str(small)
        upload_dir(s3, "models", "big", sharded_ckpt)
        with pytest.raises(ModelSourceError, match=r"^s3://models/big: disk full: the download needs"):
            vsurge.load_model("s3://models/big")
    finally:
        os.system(f"umount {small}")


def test_unreachable_store_falls_back_to_the_cached_revision(s3, sharded_ckpt, monkeypatch, caplog):
    upload_dir(s3, "models", "offline", sharded_ckpt)
    from vsurge.models.sources import resolve

    path = resolve("s3://models/offline")
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{dead}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    caplog.set_level("INFO", logger="vsurge.models.sources")
    assert resolve("s3://models/offline") == path
    assert any(
        "unreachable" in r.getMessage() and "using the cached revision" in r.getMessage()
        for r in caplog.records
    )
    with pytest.raises(ModelSourceError, match=r"^s3://models/never-cached: cannot reach the S3 endpoint"):
        resolve("s3://models/never-cached")
