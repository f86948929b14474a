"""`vsurge serve --uds PATH`: the whole server on a Unix-domain socket (a sidecar in the pod; the TPU machine,
where no TCP socket opens). A real `vsurge serve` subprocess answers the official openai client over
httpx's UDS transport, streamed and not; the router proxies to it as a `unix:///...` upstream; SIGTERM
ends it with status 0 and the socket file gone."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import httpx
import openai
import pytest
import uvicorn
import yaml
from server_helpers import MAX_LENGTH, MODEL, PREFILL_LENGTHS, wait_for

from vsurge.router.table import UpstreamURLError, normalize_upstream
from vsurge.router.uds import socket_path, socket_upstream

ASK = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def uds_server(tiny_dir):
    # AF_UNIX paths stop at 107 bytes: pytest's tmp_path can be longer, /tmp is not
    folder = tempfile.mkdtemp(prefix="vsurge-uds-", dir="/tmp")
    path = os.path.join(folder, "Serve.sock")  # a capital: the router's URL form must keep it
    env = {
        **os.environ,
        "VSURGE_MODEL": tiny_dir,
        "VSURGE_SERVED_MODEL_NAME": MODEL,
        "VSURGE_UDS": path,
        "VSURGE_PORT": "1",  # unused on a socket: binding it would fail, so this proves it is not bound
        "VSURGE_MAX_LENGTH": str(MAX_LENGTH),
        "VSURGE_PREFILL_LENGTHS": ",".join(map(str, PREFILL_LENGTHS)),
        "VSURGE_MAX_CONCURRENT_DECODES": "4",
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
    threading.Thread(target=lambda: log.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    http = httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://localhost", timeout=30)

    def ready() -> bool:
        assert proc.poll() is None, "".join(log)
        try:
            return http.get("/readiness").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(ready, timeout=300, interval=0.1)
        yield proc, path, log, http
    finally:
        http.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def test_openai_client_and_the_router_over_the_socket_then_sigterm_removes_it(uds_server):
    proc, path, log, http = uds_server
    assert any(f"at unix:{path}" in line for line in log), log  # readiness names the socket
    assert any(f"sized: 4 slots x {MAX_LENGTH} tokens" in line for line in log), log  # set values kept
    assert "vsurge_requests" in http.get("/metrics").text  # /metrics on the socket: no port is opened
    with httpx.Client(transport=httpx.HTTPTransport(uds=path)) as h:
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=h, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        whole = client.chat.completions.create(model=MODEL, **ASK)
        assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
        stream = client.chat.completions.create(
            model=MODEL, stream=True, stream_options={"include_usage": True}, **ASK
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content  # greedy: the same tokens, streamed
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    _router_proxies_to(path, whole.choices[0].message.content)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, "".join(log)
    assert not os.path.exists(path)


def _router_proxies_to(path: str, want: str) -> None:
    """The router, with the server on ``path`` as a `unix://` upstream, answers as the server does (run on
    the live server of the test above: one `vsurge serve` start per module)."""
    from vsurge.router.app import build_app
    from vsurge.router.config import RouterConfig

    folder = tempfile.mkdtemp(prefix="vsurge-router-")
    static = os.path.join(folder, "static.yaml")
    with open(static, "w") as f:
        yaml.safe_dump({"models": [{"name": MODEL, "upstreams": [f"unix://{path}"]}]}, f)
    # /load polled over the socket too: the poll client carries the same transport
    cfg = RouterConfig(static_config=static, host="127.0.0.1", port=0, load_poll_seconds=0.2)
    server = uvicorn.Server(uvicorn.Config(build_app(cfg), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=15)
        port = server.servers[0].sockets[0].getsockname()[1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        got = client.chat.completions.create(model=MODEL, **ASK).choices[0].message.content
        assert got == want
        streamed = client.chat.completions.create(model=MODEL, stream=True, **ASK)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert socket_upstream(path) in metrics  # the upstream is named, and it answered
    finally:
        server.should_exit = True
        thread.join(10)
        shutil.rmtree(folder, ignore_errors=True)


def test_socket_upstream_urls_round_trip_and_bad_ones_are_refused():
    for path in ("/run/vsurge.sock", "/tmp/My Socket/A.sock", "/x/%41"):
        url = normalize_upstream(f"unix://{path}")
        assert url == socket_upstream(path) and url.startswith("http+unix://")
        assert socket_path(httpx.URL(url + "/v1/models").host) == path  # survives httpx's lowercasing
        assert normalize_upstream(url) == url and normalize_upstream(f"unix:{path}") == url
    assert normalize_upstream("unix:///run/vsurge.sock") == "http+unix://%2frun%2fvsurge.sock"
    for bad in ("unix://host/run/x.sock", "unix:relative.sock", "unix:///run/x.sock?q=1"):
        with pytest.raises(UpstreamURLError):
            normalize_upstream(bad)


def test_a_stale_socket_file_is_replaced_and_a_live_one_refused(tiny_dir):
    """A server that died leaves its socket file: the next start takes the path over; a path where a
    server still listens is refused with a reason, not taken from it."""
    from vsurge.server.runner import _clear_stale_socket

    folder = tempfile.mkdtemp(prefix="vsurge-uds-", dir="/tmp")
    path = os.path.join(folder, "s.sock")
    try:
        live = socket.socket(socket.AF_UNIX)
        live.bind(path)
        live.listen()
        with pytest.raises(OSError, match="another server is listening"):
            _clear_stale_socket(path)
        live.close()  # closed without unlinking: the file a killed server leaves
        assert os.path.exists(path)
        _clear_stale_socket(path)
        assert not os.path.exists(path)
        open(path, "w").close()
        with pytest.raises(OSError, match="not a socket"):
            _clear_stale_socket(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_uds_option_and_its_metrics_default():
    from vsurge.cli.serve_options import parse_serve_config

    cfg = parse_serve_config(["--uds", "/run/v.sock"], {})
    assert cfg.uds == "/run/v.sock" and cfg.resolved_metrics_port == -1  # no port opened: /metrics on it
    assert parse_serve_config([], {"VSURGE_UDS": "/run/w.sock"}).uds == "/run/w.sock"
    assert (
        parse_serve_config(["--uds", "/run/v.sock", "--metrics-port", "9100"], {}).resolved_metrics_port
        == 9100
    )
    assert (
        parse_serve_config([], {}).uds is None and parse_serve_config([], {}).resolved_metrics_port == 11557
    )
