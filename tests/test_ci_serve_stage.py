""".ci/serve's own logic, with a fake `make` on PATH that starts a fake `vsurge serve` (stdlib HTTP server): the
stage passes only on a chat.completion answer and exit status 0 after SIGTERM, fails fast when make fails, and
never leaves the server running. The real run of the stage (real make serve, real model) is .ci/run's job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PORT = 11556  # the README's port, which the stage uses

FAKE_SERVER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    mode = os.environ["FAKE_MODE"]
    open(os.environ["FAKE_PIDFILE"], "w").write(str(os.getpid()))

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200 if self.path == "/readiness" else 404, "{}")

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            content = "" if mode == "empty_answer" else "Paris."
            self._send(200, json.dumps({
                "id": "chatcmpl-x", "object": "chat.completion", "created": 1,
                "model": "SmolLM2-135M-Instruct",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}))

    server = ThreadingHTTPServer(("0.0.0.0", int(os.environ["FAKE_PORT"])), H)

    def term(sig, frame):
        sys.exit(1 if mode == "exit1" else 0)

    signal.signal(signal.SIGTERM, term)
    print("ready: serving 'SmolLM2-135M-Instruct'", flush=True)
    server.serve_forever()
    """
)

FAKE_MAKE = """#!/bin/sh
# fake make: `make serve VENV=.venv-serve`
[ "$FAKE_MODE" = make_fails ] && { echo "make: *** [Makefile:1: install] Error 1"; exit 2; }
mkdir -p .venv-serve/bin
printf '#!/bin/sh\\nexec %s -S "$@"\\n' "$FAKE_PYTHON" > .venv-serve/bin/python  # -S: no site-packages
chmod +x .venv-serve/bin/python
"$FAKE_PYTHON" "$FAKE_SERVER_PY" bin/vsurge serve --model default
"""


def _port_in_use() -> bool:
    for port in (PORT, PORT + 1):  # the API and /metrics
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
    return False


@pytest.fixture
def stage(tmp_path):
    if _port_in_use():
        pytest.skip(f"port {PORT} is in use (a server is running)")
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    work = tmp_path / "repo"
    (work / ".ci").mkdir(parents=True)
    for name in ("serve", "readme_example.py"):
        shutil.copy(REPO / ".ci" / name, work / ".ci" / name)
    shutil.copy(REPO / "README.md", work / "README.md")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(FAKE_MAKE)
    (bin_dir / "make").chmod(0o755)
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    pidfile = tmp_path / "server.pid"

    def run(mode: str) -> tuple[subprocess.CompletedProcess, int | None]:
        env = dict(
            os.environ,
            PATH=f"{bin_dir}:{os.environ['PATH']}",
            FAKE_MODE=mode,
            FAKE_PORT=str(PORT),
            FAKE_PYTHON=sys.executable,
            FAKE_SERVER_PY=str(tmp_path / "fake_server.py"),
            FAKE_PIDFILE=str(pidfile),
            CI_SERVE_READY_TIMEOUT="60",
            CI_SERVE_SPEED="0",  # the fake server streams nothing; .ci/run's real stage checks the speed
        )
        proc = subprocess.run(
            ["bash", str(work / ".ci" / "serve")], capture_output=True, text=True, env=env, timeout=180
        )
        pid = int(pidfile.read_text()) if pidfile.exists() else None
        return proc, pid

    yield run


def _gone(pid: int | None) -> bool:
    if pid is None:
        return True
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)  # do not leak it into other tests, then fail
    return False


def test_stage_passes_on_a_good_server(stage):
    proc, pid = stage("good")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[ci serve] passed" in out and "'Paris.'" in out
    assert "ok: torch is not importable" in out and "exited 0 on SIGTERM" in out
    assert "ready " in out and "curl -s localhost:11556/v1/chat/completions" in out
    assert _gone(pid)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("empty_answer", "choices[0].message.content is empty"),
        ("exit1", "make serve exited with status"),
        ("make_fails", "make serve exited with status 2 before the server was ready"),
    ],
)
def test_stage_fails_and_leaves_nothing_running(stage, mode, message):
    start = time.monotonic()
    proc, pid = stage(mode)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "FAILED" in out and message in out, out
    assert _gone(pid), "the stage left the server running"
    assert time.monotonic() - start < 90
    assert not _port_in_use()


def test_the_speed_check_times_the_readmes_own_request():
    """.ci/serve_speed.py sends the README's curl body (read from README.md), not a request of its own."""
    sys.path.insert(0, str(REPO / ".ci"))
    import serve_speed
    from readme_example import curl_example

    body = serve_speed.readme_body()
    assert body["messages"] and body["model"] and json.dumps(body["messages"])[1:-1] in curl_example()
