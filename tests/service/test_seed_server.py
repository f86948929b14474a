"""The seed's server arguments do what the seed says (issue 36, item 7): `max_workers` sizes the thread pool
the server's off-loop work runs in, `oai_like_processor` gives a multimodal processor OpenAI content parts,
`fire(metrics_port=-1)` serves no /metrics, `CountTokenRequest` is the body of /v1/count_tokens, and the
probes can be awaited in Python. Real servers on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

import vsurge
from vsurge import vSurge, vSurgeApiServer
from vsurge.server import start
from vsurge.server.messages import render_chat

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_path(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return path


@pytest.fixture(scope="module")
def idle_surge(tiny_llama):
    """A vSurge that is never started: the routes tested here only tokenize."""
    model, tok = tiny_llama
    return vSurge.create_vdriver(model, tok, 2, [16], None, 32, vsurge_name="tiny")


def test_max_workers_is_checked():
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="max_workers"):
            vSurgeApiServer(None, max_workers=bad)


def test_off_loop_work_runs_in_max_workers_threads(idle_surge, monkeypatch):
    tok = idle_surge.processor
    threads: set[str] = set()
    real = tok.apply_chat_template

    def recording(*args, **kw):
        threads.add(threading.current_thread().name)
        time.sleep(0.05)  # long enough that concurrent requests overlap
        return real(*args, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", recording)
    api = vSurgeApiServer(idle_surge, max_workers=2, owns_engines=False)
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=False, progress=None)
    try:
        body = {"model": "tiny", "conversation": [{"role": "user", "content": "Hello there"}]}
        with ThreadPoolExecutor(6) as pool:
            answers = list(
                pool.map(
                    lambda _: httpx.post(f"{running.url}/v1/count_tokens", json=body, timeout=30), range(6)
                )
            )
        assert all(a.status_code == 200 and a.json()["count"] > 0 for a in answers), [a.text for a in answers]
        assert threads and threads <= {"vsurge-api_0", "vsurge-api_1"}, threads
        assert api.thread_pool._max_workers == 2
    finally:
        running.stop()


def test_count_token_request_is_the_seeds_name():
    from vsurge.server import schemas

    assert vsurge.CountTokenRequest is schemas.CountTokenRequest is schemas.CountTokensRequest
    req = vsurge.CountTokenRequest(model="tiny", conversation="Hello")
    assert req.conversation == "Hello"


def test_the_probes_and_model_list_can_be_awaited_without_a_request(idle_surge):
    api = vSurgeApiServer({"tiny": idle_surge}, owns_engines=False)
    assert asyncio.run(api.liveness()).status_code == 200
    assert asyncio.run(api.readiness()).status_code == 503  # not warmed up
    models = asyncio.run(api.available_inference())
    assert b'"id":"tiny"' in models.body.replace(b" ", b"")


def test_oai_like_processor_gives_a_multimodal_processor_content_parts():
    import transformers
    from tiny_models import tiny_tokenizer

    # a real multimodal processor (audio: built offline) whose template reads content as typed parts
    template = "{% for m in messages %}<{{ m['role'] }}>{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"
    processor = transformers.Qwen2AudioProcessor(
        feature_extractor=transformers.WhisperFeatureExtractor(),
        tokenizer=tiny_tokenizer(),
        chat_template=template,
    )
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": ""}]
    assert render_chat(processor, messages, add_generation_prompt=False) == "<user>What is 2+2?<assistant>"
    # off: the content goes as the string it is, which this template cannot read
    assert (
        render_chat(processor, messages, add_generation_prompt=False, oai_like_processor=False)
        == "<user><assistant>"
    )
    # a tokenizer always gets strings
    tok = tiny_tokenizer()
    assert render_chat(tok, messages[:1]) == render_chat(tok, messages[:1], oai_like_processor=False)
    assert vSurgeApiServer(None, oai_like_processor=False).oai_like_processor is False


def test_start_without_metrics_serves_none(idle_surge):
    api = vSurgeApiServer(idle_surge, owns_engines=False)
    running = start(api, host="127.0.0.1", port=0, serve_metrics=False, warm_up=False, progress=None)
    try:
        assert running.metrics_url == "off" and running.metrics_httpd is None
        r = httpx.get(f"{running.url}/metrics", timeout=10)
        assert r.status_code == 404 and "disabled" in r.json()["error"]["message"]
    finally:
        running.stop()


FIRE = textwrap.dedent(
    """
    import sys, vsurge
    from vsurge import vSurge, vSurgeApiServer
    model, tok = vsurge.load_model(sys.argv[1])
    surge = vSurge.create_vdriver(model, tok, 1, [16], None, 32, vsurge_name="tiny")
    vSurgeApiServer(surge, 2).fire("127.0.0.1", int(sys.argv[2]), -1, "warning")
    """
)


def free_port() -> int:
    """A port whose next one is free too (fire's default metrics port would be port + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two free ports in a row")


def test_fire_with_metrics_port_minus_one_serves_no_metrics(tiny_path, tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "service"), os.environ.get("PYTHONPATH", "")]),
    }
    log = tmp_path / "fire.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", FIRE, tiny_path, str(port)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        deadline = time.monotonic() + 300
        while "ready: serving" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "(metrics off)" in log.read_text()
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert r.status_code == 404 and "disabled" in r.json()["error"]["message"]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port + 1}/metrics", timeout=5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        answer = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0, log.read_text()
