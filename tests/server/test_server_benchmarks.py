"""benchmarks/serving.py and a short benchmarks/soak.py run against the real server."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
from server_helpers import MAX_LENGTH, MODEL, PREFILL_LENGTHS

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_serving_benchmark_measures_the_server(base_url):
    serving = load("serving")
    args = serving.parse_args(
        [
            "--base-url",
            base_url,
            "--num-requests",
            "8",
            "--concurrency",
            "4",
            "--max-tokens",
            "16",
            "--ignore-eos",
            "--warmup",
            "1",
        ]
    )
    prompts = serving.make_prompts(args.num_requests, 8, 0)
    results, duration = asyncio.run(serving.http_run(args, prompts))
    s = serving.summarize(results, duration)
    assert s["completed"] == 8 and s["failed"] == 0 and s["output_tokens"] == 8 * 16
    assert s["output_token_throughput"] == pytest.approx(128 / duration)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert s[key]["mean"] > 0 and s[key]["p50"] <= s[key]["p99"]
    r = results[0]
    assert r.tpot == pytest.approx((r.latency - r.ttft) / 15)
    # Poisson arrivals, completions endpoint
    args = serving.parse_args(
        [
            "--base-url",
            base_url,
            "--endpoint",
            "completions",
            "--request-rate",
            "50",
            "--num-requests",
            "6",
            "--max-tokens",
            "4",
            "--warmup",
            "0",
        ]
    )
    results, duration = asyncio.run(serving.http_run(args, serving.make_prompts(6, 4, 1)))
    assert serving.summarize(results, duration)["completed"] == 6


@pytest.mark.slow
@pytest.mark.soak
def test_short_soak(server):
    """30 streaming clients for 8 s, a third hanging up mid-stream, malformed requests mixed in."""
    soak = load("soak")
    report = asyncio.run(soak.soak(server.url, MODEL, clients=30, duration=8.0, warmup=0.0, max_tokens=48))
    assert report["status_5xx"] == 0, report
    assert report["slots_used_after"] == 0 and report["in_flight_after"] == 0, report
    # both kinds happened (how many fit in 8 s depends on the machine's load: 8 disconnects once, beside a
    # loaded suite; the verdict must not)
    assert report["counts"].get("disconnected", 0) > 0 and report["counts"].get("completed", 0) > 0, report
    assert set(report["malformed_statuses"]) <= {"400", "404", "413"}, report
    assert report["ok"], report


def test_serve_sweep_over_a_unix_socket_with_a_peer_and_the_engine_only_run(tiny_dir, tmp_path):
    """`serving.py --serve`: vsurge serve started on a Unix socket, the official openai client streaming
    prose through it at two Poisson rates and a fixed concurrency, a peer (here vsurge itself, started by
    --peer-cmd) on its own socket, then the same jobs in-process; every number of the table measured."""
    serving = load("serving")
    flags = f"--max-length {MAX_LENGTH} --prefill-lengths {','.join(map(str, PREFILL_LENGTHS))} --max-concurrent-decodes 4"
    peer = "{python} -m vsurge.cli serve --model {model} --uds {uds} --log-level warning " + flags
    args = serving.parse_args(
        ["--serve", "--model", tiny_dir, "--vsurge-args", flags, "--rates", "40,inf", "--num-requests", "8",
         "--prose-words", "8,24", "--output-tokens", "4,12", "--sweep-concurrency", "6", "--seed", "3",
         "--peer-cmd", peer, "--peer-name", "peer", "--ready-timeout", "300", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    out = serving.run_sweep(args)
    jobs = serving.prose_jobs(8, (8, 24), (4, 12), 3)
    want_tokens = sum(j.max_tokens for j in jobs)
    prose = Path(BENCH, "data", "prose.txt").read_text()
    assert all(set(j.prompt.split("\n\n", 1)[1].split()) <= set(prose.split()) for j in jobs)  # real prose
    vs, pe = out["servers"]
    assert (vs["server"], pe["server"]) == ("vsurge", "peer") and vs["slots"] == 4
    assert vs["exit"] == 0 and pe["exit"] == 0  # SIGTERM: drained and exited cleanly
    eng = out["engine_only"]
    assert eng["slots"] == 4  # serve's own resolution of the same flags
    for srv in (vs, pe, eng):
        assert [r["workload"] for r in srv["rows"]] == ["rate 40/s", "rate inf/s", "6 in flight"]
        for r in srv["rows"]:
            assert r["completed"] == 8 and r["failed"] == 0 and r["cancelled"] == 0, r
            assert r["output_tokens"] == want_tokens  # ignore_eos: exactly what was asked
            assert r["prompt_tokens"] > sum(j.prompt_words for j in jobs)  # prose through the chat template
            assert (
                r["output_token_throughput"] > 0
                and r["total_token_throughput"] > r["output_token_throughput"]
            )
            assert r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and r["itl_s"]["p99"] is not None
            assert 0 < r["goodput_rps"] <= r["request_throughput"] + 1e-9
            assert r["cpu_s"] > 0  # the server tree's CPU (this process's, engine-only)
    table = (tmp_path / "sweep.md").read_text()
    assert table.count("| vsurge |") == 3 and table.count("| peer |") == 3
    row = next(line for line in table.splitlines() if line.startswith("| vsurge | rate inf/s"))
    assert row.count("|") == 16 and "|  |" not in row  # the engine-only figures and both ratios beside it
    assert (tmp_path / "vsurge.log").exists() and (tmp_path / "peer.log").exists()  # logs kept with the table
    assert Path(vs["log"]).parent == tmp_path


def test_sweep_parts_against_the_running_server(base_url, server):
    """The quick loop's share of `--serve` (the whole sweep is slow-listed): prose jobs through the openai
    client and the Poisson schedule against the session's server, measured and tabled."""
    serving = load("serving")
    sweep, uds = sys.modules["serving_sweep"], sys.modules["serving_uds"]
    jobs = serving.prose_jobs(6, (8, 16), (3, 6), 1)
    args = serving.parse_args(["--serve", "--rates", "50,inf", "--sweep-concurrency", "3"])

    async def run():
        client = uds.openai_client(base_url, None, None, 60)
        one = uds.openai_caller(client, MODEL, 0.0, True)
        try:
            out = []
            for label, rate, conc in sweep.workloads(args, 8):
                deadline = time.perf_counter() + 120
                got = await uds.schedule(one, jobs, concurrency=conc, rate=rate, seed=1, deadline=deadline)
                out.append(dict(workload=label, **sweep.measured(args, *got, 0.5)))
            return out
        finally:
            await client.close()

    rows = asyncio.run(run())
    assert [r["workload"] for r in rows] == ["rate 50/s", "rate inf/s", "3 in flight"]
    for r in rows:
        assert r["completed"] == 6 and r["output_tokens"] == sum(j.max_tokens for j in jobs), r
        assert r["cpu_ms_per_token"] == pytest.approx(500 / r["output_tokens"])
    text = sweep.table(dict(servers=[dict(server="x", rows=rows, slots=8, ready_s=0)], requests=6,
                            prose_words=(8, 16), output_tokens=(3, 6), slo=dict(ttft_ms=1000, tpot_ms=50)))  # fmt: skip
    assert text.count("| x |") == 3
