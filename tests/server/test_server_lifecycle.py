"""Connections and lifecycle: disconnects free slots, readiness, TLS + API key, SIGTERM drains."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_helpers import MAX_LENGTH, MODEL, PREFILL_LENGTHS, SLOTS, self_signed_cert, wait_for

LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "go on"}],
    "max_tokens": 170,
    "ignore_eos": True,
}


def aborted(surge) -> int:
    return surge.metrics().finished_total.get("abort", 0)


def test_readiness_before_warmup_and_after(server, http):
    status, body = server.readiness_before_warmup
    assert status == 503 and body["error"]["code"] == "not_ready"
    assert http.get("/readiness").status_code == 200
    assert http.get("/liveness").json() == {"status": "alive"}
    health = http.get("/health").json()
    assert health["status"] == "ready" and health["models"][MODEL]["slots_total"] == SLOTS


def test_disconnect_mid_stream_frees_the_slot(server, surge):
    before = aborted(surge)
    with (
        httpx.Client(base_url=server.url, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert surge.metrics().slots_used >= 1
    # the connection is closed mid-stream: the request is cancelled, not run to its 170 tokens
    wait_for(lambda: surge.metrics().slots_used == 0)
    wait_for(lambda: aborted(surge) == before + 1)
    wait_for(lambda: server.api.in_flight == 0)


def test_disconnect_while_waiting_non_streaming_frees_the_slot(server, surge):
    before = aborted(surge)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        body = json.dumps(LONG).encode()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: surge.metrics().slots_used >= 1, timeout=10, interval=0.005)
    wait_for(lambda: surge.metrics().slots_used == 0)
    wait_for(lambda: aborted(surge) == before + 1)
    wait_for(lambda: server.api.in_flight == 0)


@pytest.fixture(scope="module")
def tls_server(surge, tmp_path_factory):
    """A second server over the same engine: HTTPS, an API key, metrics on their own port."""
    from vsurge.server import start, vSurgeApiServer

    key, cert = self_signed_cert(str(tmp_path_factory.mktemp("tls")))
    api = vSurgeApiServer({MODEL: surge}, api_key="s3cret-key", owns_engines=False)
    api.mark_ready()
    running = start(
        api,
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        ssl_keyfile=key,
        ssl_certfile=cert,
        warm_up=False,
        progress=None,
    )
    running.cert = cert  # type: ignore[attr-defined]
    yield running
    running.stop()


def test_tls_with_api_key(tls_server):
    ctx = ssl.create_default_context(cafile=tls_server.cert)
    assert tls_server.url.startswith("https://")
    # Clients are closed before the server stops: an idle TLS connection nobody reads would hold uvicorn's
    # shutdown until its SSL close times out.
    with httpx.Client(verify=ctx) as h1, httpx.Client(verify=ctx) as h2, httpx.Client(verify=ctx) as h3:
        good = openai.OpenAI(
            base_url=f"{tls_server.url}/v1", api_key="s3cret-key", max_retries=0, http_client=h1
        )
        r = good.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tls"}], max_tokens=4
        )
        assert r.choices[0].message.content is not None
        assert [m.id for m in good.models.list().data] == [MODEL]
        bad = openai.OpenAI(
            base_url=f"{tls_server.url}/v1", api_key="s3cret-kez", max_retries=0, http_client=h2
        )
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        assert e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        # probes need no key
        assert h3.get(f"{tls_server.url}/readiness").status_code == 200
        assert h3.get(f"{tls_server.url}/liveness").status_code == 200
        assert h3.get(f"{tls_server.url}/metrics").status_code == 404  # metrics live on their own port
    # plain HTTP to the TLS port gets nothing
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{tls_server.port}/liveness")
    # metrics on their own (plain HTTP) port, no key
    metrics = httpx.get(tls_server.metrics_url)
    assert metrics.status_code == 200 and "vsurge_slot_occupancy" in metrics.text


# ----------------------------------------------------------------------------------- SIGTERM drain


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_without_losing_requests(tiny_dir):
    """`vsurge serve` in a subprocess: 503 before warm-up, then SIGTERM with requests in flight: all finish."""
    port = _free_port()
    env = {
        **os.environ,
        "VSURGE_MODEL": tiny_dir,
        "VSURGE_SERVED_MODEL_NAME": MODEL,
        "VSURGE_PORT": str(port),
        "VSURGE_HOST": "127.0.0.1",
        "VSURGE_METRICS_PORT": "-1",
        "VSURGE_MAX_LENGTH": str(MAX_LENGTH),
        "VSURGE_PREFILL_LENGTHS": ",".join(map(str, PREFILL_LENGTHS)),
        "VSURGE_MAX_CONCURRENT_DECODES": str(SLOTS),
        "VSURGE_LOG_LEVEL": "warning",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "vsurge.cli", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    client = None
    try:
        statuses = []

        def ready() -> bool:
            try:
                statuses.append(httpx.get(f"{url}/readiness", timeout=2).status_code)
            except httpx.TransportError:
                return False
            return statuses[-1] == 200

        wait_for(ready, timeout=240, interval=0.05)
        assert 503 in statuses, "readiness was never 503 before warm-up"
        assert any("ready: serving" in line and f":{port}/v1" in line for line in log), log

        # Each request asks for n=SLOTS samples, so it takes every slot and the requests run one after
        # another: most of them still wait in the queue when SIGTERM arrives, however loaded the machine.
        # (Single-sample requests ran in two waves of ~170 steps of the tiny model, and a loaded suite once
        # saw twelve of sixteen finish before the drain.)
        n = 2 * SLOTS
        results: list = [None] * n
        streaming = threading.Semaphore(0)

        # One client with a connection per request: sixteen clients each building an SSL context under
        # a loaded suite took long enough for the first requests to finish before the last ones arrived.
        client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=n + 2))

        def one(i: int) -> None:
            finish, first = None, True
            with client.stream(
                "POST", f"{url}/v1/chat/completions", json={**LONG, "n": SLOTS, "stream": True}
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        if first:
                            streaming.release()
                            first = False
                        for ch in json.loads(line[6:])["choices"]:
                            finish = ch["finish_reason"] or finish
                    elif line == "data: [DONE]":
                        results[i] = (r.status_code, finish)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        assert streaming.acquire(timeout=120)  # the first request streams: every slot is generating

        # and every request has reached the server (the rest wait in the engine's queue). A request that
        # already finished counts as arrived: in_flight alone can never reach n once one has. in_flight is
        # read first, so a request that finishes between the two reads is counted, not lost.
        def arrived() -> int:
            flying = httpx.get(f"{url}/health", timeout=5).json()["in_flight"]
            return flying + sum(r is not None for r in results)

        wait_for(lambda: arrived() >= n, timeout=90)
        proc.send_signal(signal.SIGTERM)
        # draining: readiness is 503 and new work is refused while the streams are still running
        wait_for(lambda: httpx.get(f"{url}/readiness", timeout=5).status_code == 503, timeout=10)
        refused = httpx.post(f"{url}/v1/chat/completions", json={**LONG, "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        assert sum(t.is_alive() for t in threads) > SLOTS // 2, (
            "the requests finished before the drain was seen"
        )
        for t in threads:
            t.join(timeout=120)
        assert results == [(200, "length")] * n
        assert proc.wait(timeout=60) == 0
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/liveness", timeout=2)
    time.sleep(0)  # the reader thread ends with the pipe


def test_serve_exits_with_the_reason_when_startup_fails(tmp_path):
    missing = str(tmp_path / "no-model-here")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vsurge.cli",
            "serve",
            "--model",
            missing,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "startup failed" in out.stderr and missing in out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "vsurge.cli", "serve"],
        env={**os.environ, "VSURGE_PORT": "x"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "VSURGE_PORT" in bad.stderr
