"""examples/seed_style.py, a program written against the seed's API, runs unchanged on the default model:
positional engines, create_odriver, complete() in both tokenization modes, generate("one prompt"), then
vSurgeApiServer(...).fire(metrics_port=-1) serving both engines until SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # loads the real default model and compiles two engines for it

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "seed_style.py"


def test_the_seed_style_example_runs_unchanged_on_the_default_model(tmp_path):
    from test_seed_server import free_port

    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "service"), os.environ.get("PYTHONPATH", "")]),
    }
    log = tmp_path / "example.log"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        deadline = started + 900
        while "ready: serving" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        text = log.read_text()
        print(f"\nserving after {time.monotonic() - started:.0f}s; the example's output:\n{text}")
        for line in (
            "dense complete()",
            "paged complete()",
            "dense client-side",
            "paged client-side",
            "generate(",
        ):
            answer = next(x for x in text.splitlines() if x.startswith(line))
            assert "Paris" in answer, answer
        assert "(metrics off)" in text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        for model in ("dense", "paged"):
            chat = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=16,
                temperature=0,
            )
            assert "Paris" in chat.choices[0].message.content, chat
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 404
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port + 1}/metrics", timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0, log.read_text()
