"""Soak: many concurrent streaming clients, a third of them hanging up mid-stream, malformed requests mixed in.

    python benchmarks/soak.py                        # 200 clients, 60 s, against `vsurge serve` on a tiny model
    python benchmarks/soak.py --clients 50 --duration 10
    python benchmarks/soak.py --base-url http://127.0.0.1:11556 --model my-model   # any running vSurge server

Without --base-url it makes a tiny random Llama (tests/service/tiny_models.py) and starts `vsurge serve` on it
in a subprocess, so the server's resident memory is measured on its own. Reports: status codes of valid and
of malformed requests, 5xx count (must be 0), disconnects, slots still used after the load (must be 0), and
the server's RSS after warm-up and at the end (should be flat). Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

MALFORMED = [
    b'{"model": "MODEL", "messages": [',
    b"\xff\xfe\xfd not utf-8",
    b'["not", "an", "object"]',
    b'{"model": "MODEL", "messages": "hello"}',
    b'{"model": "MODEL", "messages": [], "max_tokens": 5}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_tokens": -4}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "temperature": 1e308}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "n": 100000000000000000000}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
    b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}',
    b'{"model": "MODEL", "prompt": [999999999], "max_tokens": 2}',
]


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process from /proc (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def parse_metrics(text: str, model: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("model") == model and len(s.labels) == 1:
                out[s.name] = s.value
    return out


async def soak(
    base_url: str,
    model: str,
    *,
    clients: int = 200,
    duration: float = 60.0,
    disconnect_fraction: float = 1 / 3,
    malformed_fraction: float = 0.1,
    max_tokens: int = 64,
    seed: int = 0,
    server_pid: int | None = None,
    metrics_url: str | None = None,
    warmup: float = 3.0,
) -> dict[str, Any]:
    """Run the soak against `base_url` (the server root, no /v1); returns the report."""
    import aiohttp

    base = base_url.rstrip("/")
    metrics_url = metrics_url or f"{base}/metrics"
    valid: Counter[str] = Counter()
    malformed: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    rss: list[tuple[float, int]] = []
    t_start = time.monotonic()
    deadline = t_start + warmup + duration
    bodies = [m.replace(b"MODEL", model.encode()) for m in MALFORMED]

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        r = random.Random(seed * 100003 + i)
        while time.monotonic() < deadline:
            if r.random() < malformed_fraction:
                try:
                    async with session.post(f"{base}/v1/chat/completions", data=r.choice(bodies)) as resp:
                        await resp.read()
                        malformed[str(resp.status)] += 1
                except aiohttp.ClientError as e:
                    malformed[type(e).__name__] += 1
                continue
            hang_up = r.random() < disconnect_fraction
            n_tokens = r.randint(2, max_tokens)
            # hang up after a random number of frames, always before the last one (0: right after the headers)
            stop_after = r.randint(0, n_tokens - 1) if hang_up else None
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"client {i} says " + " ".join(r.choice("abcdefgh") for _ in range(r.randint(1, 20)))}],
                "max_tokens": n_tokens,
                "ignore_eos": hang_up,
                "temperature": r.choice([0.0, 0.7, 1.0]),
                "stream": True,
            }  # fmt: skip
            try:
                async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                    valid[str(resp.status)] += 1
                    if resp.status != 200:
                        await resp.read()
                        continue
                    chunks = 0
                    if stop_after == 0:
                        counts["disconnected"] += 1
                        resp.close()
                        continue
                    async for line in resp.content:
                        if line.startswith(b"data: [DONE]"):
                            counts["completed"] += 1
                            break
                        if line.startswith(b"data: "):
                            chunks += 1
                            if b'"error"' in line[:20]:
                                counts["in_band_error"] += 1
                        if stop_after is not None and chunks >= stop_after:
                            counts["disconnected"] += 1
                            resp.close()  # drop the connection mid-stream
                            break
            except (TimeoutError, aiohttp.ClientError) as e:
                counts[f"transport_{type(e).__name__}"] += 1

    async def sample_rss() -> None:
        while time.monotonic() < deadline:
            if server_pid is not None and (v := rss_bytes(server_pid)) is not None:
                rss.append((time.monotonic() - t_start, v))
            await asyncio.sleep(1.0)

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(sample_rss(), *(client(i, session) for i in range(clients)))
        # after the load: every slot must come back
        after: dict[str, float] = {}
        settle_deadline = time.monotonic() + 30
        while time.monotonic() < settle_deadline:
            async with session.get(metrics_url) as resp:
                after = parse_metrics(await resp.text(), model)
            if after.get("vsurge_slots_used", 1) == 0 and after.get("vsurge_requests_running", 1) == 0:
                break
            await asyncio.sleep(0.2)
        async with session.get(f"{base}/health") as resp:
            health = await resp.json()
    warm = [v for t, v in rss if t >= warmup]
    rss_after_warmup = warm[0] if warm else None
    rss_end = rss_bytes(server_pid) if server_pid is not None else None
    fivexx = sum(v for k, v in valid.items() if k.startswith("5")) + sum(
        v for k, v in malformed.items() if k.startswith("5")
    )
    report = {
        "clients": clients,
        "duration_s": duration,
        "valid_statuses": dict(valid),
        "malformed_statuses": dict(malformed),
        "counts": dict(counts),
        "status_5xx": fivexx,
        "slots_used_after": after.get("vsurge_slots_used"),
        "requests_running_after": after.get("vsurge_requests_running"),
        "in_flight_after": health.get("in_flight"),
        "rss_after_warmup_mb": rss_after_warmup / 2**20 if rss_after_warmup else None,
        "rss_end_mb": rss_end / 2**20 if rss_end else None,
        "rss_max_mb": max(v for _, v in rss) / 2**20 if rss else None,
    }
    report["ok"] = bool(
        fivexx == 0
        and report["slots_used_after"] == 0
        and report["in_flight_after"] == 0
        and not any(k.startswith("transport") for k in counts)
    )
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tiny_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """A tiny random Llama behind `vsurge serve` in a subprocess; returns (process, base URL)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "tests", "service"))
    from tiny_models import make_checkpoint

    directory = tempfile.mkdtemp(prefix="vsurge-soak-")
    make_checkpoint(directory, "llama")
    port = _free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
        "VSURGE_MODEL": directory,
        "VSURGE_SERVED_MODEL_NAME": args.model,
        "VSURGE_HOST": "127.0.0.1",
        "VSURGE_PORT": str(port),
        "VSURGE_METRICS_PORT": "-1",
        "VSURGE_MAX_CONCURRENT_DECODES": str(args.slots),
        "VSURGE_MAX_LENGTH": "256",
        "VSURGE_PREFILL_LENGTHS": "64,128",
        "VSURGE_LOG_LEVEL": "warning",
    }
    proc = subprocess.Popen([sys.executable, "-m", "vsurge.cli", "serve"], env=env)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vsurge serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/readiness", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the soak server did not become ready")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--base-url", default=None, help="server root (no /v1); default: start one on a tiny model"
    )
    p.add_argument("--model", default="tiny")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument(
        "--warmup", type=float, default=3.0, help="seconds of load before RSS is taken as baseline"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--disconnect-fraction", type=float, default=1 / 3)
    p.add_argument("--malformed-fraction", type=float, default=0.1)
    p.add_argument("--slots", type=int, default=32, help="max concurrent decodes of the tiny server")
    p.add_argument(
        "--server-pid", type=int, default=None, help="PID of a server given by --base-url, for RSS"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    proc = None
    base, pid = args.base_url, args.server_pid
    if base is None:
        proc, base = start_tiny_server(args)
        pid = proc.pid
    try:
        report = asyncio.run(
            soak(
                base,
                args.model,
                clients=args.clients,
                duration=args.duration,
                disconnect_fraction=args.disconnect_fraction,
                malformed_fraction=args.malformed_fraction,
                max_tokens=args.max_tokens,
                seed=args.seed,
                server_pid=pid,
                warmup=args.warmup,
            )
        )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k:24s} {v}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
