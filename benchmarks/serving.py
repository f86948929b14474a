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
    # vsurge serve with its own defaults on a Unix socket (no TCP: the TPU machine), the official openai
    # client, prompts of prose: a Poisson rate sweep and 2 x slots in flight, the engine-only run beside
    # it, a peer with --peer-cmd (serving_sweep.py):
    python benchmarks/serving.py --serve --model default --rates 1,2,4,inf --num-requests 64 --out-dir out

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
import signal
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # siblings, run as a script or via runpy

# the modules of the benchmark, by job; their names read from here as they always did
from serving_client import build_surge, http_run, inprocess_run, run_schedule  # noqa: E402, F401
from serving_peers import _peers_module, peers_run  # noqa: E402, F401
from serving_report import RequestResult, _fmt, _stats, summarize  # noqa: E402, F401
from serving_sweep import add_sweep_arguments, run_sweep, table  # noqa: E402
from serving_uds import prose_jobs  # noqa: E402, F401
from serving_workloads import PRESETS, PROSE, WORDS, Job, Preset, as_jobs, make_jobs, make_prompts  # noqa: E402, F401

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
    add_sweep_arguments(p)
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
    if args.serve:
        args.ignore_eos = True  # every server generates exactly what was asked: runs stay comparable
        out = run_sweep(args)
        print(json.dumps(out, indent=2, default=str) if args.json else table(out))
        return 0 if any(r["completed"] for s in out["servers"] for r in s["rows"]) else 1
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
