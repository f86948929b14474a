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


def _serve(model: str, tmp_path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "VSURGE_TERMINATION_LOG": str(tmp_path / "termination-log"), **(env or {})}
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


def test_probes_answer_while_the_model_downloads(hub, sharded_ckpt, tmp_path):
    """The startup probe passes and liveness holds during a long download; readiness waits for the model."""
    hub.add_repo("acme/slow", sharded_ckpt)
    shard = sorted(p.name for p in sharded_ckpt.glob("model-*.safetensors"))[0]
    hub.delay[shard] = 30.0
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = _serve(
        "hf://acme/slow", tmp_path, "--host", "127.0.0.1", "--port", str(port), env={"HF_HUB_OFFLINE": "0"}
    )
    try:
        lines = []
        while not any("hf://acme/slow: downloading" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "the server exited:\n" + "".join(lines)
            lines.append(line)
        deadline = time.monotonic() + 20
        while shard not in hub.gets and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shard in hub.gets  # the slow file is being fetched now
        assert httpx.get(f"http://127.0.0.1:{port}/liveness", timeout=10).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=10).status_code == 503
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=60)
