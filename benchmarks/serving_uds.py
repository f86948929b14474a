"""The serving sweep's parts: prompts of real prose, the official `openai` client streaming over an httpx
transport (a Unix socket, or TCP), a schedule with a deadline, a server process started and stopped
around the runs, and the CPU seconds of a process tree.

The prose is the opening of Jane Austen's *Pride and Prejudice* (1813, public domain; benchmarks/data/
prose.txt, 5 KB): requests ask to continue a passage of it, so prompts are natural text through the
model's chat template, not random words.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # siblings, run as a script or via runpy

from serving_report import RequestResult  # noqa: E402
from serving_workloads import Job, prose_passage  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def prose_jobs(n: int, words: tuple[int, int], outputs: tuple[int, int], seed: int) -> list[Job]:
    """n requests: each a passage of words[0]..words[1] words of the prose from a random place (wrapping
    round), asked to be continued, with max_tokens drawn from outputs (inclusive ranges)."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        k = rng.randint(*words)
        jobs.append(Job(prompt=prose_passage(rng, k), max_tokens=rng.randint(*outputs), prompt_words=k))
    return jobs


# ------------------------------------------------------------------------------------- CPU seconds


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant (a peer such as vLLM runs its
    engine in a child process; counting the parent alone would flatter it)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = int(fields[1])
    tree, grew = {pid}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree and p not in tree}
        tree |= more
        grew = bool(more)
    total = 0.0
    for p in tree:
        fields = _stat(p)
        if fields is not None:
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


# ----------------------------------------------------------------------------------------- schedule


async def schedule(
    one: Callable[[Job], Awaitable[RequestResult]],
    jobs: list[Job],
    *,
    concurrency: int | None,
    rate: float | None,
    seed: int,
    deadline: float,
) -> tuple[list[RequestResult], float, int]:
    """Every job, at most ``concurrency`` in flight, arriving as a Poisson process of ``rate``/s (None or
    inf: all at once); what is still running at ``deadline`` is cancelled. (results, seconds, cancelled)"""
    results: list[RequestResult] = []
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)

    async def guarded(job: Job) -> None:
        if sem is None:
            results.append(await one(job))
            return
        async with sem:
            results.append(await one(job))

    t0 = time.perf_counter()
    tasks = []
    for job in jobs:
        tasks.append(asyncio.create_task(guarded(job)))
        if rate and not math.isinf(rate):
            await asyncio.sleep(rng.expovariate(rate))
    _, pending = await asyncio.wait(tasks, timeout=max(0.1, deadline - time.perf_counter()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return results, time.perf_counter() - t0, len(pending)


# ------------------------------------------------------------------------------------ openai client


def openai_client(base_url: str, uds: str | None, api_key: str | None, timeout: float) -> Any:
    """The official AsyncOpenAI over httpx: on a Unix socket when ``uds`` is given (the TPU machine has
    no TCP), with no cap on connections (httpx's default of 100 would queue a sweep's requests)."""
    import httpx
    import openai

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    transport = httpx.AsyncHTTPTransport(uds=uds, limits=limits) if uds else None
    http = httpx.AsyncClient(transport=transport, limits=limits, timeout=timeout)
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "unused", http_client=http, max_retries=0)


def openai_caller(client: Any, model: str, temperature: float, ignore_eos: bool) -> Any:
    """`one(job)`: a streamed chat completion with the usage chunk; TTFT to the first content, ITL between
    content chunks, output tokens from the usage."""
    extra = {"ignore_eos": True} if ignore_eos else None

    async def one(job: Job) -> RequestResult:
        res = RequestResult(ok=False, start=time.perf_counter())
        last = None
        try:
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": job.prompt}],
                max_tokens=job.max_tokens,
                temperature=temperature,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    res.output_tokens = chunk.usage.completion_tokens
                    res.prompt_tokens = chunk.usage.prompt_tokens
                for c in chunk.choices:
                    if c.delta.content:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - res.start
                        else:
                            res.itl.append(now - last)
                        last = now
            res.latency = time.perf_counter() - res.start
            res.ok, res.status = True, 200
        except Exception as e:  # a benchmark records failures, it does not stop on them
            res.status = getattr(e, "status_code", 0) or 0
            res.error = f"{type(e).__name__}: {e}"[:200]
        return res

    return one


# ------------------------------------------------------------------------------------ server process


class ServerFailed(RuntimeError):
    pass


class ServerProcess:
    """A server command (``{uds}`` in it: the socket path) started in a session of its own, its output in
    ``log``, ready once a one-token chat completion answers; `stop()` sends SIGTERM, then SIGKILL."""

    def __init__(self, argv: list[str], uds: str, log: Path, env: dict[str, str] | None = None) -> None:
        self.argv, self.uds, self.log_path = argv, uds, log
        self.proc: subprocess.Popen | None = None
        self.env = env
        self.model = ""
        self.ready_s = 0.0

    def start(self, timeout: float) -> ServerProcess:
        t0 = time.perf_counter()
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        asyncio.run(self._wait_ready(t0 + timeout))
        self.ready_s = time.perf_counter() - t0
        return self

    async def _wait_ready(self, deadline: float) -> None:
        client = openai_client("http://localhost/v1", self.uds, None, 600)
        error = "no answer"
        try:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise ServerFailed(f"exited with {self.proc.returncode}: {self.tail()}")
                try:
                    if not self.model:
                        self.model = (await client.models.list()).data[0].id
                    await client.chat.completions.create(
                        model=self.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
                    )
                    return
                except Exception as e:  # not listening yet, or not ready (503)
                    error = f"{type(e).__name__}: {e}"[:200]
                    await asyncio.sleep(0.25)
            raise ServerFailed(f"not ready in time ({error}): {self.tail()}")
        finally:
            await client.close()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.proc.pid) if self.proc is not None else 0.0

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def command(template: str, **values: str) -> list[str]:
    """A peer's command line from its template: ``{uds}``, ``{model}``, ``{python}`` filled in."""
    return [part.format(python=sys.executable, **values) for part in shlex.split(template)]
