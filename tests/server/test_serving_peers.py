"""benchmarks/serving.py's named workloads and --peers machinery: the preset's requests, a preset-shaped run
against the real server, a peer's start / ready / stop, skips with reasons, and the table."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from patience import ceiling
from test_server_benchmarks import load

serving = load("serving")
peers = serving._peers_module()


def test_presets_are_the_issue_workload():
    a = serving.parse_args(["--preset", "mixed-32"])
    assert (a.num_requests, a.concurrency, a.endpoint, a.ignore_eos, a.temperature) == (
        64,
        32,
        "completions",
        True,
        0.0,
    )
    assert serving.parse_args(["--preset", "mixed-64"]).concurrency == 64
    assert serving.parse_args(["--preset", "mixed-32", "--concurrency", "8"]).concurrency == 8
    jobs = serving.workload(a)
    assert len(jobs) == 64 and jobs == serving.workload(serving.parse_args(["--preset", "mixed-64"]))
    assert all(32 <= j.prompt_words <= 512 and 16 <= j.max_tokens <= 256 for j in jobs)
    assert all(len(j.prompt.split(" ")) == j.prompt_words for j in jobs)
    # spread over the ranges, not clustered; another seed gives other requests
    assert min(j.prompt_words for j in jobs) < 100 and max(j.prompt_words for j in jobs) > 400
    assert serving.workload(serving.parse_args(["--preset", "mixed-32", "--seed", "1"])) != jobs


def test_the_cpu_like_for_like_pair():
    """random-24 and chat-24: the same 48 requests at 24 in flight; chat continues real prose and ends at EOS."""
    r, c = serving.parse_args(["--preset", "random-24"]), serving.parse_args(["--preset", "chat-24"])
    assert (r.num_requests, r.concurrency, r.endpoint, r.ignore_eos) == (48, 24, "completions", True)
    assert (c.num_requests, c.concurrency, c.endpoint, c.ignore_eos) == (48, 24, "chat", False)
    prose = set(serving.PROSE.read_text().split())
    jobs = serving.workload(c)
    assert len(jobs) == 48 and all(32 <= j.prompt_words <= 384 and 64 <= j.max_tokens <= 256 for j in jobs)
    for j in jobs:
        head, passage = j.prompt.split("\n\n", 1)
        assert head.startswith("Continue this passage") and len(passage.split()) == j.prompt_words
        assert set(passage.split()) <= prose
    # the sweep's prose requests are the same draws as the preset's
    again = serving.prose_jobs(48, (32, 384), (64, 256), c.seed)
    assert [(j.prompt, j.max_tokens) for j in again] == [(j.prompt, j.max_tokens) for j in jobs]


def test_vsurge_default_peer_runs_serve_with_its_own_defaults():
    args = serving.parse_args(
        ["--peers", "--preset", "chat-24", "--servers", "vsurge-default,vsurge-vdriver"]
    )
    default, sized = peers.discover(args, args.concurrency)
    assert "--max-concurrent-decodes" not in default.argv and "--max-length" not in default.argv
    assert sized.argv[sized.argv.index("--max-concurrent-decodes") + 1] == "24"


def test_preset_shaped_run_against_the_server(base_url):
    """Per-request max_tokens with ignore_eos: every answer is exactly as long as its own job asked."""
    args = serving.parse_args(["--base-url", base_url, "--preset", "mixed-32", "--concurrency", "4"])
    args.warmup = 1
    jobs = serving.make_jobs(6, (4, 12), (3, 9), seed=5)
    results, duration = asyncio.run(serving.http_run(args, jobs))
    s = serving.summarize(results, duration)
    assert s["completed"] == 6 and s["failed"] == 0
    assert sorted(r.output_tokens for r in results) == sorted(j.max_tokens for j in jobs)
    assert s["ttft_s"]["p50"] > 0 and s["tpot_s"]["p50"] > 0
    table = peers.table([("vsurge-vdriver", s, "ready in 1s"), ("vllm", None, "skipped: no vllm")])
    lines = table.splitlines()
    assert lines[0].startswith("| server | output tok/s | TTFT p50 | TPOT p50")
    assert lines[2].startswith(f"| vsurge-vdriver | {s['output_token_throughput']:.1f} |")
    assert "| 6/6 |" in lines[2]
    assert lines[3] == "| vllm | - | - | - | - | - | - | skipped: no vllm |"


def test_a_peer_is_started_awaited_and_stopped(tmp_path):
    port = peers.free_port()
    argv = [
        sys.executable,
        "-m",
        "http.server",
        str(port),
        "--bind",
        "127.0.0.1",
        "--directory",
        str(tmp_path),
    ]
    peer = peers.Peer("web", argv, port, "/")
    with peers.running(peer, str(tmp_path / "logs"), ready_timeout_s=ceiling(30)) as (proc, ready_s):
        assert proc.poll() is None and ready_s < ceiling(30)
    assert proc.poll() is not None  # stopped on leaving the block
    assert os.path.exists(tmp_path / "logs" / "web.log")

    dead = peers.Peer(
        "dead", [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"], port, "/"
    )
    with pytest.raises(peers.PeerFailed, match="exited with 3") as e, peers.running(dead, str(tmp_path), 30):
        pass
    assert "no such model" in str(e.value)

    slow = peers.Peer("slow", [sys.executable, "-c", "import time; time.sleep(60)"], peers.free_port(), "/")
    with pytest.raises(peers.PeerFailed, match="not ready in 1s"), peers.running(slow, str(tmp_path), 1.0):
        pass


def test_missing_peers_are_skipped_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no vllm, no llama-server on it
    monkeypatch.delenv("VLLM_BIN", raising=False)
    monkeypatch.delenv("PEERS", raising=False)
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "not-there"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    args = serving.parse_args(
        ["--peers", "--servers", "vsurge-odriver,vllm,llama.cpp,tgi", "--gguf", str(gguf)]
    )
    found = peers.discover(args, 32)
    assert [p.name for p in found] == ["vsurge-odriver", "vllm", "llama.cpp", "tgi"]
    vs, vllm, llama, tgi = found
    assert isinstance(vs, peers.Peer) and vs.ready_path == "/readiness"
    i = vs.argv.index("--driver")
    assert vs.argv[i + 1] == "odriver" and vs.argv[vs.argv.index("--max-concurrent-decodes") + 1] == "32"
    assert isinstance(vllm, peers.Skipped) and "--vllm" in vllm.reason
    assert isinstance(llama, peers.Skipped) and "--llama-server" in llama.reason
    assert isinstance(tgi, peers.Skipped) and "unknown server" in tgi.reason
    # an executable that is there becomes a peer with the preset's parallelism
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (llama,) = peers.discover(serving.parse_args(["--servers", "llama.cpp", "--gguf", str(gguf)]), 64)
    assert llama.argv[0] == str(exe) and llama.argv[llama.argv.index("-np") + 1] == "64"
    assert llama.argv[llama.argv.index("-c") + 1] == str(64 * peers.CONTEXT_PER_SEQUENCE)


def test_peers_are_found_under_the_directory_the_reader_chose(tmp_path, monkeypatch):
    """docs/performance.md installs vLLM and llama-server under $PEERS; the benchmark looks there after the
    flags and their variables, before PATH."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("VLLM_BIN", raising=False)
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    root = tmp_path / "my peers"
    for rel in peers.PEERS_LAYOUT.values():
        exe = root / rel
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    hf = tmp_path / "hf"
    hf.mkdir()
    argv = ["--servers", "vllm,llama.cpp", "--gguf", str(gguf), "--hf-model", str(hf)]
    skipped = peers.discover(serving.parse_args(argv), 8)
    assert all(isinstance(p, peers.Skipped) and "PEERS" in p.reason for p in skipped)
    monkeypatch.setenv("PEERS", str(root))
    vllm, llama = peers.discover(serving.parse_args(argv), 8)
    assert vllm.argv[0] == str(root / "vllm-venv" / "bin" / "vllm")
    assert llama.argv[0] == str(root / "llama-build" / "bin" / "llama-server")
    # a flag still wins over $PEERS
    other = tmp_path / "other-vllm"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    (vllm,) = peers.discover(serving.parse_args([*argv[:1], "vllm", *argv[2:], "--vllm", str(other)]), 8)
    assert vllm.argv[0] == str(other)
