"""Real `vsurge serve` groups on loopback for the multi-host tests: N processes, one JAX group (gloo), a
lane secret file, the official `openai` client on the leader."""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SERVE = [sys.executable, "-c", "import sys; from vsurge.cli.main import main; sys.exit(main())", "serve"]
# 2 shared cores, several engineers' tests beside these: a starved process may not beat for seconds, so
# the groups run with a generous bound (the default is 10 s: test_multihost.py's default-bound test runs at
# it; VSURGE_TEST_LANE_TIMEOUT_S sets another); the fault tests assert and print what they saw against it.
TEST_LANE_TIMEOUT_S = float(os.environ.get("VSURGE_TEST_LANE_TIMEOUT_S", "30"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ports() -> tuple[int, int]:
    """(HTTP port, coordinator port) with the coordinator port + 1 (the step lane) free too."""
    while True:
        c = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", c + 1))
        except OSError:
            continue
        return free_port(), c


def write_secret(directory: Path) -> Path:
    path = directory / "lane.key"
    path.write_text(secrets.token_urlsafe(48) + "\n")
    path.chmod(0o600)
    return path


def base_env(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VSURGE_", "LWS_", "TPU_"))}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0",
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        VSURGE_LANE_TIMEOUT_S=str(TEST_LANE_TIMEOUT_S),
    )
    env.update(extra)
    return env


class Group:
    """`vsurge serve` x N on loopback: process 0 serves HTTP, the others are its workers.

    ``engine``: extra VSURGE_* settings (features); ``delays``: seconds to wait before starting process i
    (a leader that comes late); ``env``: per-process overrides (a broken setting on one of them); ``args``:
    flags every process gets (``--lora NAME=SOURCE``, which has no variable)."""

    def __init__(
        self,
        tmp: Path,
        model: str,
        processes: int,
        devices: int,
        mesh: str,
        driver: str,
        engine: dict[str, str] | None = None,
        env: dict[int, dict[str, str]] | None = None,
        order: list[int] | None = None,
        delay: float = 0.0,
        secret: Path | None = None,
        args: list[str] | None = None,
    ):
        self.port, self.coordinator = ports()
        self.url = f"http://127.0.0.1:{self.port}"
        self.secret = secret or write_secret(tmp)
        self.logs = [tmp / f"process-{i}.log" for i in range(processes)]
        self.procs: list[subprocess.Popen | None] = [None] * processes
        for k, i in enumerate(order or range(processes)):
            if k and delay:
                time.sleep(delay)
            e = base_env(
                devices,
                VSURGE_COORDINATOR_ADDRESS=f"127.0.0.1:{self.coordinator}",
                VSURGE_NUM_PROCESSES=str(processes),
                VSURGE_PROCESS_ID=str(i),
                VSURGE_JOIN_TIMEOUT="300",
                VSURGE_LANE_SECRET_FILE=str(self.secret),
                VSURGE_MODEL=model,
                VSURGE_SERVED_MODEL_NAME="tiny",
                VSURGE_MESH=mesh,
                VSURGE_DRIVER=driver,
                VSURGE_MAX_LENGTH="64",
                VSURGE_PREFILL_LENGTHS="32",
                VSURGE_MAX_CONCURRENT_DECODES="2",
                VSURGE_PAGE_SIZE="16",
                VSURGE_HOST="127.0.0.1",
                VSURGE_PORT=str(self.port),
                VSURGE_METRICS_PORT="-1",
                VSURGE_TERMINATION_LOG=str(tmp / f"termination-{i}.log"),
                **(engine or {}),
            )
            e.update((env or {}).get(i, {}))
            with open(self.logs[i], "w") as log:
                self.procs[i] = subprocess.Popen(
                    [*SERVE, *(args or [])], env=e, stdout=log, stderr=subprocess.STDOUT
                )
        self.termination = [tmp / f"termination-{i}.log" for i in range(processes)]

    @property
    def lane_port(self) -> int:
        return self.coordinator + 1

    def log(self, i: int = 0) -> str:
        text = self.logs[i].read_text(errors="replace")
        return "\n".join(line for line in text.splitlines() if "[Gloo]" not in line)[-4000:]

    def wait_ready(self, timeout: float = 1200) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                assert p.poll() is None, f"process {i} exited {p.returncode}:\n{self.logs_text()}"
            try:
                if httpx.get(f"{self.url}/readiness", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"not ready in {timeout}s:\n{self.logs_text()}")

    def logs_text(self) -> str:
        return "\n".join(f"--- process {i}\n{self.log(i)[-1500:]}" for i in range(len(self.procs)))

    def wait_exits(self, timeout: float) -> list[int | None]:
        """Every process's exit status once all have exited, or None for those still running at ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.1)
        return [p.poll() for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
        for p in self.procs:
            if p is not None:
                p.wait(timeout=30)


def client(group: Group, timeout: float = 120):
    import openai

    return openai.OpenAI(base_url=f"{group.url}/v1", api_key="none", max_retries=0, timeout=timeout)


def held(group: Group, i: int) -> tuple[float, float]:
    m = re.search(r"holds ([0-9.]+) MiB of the model's ([0-9.]+) MiB", group.logs[i].read_text())
    assert m, group.log(i)
    return float(m.group(1)), float(m.group(2))
