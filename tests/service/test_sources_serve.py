"""`vsurge serve --model <remote>`: a source error stops the server with a non-zero status, the message on
stderr and in the termination log the kubelet reads; a good source serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from sources_servers import upload_dir


def _serve(model: str, tmp_path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "VSURGE_TERMINATION_LOG": str(tmp_path / "termination-log")}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vsurge.cli",
            "serve",
            "--model",
            model,
            "--port",
            "0",
            "--metrics-port",
            "-1",
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_serve_exits_nonzero_with_the_source_error(s3, tmp_path):
    proc = _serve("s3://no-such-bucket/llama", tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "s3://no-such-bucket/llama: bucket does not exist (404 NoSuchBucket" in out
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith("ModelSourceError: s3://no-such-bucket/llama: bucket does not exist"), message


@pytest.mark.slow  # compiles every bucket: ~2 min on 2 cores
def test_serve_a_model_from_s3(s3, sharded_ckpt, tmp_path):
    upload_dir(s3, "serve", "tiny", sharded_ckpt)
    proc = _serve(
        "s3://serve/tiny",
        tmp_path,
        "--max-length",
        "64",
        "--prefill-lengths",
        "16,32",
        "--max-concurrent-decodes",
        "2",
    )
    try:
        url, lines = None, []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "ready: serving" in line:
                url = line.split(" at ")[1].split("/v1")[0]
                break
        assert url, "".join(lines)
        text = "".join(lines)
        assert "s3://serve/tiny: downloading" in text and "s3://serve/tiny: downloaded" in text
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "The capital", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'vsurge_model_download_bytes_total{store="s3"}' in metrics
        for phase in ("download", "place", "compile"):
            assert f'phase="{phase}"' in metrics, metrics
    finally:
        proc.terminate()
        proc.wait(timeout=60)
