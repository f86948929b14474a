"""Running a vSurgeApiServer under uvicorn: bind first, load/compile in the background, drain on SIGTERM.

Order of a start: the port is bound (probes get answers at once: liveness 200, readiness 503), then a
background thread loads the models (`startup`), compiles every shape and starts the engines, marks the
server ready and prints one line saying where it listens.

SIGUSR1 (a pod's preStop hook) only turns readiness to 503, so the pod leaves its Service while it still
serves what arrives. SIGTERM (or SIGINT) starts a drain instead of uvicorn's immediate shutdown: readiness turns 503, new
generations are refused with 503, requests in flight run to the end, then uvicorn closes and the engines
stop. A second signal shuts down without waiting (a second SIGINT kills connections at once).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from .metrics import start_metrics_server

if TYPE_CHECKING:  # the server module imports this one (fire), never the other way round
    from .lifecycle import Lifecycle as vSurgeApiServer  # noqa: N812

log = logging.getLogger(__name__)

Startup = Callable[["vSurgeApiServer", Callable[[str], None]], None]


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains the API server instead of closing connections."""

    def __init__(self, config: uvicorn.Config, api: vSurgeApiServer) -> None:
        super().__init__(config)
        self.api = api

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        from .lifecycle import DRAINING

        if self.api.state == DRAINING:
            # Second signal: stop waiting for the drain; a second SIGINT also drops open connections.
            self.should_exit = True
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        self.api.begin_drain(f"draining after signal {signal.Signals(sig).name}")

    async def on_tick(self, counter: int) -> bool:
        if self.api.drain_complete():
            self.should_exit = True
        return await super().on_tick(counter)


@dataclass
class RunningServer:
    """A server started by `start()`; `url` is the base URL with the real port."""

    api: vSurgeApiServer
    server: DrainingServer
    thread: threading.Thread | None
    host: str
    port: int
    scheme: str
    metrics_url: str
    metrics_httpd: Any = None
    startup_thread: threading.Thread | None = None
    uds: str | None = None  # the Unix socket it listens on instead of host:port

    @property
    def url(self) -> str:
        """The base URL; on a Unix socket, the one its clients send over the socket (any host will do)."""
        if self.uds is not None:
            return f"{self.scheme}://localhost"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{self.port}"

    def wait_ready(self, timeout: float = 600.0) -> None:
        from .lifecycle import READY

        deadline = time.monotonic() + timeout
        while self.api.state != READY:
            if self.api.fatal is not None:
                raise RuntimeError(f"server startup failed: {self.api.fatal}") from self.api.fatal
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become ready")
            time.sleep(0.05)

    @property
    def where(self) -> str:
        """Where clients reach it, as the readiness line says: the base URL, or the socket and its URL."""
        return f"{self.url}/v1" if self.uds is None else f"unix:{self.uds} ({self.url}/v1 over the socket)"

    def stop(self, timeout: float = 60.0) -> None:
        """Close at once (no drain); for tests and embedding."""
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.close()

    def close(self) -> None:
        """Release what the server holds outside uvicorn: the metrics server, the socket file."""
        if self.metrics_httpd is not None:
            self.metrics_httpd.shutdown()
            self.metrics_httpd.server_close()
            self.metrics_httpd = None
        if self.uds is not None:
            _remove_socket(self.uds, getattr(self, "_uds_inode", None))


def _announce(msg: str) -> None:
    print(f"[vsurge] {msg}", file=sys.stderr, flush=True)


def start(
    api: vSurgeApiServer,
    *,
    host: str = "0.0.0.0",
    port: int = 11556,
    metrics_port: int | None = None,
    log_level: str = "info",
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
    startup: Startup | None = None,
    uds: str | None = None,
    warm_up: bool = True,
    progress: Callable[[str], None] | None = _announce,
    in_thread: bool = True,
    configure_logging: bool = False,
    serve_metrics: bool = True,
) -> RunningServer:
    """Bind the ports, start the background startup, and run uvicorn in a thread (or prepare to run it).

    port 0 picks a free port (tests). metrics_port None means port + 1; -1 serves /metrics on the main
    port; serve_metrics=False serves it nowhere (`fire(metrics_port=-1)`, the seed's). warm_up=False
    leaves the server in 'starting' until the caller runs `api.warm_up()` or `api.mark_ready()`.
    ``uds``: listen on this Unix-domain socket instead of host:port (host and port are then unused, and
    /metrics is on the socket unless metrics_port names a TCP port); the file is removed at the end.
    """
    say = progress or (lambda msg: None)
    config = uvicorn.Config(
        api.app,
        host=host,
        port=port,
        uds=uds,
        log_level=log_level,
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
        access_log=False,  # one log line per request costs throughput; metrics count requests instead
        lifespan="on",
        log_config=uvicorn.config.LOGGING_CONFIG if configure_logging else None,
        timeout_graceful_shutdown=30,
    )
    if uds is not None:
        _clear_stale_socket(uds)
    sock = config.bind_socket()
    bound_port = 0 if uds is not None else sock.getsockname()[1]
    scheme = "https" if ssl_certfile else "http"
    metrics_httpd = None
    if metrics_port is None:
        metrics_port = -1 if uds is not None else bound_port + 1 if port else 0
    api.metrics_on_main_port = serve_metrics and metrics_port == -1
    api.metrics_enabled = serve_metrics
    if not serve_metrics:
        metrics_url = "off"
    elif metrics_port == -1:
        metrics_url = f"{scheme}://{_shown(host)}:{bound_port}/metrics"
    else:
        metrics_httpd, _ = start_metrics_server(api.metrics.registry, host, metrics_port)
        metrics_url = f"http://{_shown(host)}:{metrics_httpd.server_port}/metrics"
    server = DrainingServer(config, api)
    running = RunningServer(api, server, None, host, bound_port, scheme, metrics_url, metrics_httpd, uds=uds)
    if uds is not None:
        running._uds_inode = os.stat(uds).st_ino  # type: ignore[attr-defined]  # ours to remove, not a successor's
        if metrics_port == -1:
            running.metrics_url = metrics_url = f"unix:{uds} /metrics"

    def background() -> None:
        try:
            if startup is not None:
                startup(api, say)
            if warm_up:
                api.warm_up(say)
            names = ", ".join(repr(n) for n in api.models) or "no models"
            if warm_up or startup is not None:
                say(f"ready: serving {names} at {running.where} (metrics {metrics_url})")
        except BaseException as e:  # noqa: BLE001 - reported, then the server exits (on_tick sees fatal)
            api.fatal = e
            say(f"startup failed: {type(e).__name__}: {e}")

    if startup is not None or warm_up:
        running.startup_thread = threading.Thread(target=background, name="vsurge-startup", daemon=True)
        running.startup_thread.start()

    if in_thread:
        running.thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="vsurge-uvicorn", daemon=True
        )
        running.thread.start()
        deadline = time.monotonic() + 30
        while not server.started and running.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        running._sock = sock  # type: ignore[attr-defined]
    return running


def serve(api: vSurgeApiServer, **kw: Any) -> None:
    """Run in the foreground until drained; raises the startup error if loading or compiling failed."""
    running = start(api, in_thread=False, configure_logging=True, **kw)
    sock: socket.socket = running._sock  # type: ignore[attr-defined]
    # A Kubernetes preStop hook sends SIGUSR1 (the operator's pods): fail readiness first, so the pod leaves
    # the Service's endpoints while it still serves; the kubelet's SIGTERM then starts the drain.
    signal.signal(signal.SIGUSR1, lambda sig, frame: api.announce_stop())
    try:
        running.server.run(sockets=[sock])
    finally:
        running.close()
    if api.fatal is not None:
        raise api.fatal


def _shown(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _clear_stale_socket(path: str) -> None:
    """A socket file left by a server that died is removed (nothing answers on it); one in use, or a path
    that is not a socket, is an error that says so, not uvicorn's bare exit."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"--uds {path}: the path exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: its server is gone
        return
    finally:
        probe.close()
    raise OSError(f"--uds {path}: another server is listening on it")


def _remove_socket(path: str, inode: int | None) -> None:
    try:
        if inode is None or os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass
