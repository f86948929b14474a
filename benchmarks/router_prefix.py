"""Router policies on a shared-system-prompt workload: N `vsurge serve` pods behind `vsurge route`, on
loopback, measured for each routing policy (least-load, prefix, round-robin); then one pod killed and
one pod drained (SIGTERM) while requests run, counting what the clients saw.

    # tiny random model (made on the fly), 3 odriver pods, 8 system prompts x 12 users, 8 in flight:
    python benchmarks/router_prefix.py --tiny
    # a bigger random model (prefill then costs enough for the cache to show in TTFT):
    python benchmarks/router_prefix.py --tiny --tiny-hidden 512 --tiny-layers 8 --users 24
    # a real checkpoint, more users, JSON out:
    python benchmarks/router_prefix.py --model /models/llama --users 24 --json out.json

The workload: `--prompts` system prompts (about `--system-words` words each), each sent by `--users`
users with their own question, shuffled, `--concurrency` streams at a time, `max_tokens` each. Every
policy gets its own system prompts, so no policy finds pages an earlier one left in the pods' caches.
Per policy: prefix-cache hit rate (the answers' `usage.prompt_tokens_details.cached_tokens` over
`prompt_tokens`), output tokens per second over the run's wall time, TTFT p50 (request sent -> first
content chunk). Kill: SIGKILL one pod once it is running requests; a client error counts as "started"
when its stream had delivered a chunk before it broke (the only errors the router cannot hide: it
retries anything else on another pod). Drain: SIGTERM one pod the same way; no client may see an error.

Pods: `vsurge serve --driver odriver --page-size 16` (the paged engine with its prefix cache); the
router runs `--prefix-block-bytes 32 --prefix-key-blocks 2`, sized to the tiny model's short prompts (its
byte-level tokenizer of 320 tokens spends a token on one or two characters; the defaults, 256 bytes x 4,
suit real system prompts of a few hundred tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

SERVE_FLAGS = [
    "--driver=odriver",
    "--page-size=16",
    "--max-length=256",
    "--prefill-lengths=64,128,256",
    "--max-concurrent-decodes=4",
]
ROUTER_FLAGS = ["--prefix-block-bytes=32", "--prefix-key-blocks=2", "--load-poll-seconds=0.1"]
TOPICS = [
    "astronomy", "cooking", "tax law", "gardening", "chess", "sailing", "poetry", "databases",
    "medicine", "music theory", "geology", "painting", "robotics", "history", "linguistics", "finance",
]  # fmt: skip
FILLER = [
    "Answer briefly.", "Be polite.", "Cite sources when you can.", "Use plain words.", "Stay on topic.",
    "Prefer short sentences.", "Say when you are unsure.", "Never invent facts.", "Use examples.",
]  # fmt: skip


# ------------------------------------------------------------------------------------------ workload


def system_prompts(count: int, words: int, seed: int) -> list[str]:
    """`count` distinct system prompts of about `words` words; each differs from the others at its start."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        topic = TOPICS[(k + seed) % len(TOPICS)]
        text = f"[{seed}.{k}] You are an expert in {topic}."
        while len(text.split()) < words:
            text += " " + rng.choice(FILLER)
        out.append(text)
    return out


@dataclass(frozen=True)
class Job:
    system: int
    user: int
    messages: tuple[dict[str, str], ...]


def jobs(prompts: Sequence[str], users: int, seed: int, shuffle: bool = True) -> list[Job]:
    out = [
        Job(k, u, ({"role": "system", "content": s}, {"role": "user", "content": f"Question {u}: why?"}))
        for u in range(users)
        for k, s in enumerate(prompts)
    ]
    if shuffle:
        random.Random(seed).shuffle(out)
    return out


@dataclass
class Result:
    job: Job
    ok: bool = False
    error: str = ""
    started: bool = False  # a content chunk arrived before the end (or the error)
    ttft: float | None = None
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


async def one(client: httpx.AsyncClient, model: str, job: Job, max_tokens: int, stream: bool) -> Result:
    res = Result(job)
    body: dict[str, Any] = {
        "model": model,
        "messages": list(job.messages),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    try:
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and res.ttft is None:
                        res.ttft = time.perf_counter() - t0
                    res.started = True
                    if chunk.get("usage"):
                        _usage(res, chunk["usage"])
        else:
            r = await client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res
            res.ttft = time.perf_counter() - t0
            _usage(res, r.json()["usage"])
        res.ok = True
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.latency = time.perf_counter() - t0
    return res


def _usage(res: Result, usage: dict[str, Any]) -> None:
    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    res.completion_tokens = int(usage.get("completion_tokens") or 0)
    res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def run(
    base_url: str,
    model: str,
    work: Sequence[Job],
    *,
    concurrency: int,
    max_tokens: int,
    stream: bool | Callable[[Job], bool] = True,
    during: Callable[[list[Result]], Awaitable[None]] | None = None,
) -> tuple[list[Result], float]:
    """Send `work` with `concurrency` in flight; `during(results)` runs beside it (e.g. kills a pod)."""
    queue = list(work)
    results: list[Result] = []
    timeout = httpx.Timeout(300, connect=10)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:

        async def worker() -> None:
            while queue:
                job = queue.pop(0)
                wants = stream(job) if callable(stream) else stream
                results.append(await one(client, model, job, max_tokens, wants))

        t0 = time.perf_counter()
        side = asyncio.ensure_future(during(results)) if during is not None else None
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        if side is not None:
            if not side.done():  # the trigger never fired (e.g. every request failed fast)
                side.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await side
    return results, wall


@dataclass
class Summary:
    requests: int
    errors: int
    hit_rate: float
    tok_per_s: float
    ttft_p50_ms: float
    wall_s: float
    hits: int = 0  # answers that reused cached pages
    errors_started: int = 0
    errors_not_started: int = 0
    error_samples: list[str] = field(default_factory=list)


def summarize(results: Sequence[Result], wall: float) -> Summary:
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return Summary(
        requests=len(results),
        errors=len(bad),
        hit_rate=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        tok_per_s=sum(r.completion_tokens for r in ok) / wall if wall > 0 else 0.0,
        ttft_p50_ms=1000 * statistics.median(ttfts) if ttfts else 0.0,
        wall_s=wall,
        hits=sum(1 for r in ok if r.cached_tokens > 0),
        errors_started=sum(1 for r in bad if r.started),
        errors_not_started=sum(1 for r in bad if not r.started),
        error_samples=[r.error for r in bad[:5]],
    )


async def when_busy(
    pod_url: str, results: list[Result], after: int, act: Callable[[], None]
) -> dict[str, Any]:
    """Once `after` requests are done and the pod runs at least one, `act()` (kill or SIGTERM it)."""
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            if len(results) >= after:
                try:
                    load = (await client.get(f"{pod_url}/load")).json()
                except (httpx.HTTPError, ValueError):
                    load = {}
                if (load.get("requests_running") or 0) >= 1:
                    act()
                    return {"at_request": len(results), "pod_running": load.get("requests_running")}
            await asyncio.sleep(0.02)


# -------------------------------------------------------------------------------------------- processes


class Proc:
    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.args, self.log, self.env = args, log, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        self.proc = subprocess.Popen(
            self.args, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=self.env
        )
        return self

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[:3]} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{url} not ready after {timeout}s")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vsurge() -> list[str]:
    return [sys.executable, "-c", "import sys; from vsurge.cli.main import main; sys.exit(main())"]


def serve_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VSURGE_", "KUBECONFIG"))}
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("XLA_FLAGS", None)  # one device per pod
    return env


def start_pods(model: str, name: str, count: int, root: Path, flags: Sequence[str]) -> list[tuple[Proc, str]]:
    pods = []
    for i in range(count):
        port = free_port()
        args = [*vsurge(), "serve", f"--model={model}", f"--served-model-name={name}", "--host=127.0.0.1",
                f"--port={port}", "--metrics-port=-1", *flags]  # fmt: skip
        pods.append((Proc(args, root / f"pod-{i}.log", serve_env()).start(), f"http://127.0.0.1:{port}"))
    for proc, url in pods:
        proc.wait_http(f"{url}/readiness", 600)
    return pods


def start_router(config: Path, root: Path, policy: str, flags: Sequence[str]) -> tuple[Proc, str]:
    port = free_port()
    args = [*vsurge(), "route", f"--static-config={config}", "--host=127.0.0.1", f"--port={port}",
            f"--routing={policy}", *flags]  # fmt: skip
    proc = Proc(args, root / f"router-{policy}.log", serve_env()).start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(f"{url}/readiness", 60)
    return proc, url


def write_config(path: Path, name: str, upstreams: Sequence[str]) -> Path:
    path.write_text(json.dumps({"models": [{"name": name, "upstreams": list(upstreams)}]}))
    return path


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory")
    p.add_argument(
        "--tiny", action="store_true", help="make a tiny random llama (tests/service/tiny_models.py)"
    )
    p.add_argument("--tiny-hidden", type=int, default=64, help="its hidden size (64: the tests' model)")
    p.add_argument("--tiny-layers", type=int, default=2, help="its layers")
    p.add_argument("--pods", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--system-words", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--policies", default="least-load,prefix,round-robin")
    p.add_argument("--no-faults", action="store_true", help="skip the kill and drain runs")
    p.add_argument(
        "--overhead",
        type=int,
        default=0,
        metavar="N",
        help="also time N one-token requests straight to a pod and through the router (polling /load or not)",
    )
    p.add_argument("--serve-flags", default=" ".join(SERVE_FLAGS))
    p.add_argument("--router-flags", default=" ".join(ROUTER_FLAGS))
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="router-prefix-"))
    model = args.model
    if args.tiny or not model:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "service"))
        from tiny_models import make_checkpoint

        make_checkpoint(root / "tiny", "llama", seed=0, hidden=args.tiny_hidden, layers=args.tiny_layers)
        model = str(root / "tiny")
    name = "bench"
    pods = start_pods(model, name, args.pods, root, args.serve_flags.split())
    config = write_config(root / "static.json", name, [u for _, u in pods])
    router_flags = args.router_flags.split()
    out: dict[str, Any] = {"args": vars(args), "policies": {}}
    try:
        for i, policy in enumerate(args.policies.split(",")):
            router, url = start_router(config, root, policy, router_flags)
            try:
                work = jobs(system_prompts(args.prompts, args.system_words, seed=100 + i), args.users, seed=i)
                results, wall = asyncio.run(
                    run(url, name, work, concurrency=args.concurrency, max_tokens=args.max_tokens)
                )
            finally:
                router.stop()
            out["policies"][policy] = asdict(summarize(results, wall))
        if args.overhead:
            out["overhead"] = overhead(config, root, pods[0][1], name, router_flags, args.overhead)
        if not args.no_faults and args.pods >= 3:
            out["kill"] = fault_run(config, root, pods[0], signal.SIGKILL, args, name, router_flags, seed=50)
            out["drain"] = fault_run(config, root, pods[1], signal.SIGTERM, args, name, router_flags, seed=60)
    finally:
        for proc, _ in pods:
            proc.stop()
    print(table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def fault_run(config: Path, root: Path, pod: tuple[Proc, str], sig: int, args: argparse.Namespace, name: str,
              router_flags: Sequence[str], seed: int) -> dict[str, Any]:  # fmt: skip
    """The prefix policy again, half the requests streamed, while one pod is killed or drained."""
    router, url = start_router(config, root, "prefix", router_flags)
    proc, pod_url = pod
    try:
        work = jobs(system_prompts(args.prompts, args.system_words, seed=seed), args.users, seed=seed)
        info: dict[str, Any] = {}

        async def during(results: list[Result]) -> None:
            info.update(await when_busy(pod_url, results, len(work) // 4, lambda: proc.signal(sig)))

        results, wall = asyncio.run(
            run(
                url,
                name,
                work,
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                stream=lambda j: j.user % 2 == 0,
                during=during,
            )  # fmt: skip
        )
    finally:
        router.stop()
    s = asdict(summarize(results, wall))
    s["non_streamed_errors"] = sum(1 for r in results if not r.ok and r.job.user % 2 == 1)
    s.update(info)
    return s


def overhead(config: Path, root: Path, pod_url: str, name: str, router_flags: Sequence[str], n: int) -> dict:
    """Latency of one-token answers, one at a time: straight to a pod, and through the router with and
    without /load polling (p50 / p99 ms). The router's cost per request, and what polling adds to it."""

    def timed(url: str) -> dict[str, float]:
        body = {"model": name, "prompt": "Hello", "max_tokens": 1}
        samples = []
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(n):
                t0 = time.perf_counter()
                assert c.post("/v1/completions", json=body).status_code == 200
                samples.append(1000 * (time.perf_counter() - t0))
        samples.sort()
        return {"p50_ms": samples[len(samples) // 2], "p99_ms": samples[int(0.99 * (len(samples) - 1))]}

    single = write_config(root / "single.json", name, [pod_url])
    out = {"direct": timed(pod_url)}
    for label, extra in (("router, /load polled", []), ("router, no polling", ["--load-poll-seconds=0"])):
        router, url = start_router(single, root, "least-load", [*router_flags, *extra])
        try:
            timed(url)  # warm the connections
            out[label] = timed(url)
        finally:
            router.stop()
    return out


def table(out: dict[str, Any]) -> str:
    lines = [
        "| policy | requests | errors | prefix-cache hit rate (tokens) | answers with a hit | output tok/s | TTFT p50 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for policy, s in out["policies"].items():
        lines.append(
            f"| {policy} | {s['requests']} | {s['errors']} | {s['hit_rate']:.1%} | {s['hits']} | {s['tok_per_s']:.1f} | "
            f"{s['ttft_p50_ms']:.0f} |"
        )
    if "overhead" in out:
        lines.append("\n| one-token request, one at a time | p50 (ms) | p99 (ms) |\n|---|---:|---:|")
        for label, o in out["overhead"].items():
            lines.append(f"| {label} | {o['p50_ms']:.2f} | {o['p99_ms']:.2f} |")
    for kind in ("kill", "drain"):
        if kind in out:
            s = out[kind]
            lines.append(
                f"\n{kind}: {s['requests']} requests, {s['errors']} client errors ({s['errors_started']} on streams "
                f"that had started, {s['errors_not_started']} before any byte, {s['non_streamed_errors']} "
                f"non-streamed); pod signalled at request {s.get('at_request')} while running "
                f"{s.get('pod_running')}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
