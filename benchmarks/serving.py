"""Serving benchmark: latency and throughput of any OpenAI-compatible server, or of vSurge in-process.

    # against a running server (vsurge serve, vLLM, ...), 32 concurrent streams:
    python benchmarks/serving.py --base-url http://127.0.0.1:11556/v1 --concurrency 32 --num-requests 128
    # Poisson arrivals at 4 requests/s instead of a fixed concurrency:
    python benchmarks/serving.py --base-url http://127.0.0.1:11556/v1 --request-rate 4 --num-requests 100
    # HTTP against in-process on the same engine, side by side in one run (A/B/A/B...):
    python benchmarks/serving.py --compare --model default --concurrency 32 --num-requests 128

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
    one: Any, prompts: list[str], concurrency: int | None, rate: float | None, seed: int
) -> tuple[list[RequestResult], float]:
    """Run `one(prompt)` for every prompt at a fixed concurrency or with Poisson arrivals at `rate`/s."""
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    if rate:
        rng = random.Random(seed)
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        tasks = []

        async def guarded(p: str) -> None:
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


async def http_run(args: argparse.Namespace, prompts: list[str]) -> tuple[list[RequestResult], float]:
    import aiohttp

    base = args.base_url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    connector = aiohttp.TCPConnector(limit=0, ssl=False if args.insecure else None)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = args.model_name
        if not model:
            async with session.get(f"{base}/models") as r:
                model = (await r.json())["data"][0]["id"]
        chat = args.endpoint == "chat"
        url = f"{base}/chat/completions" if chat else f"{base}/completions"

        async def one(prompt: str) -> RequestResult:
            body: dict[str, Any] = {
                "model": model,
                "max_tokens": args.max_tokens,
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

        for p in prompts[: args.warmup]:
            await one(p)
        return await run_schedule(one, prompts, args.concurrency, args.request_rate, args.seed)


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
    surge: Any, args: argparse.Namespace, prompts: list[str]
) -> tuple[list[RequestResult], float]:
    from vsurge.request import vSurgeRequest
    from vsurge.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
    proc = surge.processor
    chat = args.endpoint == "chat"

    def text(p: str) -> str:
        if not chat:
            return p
        return proc.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )

    async def one(prompt: str) -> RequestResult:
        res = RequestResult(ok=False, start=time.perf_counter())
        last = None
        try:
            async for samples in surge.complete(vSurgeRequest.from_sampling_params(text(prompt), sp)):
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

    for p in prompts[: args.warmup]:
        await one(p)
    return await run_schedule(one, prompts, args.concurrency, args.request_rate, args.seed)


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
    args = p.parse_args(argv)
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 32
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = make_prompts(args.num_requests, args.prompt_words, args.seed)
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
