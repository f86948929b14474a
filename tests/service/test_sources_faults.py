"""Crash and concurrency faults of the model cache, with real processes against moto's S3 server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from sources_servers import complete_revisions

from vsurge.models.sources import download_bytes, resolve

RESOLVE = (
    "import sys; from vsurge.models.sources import resolve; print('PATH=' + resolve(sys.argv[1]), flush=True)"
)


def _big_checkpoint(directory: Path, mb: int = 40) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    save_file(
        {"w": rng.standard_normal(mb * (1 << 18), dtype=np.float32)}, str(directory / "model.safetensors")
    )
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


def _spawn(source: str, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RESOLVE, source],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_killed_mid_download_resumes_without_a_corrupt_cache(s3, tmp_path):
    ckpt = _big_checkpoint(tmp_path / "big")
    s3.create_bucket(Bucket="crash")
    for p in ckpt.iterdir():
        s3.upload_file(str(p), "crash", f"m/{p.name}")  # 40 MB: a multipart upload, ETag "md5-N"
    size = (ckpt / "model.safetensors").stat().st_size
    chunk = 512 << 10
    proc = _spawn("s3://crash/m", VSURGE_DOWNLOAD_CHUNK_BYTES=str(chunk), VSURGE_DOWNLOAD_WORKERS="1")
    cache = tmp_path / "cache"
    deadline = time.monotonic() + 120
    done = 0
    while time.monotonic() < deadline and proc.poll() is None:
        states = list(cache.glob("models/*/*.partial/model.safetensors.part.json"))
        if states:
            done = len(states[0].read_text().splitlines()) - 1
            if done >= 8:
                break
        time.sleep(0.01)
    assert proc.poll() is None, f"the download finished before it could be killed:\n{proc.stdout.read()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert complete_revisions(cache) == []  # a killed download is never a cached model

    before = download_bytes().get("s3", 0)
    path = resolve("s3://crash/m")
    fetched = download_bytes()["s3"] - before
    assert Path(path, "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert fetched <= size - done * chunk + 4096  # the finished chunks were not fetched again
    assert len(complete_revisions(cache)) == 1
    assert not list(cache.glob("models/*/*.partial"))


def test_two_processes_share_one_download(s3, tmp_path):
    ckpt = _big_checkpoint(tmp_path / "shared", mb=16)
    s3.create_bucket(Bucket="shared")
    for p in ckpt.iterdir():
        s3.upload_file(str(p), "shared", f"m/{p.name}")
    env = {
        "VSURGE_DOWNLOAD_CHUNK_BYTES": str(256 << 10),
        "VSURGE_DOWNLOAD_WORKERS": "2",
        "VSURGE_PROGRESS_INTERVAL": "0.2",
    }
    a, b = _spawn("s3://shared/m", **env), _spawn("s3://shared/m", **env)
    out_a, out_b = a.communicate(timeout=180)[0], b.communicate(timeout=180)[0]
    assert a.returncode == 0 and b.returncode == 0, out_a + out_b
    paths = {line for line in (out_a + out_b).splitlines() if line.startswith("PATH=")}
    assert len(paths) == 1, paths
    path = paths.pop()[5:]
    assert Path(path, "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    # One process downloaded; the other waited for the lock or found the finished cache.
    assert sum("downloading 2 of 2 files" in out for out in (out_a, out_b)) == 1, out_a + out_b
    assert len(complete_revisions(tmp_path / "cache")) == 1
    # the downloader's periodic total: bytes, percent, rate, ETA
    assert re.search(
        r"s3://shared/m: [\d.]+ MB of 16\.8 MB \(\d+%\), [\d.]+ MB/s, ETA \d+s", out_a + out_b
    ), out_a + out_b
