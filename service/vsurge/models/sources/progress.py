"""Download progress: one log line per file, a periodic total (bytes, MB/s, ETA), and the process-wide counters
behind ``vsurge_model_download_bytes_total`` and ``vsurge_model_load_seconds{phase}``."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import defaultdict

log = logging.getLogger("vsurge.models.sources")

_lock = threading.Lock()
#: bytes received from each store, by scheme ("s3", "gs", "hf"); only grows.
DOWNLOAD_BYTES: dict[str, int] = defaultdict(int)
#: seconds of the last load of each source, by phase: "download" (fetch + verify), "place" (read the
#: checkpoint and put every tensor on its devices); the server adds "compile".
LOAD_PHASES: dict[str, dict[str, float]] = {}


def add_bytes(scheme: str, n: int) -> None:
    with _lock:
        DOWNLOAD_BYTES[scheme] += n


def record_phase(source: str, phase: str, seconds: float) -> None:
    with _lock:
        LOAD_PHASES.setdefault(source, {})[phase] = seconds


def download_bytes() -> dict[str, int]:
    with _lock:
        return dict(DOWNLOAD_BYTES)


def load_phases(source: str) -> dict[str, float]:
    with _lock:
        return dict(LOAD_PHASES.get(source, {}))


def _ensure_output() -> None:
    # `vsurge serve` configures uvicorn's loggers only; make sure these lines reach stderr anyway.
    if not log.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[vsurge] %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)


def say(msg: str) -> None:
    _ensure_output()
    log.info("%s", msg)


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class Progress:
    """Counts bytes of one source's download and logs a total every ``interval`` seconds from a thread."""

    def __init__(self, source: str, scheme: str, total: int, already: int = 0, interval: float | None = None):
        self.source = source
        self.scheme = scheme
        self.total = total
        self.done = already
        self.received = 0  # over the network in this process
        self.t0 = time.perf_counter()
        self.interval = (
            float(os.environ.get("VSURGE_PROGRESS_INTERVAL", "5")) if interval is None else interval
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            self.received += n
        add_bytes(self.scheme, n)

    def rollback(self, n: int) -> None:
        """Bytes of a failed range that will be fetched again: they leave the progress, not the counter."""
        with self._lock:
            self.done -= n

    def line(self) -> str:
        with self._lock:
            done, received = self.done, self.received
        dt = max(time.perf_counter() - self.t0, 1e-9)
        rate = received / dt
        left = max(self.total - done, 0)
        eta = f", ETA {left / rate:.0f}s" if rate > 0 and left else ""
        pct = 100.0 * done / self.total if self.total else 100.0
        return f"{self.source}: {mb(done)} of {mb(self.total)} ({pct:.0f}%), {rate / 1e6:.1f} MB/s{eta}"

    def file_done(self, name: str, size: int, seconds: float, how: str) -> None:
        say(f"{self.source}: {name} {mb(size)} in {seconds:.1f}s ({how})")

    def __enter__(self) -> Progress:
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="vsurge-download-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            say(self.line())
