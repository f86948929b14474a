"""The serving benchmark's clients: the schedule (fixed concurrency or Poisson arrivals), the OpenAI HTTP
client with streaming timings, and vSurge in-process on the same jobs."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # siblings, run as a script or via runpy

from serving_report import RequestResult  # noqa: E402
from serving_workloads import Job, as_jobs  # noqa: E402

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
    from vsurge import vSurge

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


def inprocess_caller(surge: Any, args: argparse.Namespace) -> Any:
    """`one(job) -> RequestResult` through `vSurge.complete`, timed as the HTTP client times a stream (the
    chat endpoint's prompt through the model's chat template, as the server would apply it)."""
    from vsurge.contracts.sampling_params import SamplingParams
    from vsurge.seed_api.request import vSurgeRequest

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

    return one


async def inprocess_run(
    surge: Any, args: argparse.Namespace, prompts: list[str] | list[Job]
) -> tuple[list[RequestResult], float]:
    jobs = as_jobs(prompts)
    one = inprocess_caller(surge, args)
    for j in jobs[: args.warmup]:
        await one(Job(j.prompt, min(j.max_tokens or args.max_tokens, 8)))
    return await run_schedule(one, jobs, args.concurrency, args.request_rate, args.seed)
