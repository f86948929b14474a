"""Serving benchmark: latency and throughput of any OpenAI-compatible server, or of vSurge in-process.

    # against a running server (vsurge serve, vLLM, ...), 32 concurrent streams:
    python benchmarks/serving.py --base-url http://127.0.0.1:11556/v1 --concurrency 32 --num-requests 128
    # Poisson arrivals at 4 requests/s instead of a fixed concurrency:
    python benchmarks/serving.py --base-url http://127.0.0.1:11556/v1 --request-rate 4 --num-requests 100
    # HTTP against in-process on the same engine, side by side in one run (A/B/A/B...):
    python benchmarks/serving.py --compare --model default --concurrency 32 --num-requests 128
    # a named workload (see PRESETS): 64 streaming completions, 32 in flight, prompts 32-512 tokens:
    python benchmarks/serving.py --base-url http://127.0.0.1:11556/v1 --preset mixed-32
    # the same workload against vsurge (both drivers), vLLM CPU and llama.cpp, one at a time, one table:
    PEERS=$HOME/peers python benchmarks/serving.py --peers --preset mixed-32   # peers installed under $PEERS

Per request: TTFT (send -> first content chunk), TPOT = (latency - TTFT) / (output tokens - 1), ITL (gaps
between content chunks), end-to-end latency; reported as mean / p50 / p99, with request throughput and
output-token throughput over the wall time of the run. Output tokens come from the server's usage
(stream_options.include_usage); `--ignore-eos` (a vLLM / vSurge extension) makes every output exactly
--max-tokens long so runs are comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "it",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "or",
    "has",
    "had",
    "not",
    "but",
    "they",
    "one",
    "their",
    "also",
    "its",
    "first",
    "new",
    "after",
    "who",
    "two",
    "been",
    "have",
    "more",
    "other",
    "when",
    "time",
    "into",
    "during",
    "city",
    "world",
    "river",
    "music",
    "school",
    "system",
    "model",
    "serving",
    "token",
    "engine",
    "stream",
    "batch",
    "cache",
    "device",
    "memory",
]


@dataclass
class RequestResult:
    ok: bool
    start: float
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    status: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


@dataclass(frozen=True)
class Job:
    """One request of a workload: its prompt and, where the workload varies it, its own max_tokens."""

    prompt: str
    max_tokens: int | None = None  # None: --max-tokens
    prompt_words: int = 0


@dataclass(frozen=True)
class Preset:
    """A named workload: every server is measured on exactly the same requests (fixed seed)."""

    description: str
    num_requests: int
    concurrency: int
    prompt_tokens: tuple[int, int]  # inclusive range, drawn uniformly per request
    max_tokens: tuple[int, int]  # inclusive range, drawn uniformly per request
    endpoint: str = "completions"
    ignore_eos: bool = True
    temperature: float = 0.0
    # random: random words; quote: a passage of random words given twice and asked for a third time
    # (the output repeats its context, as in summarising, quoting or editing: n-gram speculation's case)
    prompts: str = "random"


# Issue 14's workload: arriving traffic with long prompts, where decode can stall behind prefill.
PRESETS: dict[str, Preset] = {
    "mixed-32": Preset(
        "64 streaming /v1/completions, 32 in flight, prompts 32-512 tokens, max_tokens 16-256, ignore_eos, "
        "temperature 0",
        num_requests=64,
        concurrency=32,
        prompt_tokens=(32, 512),
        max_tokens=(16, 256),
    ),
    "mixed-64": Preset(
        "the mixed-32 requests at 64 in flight",
        num_requests=64,
        concurrency=64,
        prompt_tokens=(32, 512),
        max_tokens=(16, 256),
    ),
    "sampled-32": Preset(
        "the mixed-32 requests at temperature 1.0 (text that seldom repeats itself: speculation's worst case)",
        num_requests=64,
        concurrency=32,
        prompt_tokens=(32, 512),
        max_tokens=(16, 256),
        temperature=1.0,
    ),
    "quote-32": Preset(
        "64 streaming /v1/completions, 32 in flight: a passage of 48-160 words given twice, then asked for "
        "again; max_tokens 64-192, ignore_eos, temperature 0 (repetitive output: speculation's case)",
        num_requests=64,
        concurrency=32,
        prompt_tokens=(48, 160),
        max_tokens=(64, 192),
        prompts="quote",
    ),
}


def make_jobs(
    n: int,
    prompt_tokens: tuple[int, int],
    max_tokens: tuple[int, int],
    seed: int,
    prompts: str = "random",
) -> list[Job]:
    """n requests with prompt lengths and max_tokens drawn uniformly from the inclusive ranges.

    A prompt of N tokens is N words of WORDS: each is one token (with its leading space) for the
    SmolLM2/Llama BPE vocabularies, so every server sees the same text and about the same length; the
    exact counts come back in each answer's usage. Prompts are random, so no prefix cache gets them free.
    ``prompts="quote"``: the drawn length is the passage's; the prompt holds it twice (about 2x + 12
    tokens) and asks for it once more.
    """
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        words = rng.randint(*prompt_tokens)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        if prompts == "quote":
            text = f"Text: {text}\nThe same text again: {text}\nThe same text once more:"
        elif prompts != "random":
            raise ValueError(f"unknown prompt kind {prompts!r}")
        jobs.append(Job(prompt=text, max_tokens=rng.randint(*max_tokens), prompt_words=words))
    return jobs


def as_jobs(prompts: list[str] | list[Job]) -> list[Job]:
    return [p if isinstance(p, Job) else Job(p) for p in prompts]


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    v = sorted(values)

    def pct(p: float) -> float:
        k = (len(v) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return {"mean": sum(v) / len(v), "p50": pct(0.5), "p99": pct(0.99)}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "statuses": statuses,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (out_tokens + in_tokens) / duration if duration else 0.0,
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "ttft_s": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": _stats([x for r in ok for x in r.itl]),
        "e2e_s": _stats([r.latency for r in ok if r.latency is not None]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


# ----------------------------------------------------------------------------------------- schedule


async def run_schedule(
    one: Any, prompts: list[Any], concurrency: int | None, rate: float | None, seed: int
) -> tuple[list[RequestResult], float]:
    """Run `one(item)` for every item at a fixed concurrency or with Poisson arrivals at `rate`/s."""
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    if rate:
        rng = random.Random(seed)
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        tasks = []

        async def guarded(p: Any) -> None:
            if sem is None:
                results.append(await one(p))
                return
            async with sem:
                results.append(await one(p))

        for p in prompts:
            tasks.append(asyncio.create_task(guarded(p)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    else:
        queue = list(reversed(prompts))

        async def worker() -> None:
            while queue:
                results.append(await one(queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
    return results, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------- HTTP


async def http_run(
    args: argparse.Namespace, prompts: list[str] | list[Job]
) -> tuple[list[RequestResult], float]:
    import aiohttp

    jobs = as_jobs(prompts)
    base = args.base_url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    # a fresh connection per request: llama-server closes a keep-alive connection after a few requests, and
    # a pooled one it closed fails the next request's write ("Can not write request body"); on loopback the
    # handshake costs every server the same ~0.1 ms
    connector = aiohttp.TCPConnector(limit=0, force_close=True, ssl=False if args.insecure else None)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = args.model_name
        if not model:
            async with session.get(f"{base}/models") as r:
                model = (await r.json())["data"][0]["id"]
        chat = args.endpoint == "chat"
        url = f"{base}/chat/completions" if chat else f"{base}/completions"

        async def one(job: Job) -> RequestResult:
            prompt = job.prompt
            body: dict[str, Any] = {
                "model": model,
                "max_tokens": job.max_tokens or args.max_tokens,
                "temperature": args.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.ignore_eos:
                body["ignore_eos"] = True
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            res = RequestResult(ok=False, start=time.perf_counter())
            last = None
            chunks = 0
            try:
                async with session.post(url, json=body) as resp:
                    res.status = resp.status
                    if resp.status != 200:
                        res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                        return res
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            res.error = str(obj["error"].get("message"))[:200]
                            return res
                        if obj.get("usage"):
                            res.output_tokens = obj["usage"]["completion_tokens"]
                            res.prompt_tokens = obj["usage"]["prompt_tokens"]
                        for c in obj.get("choices") or ():
                            text = c.get("delta", {}).get("content") if chat else c.get("text")
                            if text:
                                now = time.perf_counter()
                                if res.ttft is None:
                                    res.ttft = now - res.start
                                else:
                                    res.itl.append(now - last)
                                last = now
                                chunks += 1
                res.latency = time.perf_counter() - res.start
                if not res.output_tokens:
                    res.output_tokens = chunks  # a server without include_usage: one token per chunk
                res.ok = True
            except Exception as e:  # a benchmark records failures, it does not stop on them
                res.error = f"{type(e).__name__}: {e}"[:200]
            return res

        for j in jobs[: args.warmup]:  # short: warm-up compiles/caches, it is not part of the workload
            await one(Job(j.prompt, min(j.max_tokens or args.max_tokens, 8)))
        return await run_schedule(one, jobs, args.concurrency, args.request_rate, args.seed)


# --------------------------------------------------------------------------------------- in-process


def build_surge(args: argparse.Namespace) -> Any:
    import vsurge
    from vsurge.surge import vSurge

    t = time.perf_counter()
    model, processor = vsurge.load_model(args.model, dtype=args.dtype)
    surge = vSurge.create_vdriver(
        model,
        processor,
        max_concurrent_decodes=args.slots,
        prefill_lengths=args.prefill_lengths,
        max_length=args.max_length,
        vsurge_name=args.model_name or "bench",
    )
    print(f"# loaded in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    t = time.perf_counter()
    surge.compile()
    print(f"# compiled in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    surge.start()
    return surge


async def inprocess_run(
    surge: Any, args: argparse.Namespace, prompts: list[str] | list[Job]
) -> tuple[list[RequestResult], float]:
    from vsurge.request import vSurgeRequest
    from vsurge.sampling_params import SamplingParams

    jobs = as_jobs(prompts)

    def params(job: Job) -> SamplingParams:
        return SamplingParams(
            max_tokens=job.max_tokens or args.max_tokens,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
        )

    proc = surge.processor
    chat = args.endpoint == "chat"

    def text(p: str) -> str:
        if not chat:
            return p
        return proc.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )

    async def one(job: Job) -> RequestResult:
        res = RequestResult(ok=False, start=time.perf_counter())
        last = None
        try:
            request = vSurgeRequest.from_sampling_params(text(job.prompt), params(job))
            async for samples in surge.complete(request):
                for s in samples:
                    res.output_tokens = max(res.output_tokens, s.num_generated_tokens)
                    res.prompt_tokens = s.num_prompt_tokens
                    if s.text:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - res.start
                        else:
                            res.itl.append(now - last)
                        last = now
            res.latency = time.perf_counter() - res.start
            res.ok, res.status = True, 200
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"[:200]
        return res

    for j in jobs[: args.warmup]:
        await one(Job(j.prompt, min(j.max_tokens or args.max_tokens, 8)))
    return await run_schedule(one, jobs, args.concurrency, args.request_rate, args.seed)


# ------------------------------------------------------------------------------------------ compare


def compare(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """In-process vSurge vs the same vSurge behind vSurgeApiServer, alternating, client in a subprocess."""
    from vsurge.server import start, vSurgeApiServer

    surge = build_surge(args)
    api = vSurgeApiServer({args.model_name or "bench": surge})
    api.mark_ready()
    running = start(
        api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=False, progress=None, log_level="warning"
    )
    runs: dict[str, list[dict[str, Any]]] = {"inprocess": [], "http": []}
    try:
        for r in range(args.repeats):
            results, duration = asyncio.run(inprocess_run(surge, args, prompts))
            runs["inprocess"].append(summarize(results, duration))
            cmd = [
                sys.executable, os.path.abspath(__file__), "--base-url", f"{running.url}/v1",
                "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens),
                "--prompt-words", str(args.prompt_words), "--endpoint", args.endpoint,
                "--temperature", str(args.temperature), "--seed", str(args.seed), "--warmup", str(args.warmup),
                "--json",
            ]  # fmt: skip
            cmd += ["--concurrency", str(args.concurrency)] if args.concurrency else []
            cmd += ["--request-rate", str(args.request_rate)] if args.request_rate else []
            cmd += ["--ignore-eos"] if args.ignore_eos else []
            cmd += ["--preset", args.preset] if args.preset else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs["http"].append(json.loads(out))
            print(
                f"# round {r + 1}: in-process {runs['inprocess'][-1]['output_token_throughput']:.1f} tok/s, "
                f"HTTP {runs['http'][-1]['output_token_throughput']:.1f} tok/s",
                file=sys.stderr,
            )
    finally:
        running.stop()
        surge.stop()
    best = {k: max(v, key=lambda s: s["output_token_throughput"]) for k, v in runs.items()}
    mean = {k: sum(s["output_token_throughput"] for s in v) / len(v) for k, v in runs.items()}
    return {
        "inprocess": best["inprocess"],
        "http": best["http"],
        "mean_output_token_throughput": mean,
        "http_over_inprocess": mean["http"] / mean["inprocess"] if mean["inprocess"] else None,
    }


# -------------------------------------------------------------------------------------------- peers


def _peers_module() -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script or via runpy
    import peers

    return peers


def peers_run(args: argparse.Namespace, jobs: list[Job]) -> list[tuple[str, dict[str, Any] | None, str]]:
    """Each server in turn: start, wait for ready, the same jobs with the same client, stop. Table rows."""
    import copy
    import tempfile

    peers = _peers_module()
    log_dir = args.peers_log_dir or tempfile.mkdtemp(prefix="vsurge-peers-")
    rows: list[tuple[str, dict[str, Any] | None, str]] = []
    for peer in peers.discover(args, args.concurrency):
        if isinstance(peer, peers.Skipped):
            print(f"# {peer.name}: skipped: {peer.reason}", file=sys.stderr)
            rows.append((peer.name, None, f"skipped: {peer.reason}"))
            continue
        print(f"# {peer.name}: starting: {' '.join(peer.argv)}", file=sys.stderr)
        try:
            with peers.running(peer, log_dir, args.ready_timeout) as (_, ready_s):
                print(f"# {peer.name}: ready in {ready_s:.0f}s, running the workload", file=sys.stderr)
                run_args = copy.copy(args)
                run_args.base_url, run_args.model_name, run_args.api_key = peer.base_url, None, None
                results, duration = asyncio.run(http_run(run_args, jobs))
        except peers.PeerFailed as e:
            print(f"# {e}", file=sys.stderr)
            rows.append((peer.name, None, str(e).splitlines()[0][:200]))
            continue
        summary = summarize(results, duration)
        print(f"== {peer.name} ==\n{_fmt(summary)}", file=sys.stderr)
        note = f"ready in {ready_s:.0f}s"
        if summary["failed"]:
            note += f"; errors: {summary['errors'][:1]}"
        rows.append((peer.name, summary, note))
    return rows


# ---------------------------------------------------------------------------------------------- main


def _fmt(summary: dict[str, Any]) -> str:
    def ms(d: dict[str, float | None]) -> str:
        return " / ".join("-" if d[k] is None else f"{d[k] * 1000:.1f}" for k in ("mean", "p50", "p99"))

    return "\n".join(
        [
            f"requests            {summary['completed']}/{summary['requests']} ok   statuses {summary['statuses']}",
            f"duration            {summary['duration_s']:.2f} s",
            f"request throughput  {summary['request_throughput']:.2f} req/s",
            f"output throughput   {summary['output_token_throughput']:.1f} tok/s "
            f"(total incl. prompt {summary['total_token_throughput']:.1f} tok/s)",
            f"TTFT  ms mean/p50/p99  {ms(summary['ttft_s'])}",
            f"TPOT  ms mean/p50/p99  {ms(summary['tpot_s'])}",
            f"ITL   ms mean/p50/p99  {ms(summary['itl_s'])}",
            f"E2E   ms mean/p50/p99  {ms(summary['e2e_s'])}",
        ]
        + ([f"errors              {summary['errors']}"] if summary["errors"] else [])
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:11556/v1", help="OpenAI-compatible base URL")
    p.add_argument("--model-name", default=None, help="`model` to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument(
        "--concurrency", type=int, default=None, help="requests in flight (default 32 without a rate)"
    )
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent one by one before measuring")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    # in-process / compare
    p.add_argument("--in-process", action="store_true", help="drive vSurge directly (no HTTP)")
    p.add_argument(
        "--compare", action="store_true", help="in-process vs HTTP on the same engine, alternating"
    )
    p.add_argument("--repeats", type=int, default=2, help="rounds of the comparison")
    p.add_argument("--model", default="default", help="model for --in-process / --compare")
    p.add_argument("--dtype", default=None)
    p.add_argument("--slots", type=int, default=32, help="max concurrent decodes (in-process / compare)")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--prefill-lengths", type=lambda s: [int(x) for x in s.split(",")], default=None)
    # presets and peers
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named workload; sets requests, concurrency, lengths, endpoint, ignore_eos, temperature "
        "(--concurrency still overrides). "
        + "; ".join(f"{k}: {v.description}" for k, v in sorted(PRESETS.items())),
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help="start each of --servers in turn on a free loopback port, run the workload, print one table",
    )
    p.add_argument(
        "--servers",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=["vsurge-vdriver", "vsurge-odriver", "vllm", "llama.cpp"],
        help="peers to run, in order (default: vsurge-vdriver,vsurge-odriver,vllm,llama.cpp)",
    )
    p.add_argument(
        "--vllm",
        default=None,
        help="vllm executable (default: $VLLM_BIN, then $PEERS/vllm-venv/bin/vllm, then PATH)",
    )
    p.add_argument(
        "--llama-server",
        default=None,
        help="llama-server executable (default: $LLAMA_SERVER, then $PEERS/llama-build/bin/llama-server, then PATH)",
    )
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: --model's, or the default)")
    p.add_argument(
        "--hf-model", default=None, help="HF directory for vLLM (default: made from the GGUF, cached)"
    )
    p.add_argument("--vsurge-args", default="", help="extra `vsurge serve` arguments (one string)")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` arguments (one string)")
    p.add_argument("--llama-args", default="", help="extra `llama-server` arguments (one string)")
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a peer may take to start")
    p.add_argument("--peers-log-dir", default=None, help="where peers' logs go (default: a temp dir)")
    args = p.parse_args(argv)
    if args.preset:
        preset = PRESETS[args.preset]
        args.num_requests = preset.num_requests
        args.concurrency = args.concurrency or preset.concurrency
        args.endpoint, args.ignore_eos, args.temperature = (
            preset.endpoint,
            preset.ignore_eos,
            preset.temperature,
        )
        args.request_rate = None
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 32
    return args


def workload(args: argparse.Namespace) -> list[Job]:
    """The jobs of a run: the preset's (seeded by --seed), else --num-requests prompts of --prompt-words."""
    if args.preset:
        preset = PRESETS[args.preset]
        return make_jobs(
            preset.num_requests, preset.prompt_tokens, preset.max_tokens, args.seed, preset.prompts
        )
    return as_jobs(make_prompts(args.num_requests, args.prompt_words, args.seed))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = workload(args)
    if args.peers:
        # SIGTERM unwinds like Ctrl-C, so the peer in flight is stopped (it runs in its own session)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        rows = peers_run(args, prompts)
        if args.json:
            print(json.dumps([{"server": n, "summary": s, "note": note} for n, s, note in rows], indent=2))
        else:
            print(
                f"workload: {args.preset or 'custom'}, {len(prompts)} requests, {args.concurrency} in flight"
            )
            print(_peers_module().table(rows))
        return 0 if any(s and s["completed"] for _, s, _ in rows) else 1
    if args.compare:
        result = compare(args, prompts)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print("== in-process vSurge ==\n" + _fmt(result["inprocess"]))
            print("== HTTP (vSurgeApiServer) ==\n" + _fmt(result["http"]))
            print(
                f"HTTP / in-process output throughput (mean of rounds): {result['http_over_inprocess']:.3f}"
            )
        return 0
    if args.in_process:
        surge = build_surge(args)
        try:
            results, duration = asyncio.run(inprocess_run(surge, args, prompts))
        finally:
            surge.stop()
    else:
        results, duration = asyncio.run(http_run(args, prompts))
    summary = summarize(results, duration)
    print(json.dumps(summary, indent=2) if args.json else _fmt(summary))
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
