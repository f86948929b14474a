"""Three `vsurge serve` pods (tiny model, odriver, prefix cache) behind `vsurge route` processes, on
loopback: the routing policies on the shared-system-prompt workload, a pod killed mid-run, a pod drained
(SIGTERM) mid-run. The workload and its measures are benchmarks/router_prefix.py's (the benchmark reports
the numbers; this test holds the verdicts that do not depend on this machine's speed).

The pods run the same engine flags as test_router_e2e.py, so the JAX compilation cache serves both. The
tests share one set of pods and run in order: the last two take a pod each.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from kmock_harness import LoggedProcess, free_port
from router_helpers import clean_env, load_benchmark, metric_value, vsurge_command, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


bench = load_benchmark("router_prefix")
MODEL = "alpha"
USERS = 3


@dataclass
class Pods:
    root: Path
    config: Path
    procs: list[LoggedProcess]
    urls: list[str]

    def router(self, name: str, *flags: str) -> tuple[LoggedProcess, str]:
        port = free_port()
        proc = LoggedProcess(
            [
                *vsurge_command(),
                "route",
                f"--static-config={self.config}",
                "--host=127.0.0.1",
                f"--port={port}",
                *bench.ROUTER_FLAGS,
                *flags,
            ],
            self.root / f"router-{name}.log",
            clean_env(),
        ).start()
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}/readiness", timeout=60)
        return proc, url


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    from tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("router-pods")
    make_checkpoint(root / MODEL, "llama", seed=0)
    env = clean_env(JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device per pod
    procs, urls = [], []
    try:
        for i in range(3):
            port = free_port()
            args = [*vsurge_command(), "serve", f"--model={root / MODEL}", f"--served-model-name={MODEL}",
                    "--host=127.0.0.1", f"--port={port}", "--metrics-port=-1", *bench.SERVE_FLAGS]  # fmt: skip
            procs.append(LoggedProcess(args, root / f"pod-{i}.log", env).start())
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls, strict=True):
            proc.wait_http(f"{url}/readiness", timeout=300)
        config = bench.write_config(root / "static.json", MODEL, urls)
        yield Pods(root, config, procs, urls)
    except BaseException:
        for i, proc in enumerate(procs):
            print(f"----- pod {i} log -----\n{proc.log()}")
        raise
    finally:
        for proc in procs:
            proc.stop()


def _run(url: str, work, **kw):
    return asyncio.run(bench.run(url, MODEL, work, **kw))


def test_prefix_routing_reuses_the_cache_the_other_policies_miss(pods: Pods) -> None:
    """One request at a time (so no load bound comes into play): with `prefix` each system prompt misses
    once, on its first request, and every later user of it lands on the pod holding its pages."""
    hits = {}
    for i, policy in enumerate(("prefix", "round-robin", "least-load")):
        # Load polling off for prefix: its loads are then exactly the router's (zero between requests).
        router, url = pods.router(
            policy, f"--routing={policy}", *(["--load-poll-seconds=0"] if i == 0 else [])
        )
        try:
            work = bench.jobs(bench.system_prompts(8, 24, seed=200 + i), USERS, seed=i)
            results, wall = _run(url, work, concurrency=1, max_tokens=4)
            text = httpx.get(f"{url}/metrics", timeout=10).text
        finally:
            router.stop()
        s = bench.summarize(results, wall)
        assert s.errors == 0, s.error_samples
        hits[policy] = s.hits
        picks = sum(
            metric_value(text, "vsurge_router_picks_total", model=MODEL, policy=policy, how=how)
            for how in ("prefix_match", "prefix_hash", "least_load", "round_robin")
        )
        assert picks == len(work)
        print(f"{policy}: hit rate {s.hit_rate:.1%}, {s.hits}/{s.requests} answers with a hit")
    assert hits["prefix"] == 8 * (USERS - 1)  # one miss per system prompt, then hits only
    assert hits["round-robin"] < hits["prefix"] and hits["least-load"] < hits["prefix"]


def test_a_killed_pod_costs_only_the_streams_that_had_started_on_it(pods: Pods) -> None:
    router, url = pods.router("kill", "--routing=prefix", "--eject-seconds=60")
    victim, victim_url = pods.procs[0], pods.urls[0]
    try:
        work = bench.jobs(bench.system_prompts(8, 24, seed=300), 6, seed=3)
        info: dict = {}

        async def during(results: list) -> None:
            info.update(
                await bench.when_busy(victim_url, results, 8, lambda: victim.proc.send_signal(signal.SIGKILL))
            )

        results, wall = _run(
            url, work, concurrency=6, max_tokens=8, stream=lambda j: j.user % 2 == 0, during=during
        )
        text = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        router.stop()
    assert info, "the pod was never seen running a request"
    victim.proc.wait(10)
    s = bench.summarize(results, wall)
    failed = [r for r in results if not r.ok]
    print(f"kill: {s.errors} client errors of {s.requests}, all on started streams; signalled {info}")
    # Nothing that had not started streaming is lost: non-streamed answers and streams still waiting for
    # their first chunk were retried on another pod.
    assert all(r.started and r.job.user % 2 == 0 for r in failed), [r.error for r in failed]
    assert len(failed) <= 6  # at most the streams in flight
    assert s.requests == len(work)
    dead = pods.urls[0]
    tried_dead = sum(
        metric_value(text, "vsurge_router_upstream_requests_total", upstream=dead, outcome=o)
        for o in ("connect_error", "dropped")
    )
    retried = sum(
        metric_value(text, "vsurge_router_retries_total", model=MODEL, reason=r)
        for r in ("connect_error", "dropped")
    )
    assert retried == tried_dead  # every attempt lost on the dead pod was retried


def test_a_drained_pod_costs_nothing(pods: Pods) -> None:
    router, url = pods.router("drain", "--routing=prefix")
    victim, victim_url = pods.procs[1], pods.urls[1]
    try:
        work = bench.jobs(bench.system_prompts(8, 24, seed=400), 6, seed=4)
        info: dict = {}

        async def during(results: list) -> None:
            info.update(
                await bench.when_busy(victim_url, results, 8, lambda: victim.proc.send_signal(signal.SIGTERM))
            )

        results, wall = _run(
            url, work, concurrency=6, max_tokens=8, stream=lambda j: j.user % 2 == 0, during=during
        )
    finally:
        router.stop()
    assert info, "the pod was never seen running a request"
    wait_for(lambda: victim.proc.poll() is not None, timeout=60, what="the drained pod to exit")
    s = bench.summarize(results, wall)
    print(f"drain: {s.errors} client errors of {s.requests}; signalled {info}")
    assert s.errors == 0, s.error_samples
    assert s.requests == len(work)
