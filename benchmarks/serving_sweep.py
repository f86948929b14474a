"""`serving.py --serve`: the serving benchmark as a user meets the server, where no TCP port may open.

    # vsurge serve with no engine flags (its own defaults) on a Unix socket; a Poisson rate sweep, then a
    # fixed concurrency of twice its slots; then the same requests in-process (no HTTP) for the HTTP path's cost
    python benchmarks/serving.py --serve --model default --rates 1,2,4,inf --num-requests 64 --out-dir out
    # and a peer on the same socket protocol, the same client and requests:
    python benchmarks/serving.py --serve --model /ckpt \\
        --peer-cmd 'vllm serve {model} --uds {uds} --served-model-name m' --peer-name vllm

Per server and workload: output and total tok/s, TTFT / TPOT / ITL p50 and p99, goodput (requests/s whose
TTFT and TPOT meet --slo-ttft-ms / --slo-tpot-ms, as vLLM's `bench serve --goodput`), whether the p99s
meet the SLO, and the server process tree's CPU ms per generated token; for vsurge, the engine-only run
beside it (the same jobs through `vSurge.complete` in this process, with serve's own resolved config)
and HTTP / engine-only for throughput and CPU. The client is the official `openai` package, streaming.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # siblings, run as a script or via runpy

from serving_client import inprocess_caller  # noqa: E402
from serving_report import RequestResult, summarize  # noqa: E402
from serving_uds import ServerProcess, command, openai_caller, openai_client, prose_jobs, schedule  # noqa: E402
from serving_workloads import Job  # noqa: E402


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--serve: vsurge serve on a Unix socket, a rate sweep and a fixed concurrency")
    g.add_argument(
        "--serve", action="store_true", help="start `vsurge serve --uds` (no engine flags) and sweep"
    )
    g.add_argument(
        "--rates", default="1,2,4,8,inf", help="Poisson request rates per second ('inf': all at once)"
    )
    g.add_argument(
        "--sweep-concurrency",
        type=int,
        default=0,
        help="the fixed-concurrency workload's requests in flight (0: twice the server's slots)",
    )
    g.add_argument("--prose-words", type=_pair, default=(32, 384), help="words of prose per prompt, LO,HI")
    g.add_argument("--output-tokens", type=_pair, default=(16, 256), help="max_tokens per request, LO,HI")
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=50.0)
    g.add_argument("--run-timeout", type=float, default=300.0, help="seconds one workload may run")
    g.add_argument(
        "--no-engine-only",
        dest="engine_only",
        action="store_false",
        help="skip the in-process run of the same jobs",
    )
    g.add_argument(
        "--peer-cmd", default="", help="a peer server's command: {uds}, {model}, {python} filled in"
    )
    g.add_argument("--peer-name", default="peer")
    g.add_argument("--peer-model", default=None, help="{model} of --peer-cmd (default: --model)")
    g.add_argument("--uds-dir", default=None, help="where the sockets go (default: a temp dir under /tmp)")
    g.add_argument("--out-dir", default=None, help="write sweep.json and sweep.md here")  # fmt: skip


def workloads(args: argparse.Namespace, slots: int) -> list[tuple[str, float | None, int | None]]:
    """(label, rate, concurrency) of each run: the rates, then the fixed concurrency (more than slots)."""
    out: list[tuple[str, float | None, int | None]] = []
    for r in (x.strip() for x in args.rates.split(",") if x.strip()):
        rate = math.inf if r in ("inf", "max") else float(r)
        out.append((f"rate {r}/s", rate, None))
    conc = args.sweep_concurrency or 2 * slots
    out.append((f"{conc} in flight", None, conc))
    return out


def goodput(results: list[RequestResult], seconds: float, ttft_s: float, tpot_s: float) -> float:
    """Requests per second that met both SLOs (a one-token answer has no TPOT: only its TTFT counts)."""
    good = [
        r
        for r in results
        if r.ok and r.ttft is not None and r.ttft <= ttft_s and (r.tpot is None or r.tpot <= tpot_s)
    ]
    return len(good) / seconds if seconds else 0.0


def measured(args, results, seconds: float, cancelled: int, cpu_s: float) -> dict[str, Any]:
    s = summarize(results, seconds)
    ttft, tpot = args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3
    s["cancelled"] = cancelled
    s["goodput_rps"] = goodput(results, seconds, ttft, tpot)
    p99_ttft, p99_tpot = s["ttft_s"]["p99"], s["tpot_s"]["p99"]
    s["slo_p99_met"] = bool(p99_ttft is not None and p99_ttft <= ttft and (p99_tpot or 0) <= tpot)
    s["cpu_s"] = cpu_s
    s["cpu_ms_per_token"] = cpu_s / s["output_tokens"] * 1e3 if s["output_tokens"] else None
    return s


def _deadline(args) -> float:
    return time.perf_counter() + args.run_timeout


async def _http_runs(args, server: ServerProcess, jobs: list[Job], runs) -> list[dict[str, Any]]:
    client = openai_client("http://localhost/v1", server.uds, None, args.timeout)
    one = openai_caller(client, server.model, args.temperature, args.ignore_eos)
    out = []
    try:
        for label, rate, conc in runs:
            cpu0 = server.cpu_seconds()
            results, seconds, cut = await schedule(
                one, jobs, concurrency=conc, rate=rate, seed=args.seed, deadline=_deadline(args)
            )
            out.append(
                dict(workload=label, **measured(args, results, seconds, cut, server.cpu_seconds() - cpu0))
            )
            _say(f"{label}: {out[-1]['output_token_throughput']:.1f} tok/s, {out[-1]['completed']} ok")
    finally:
        await client.close()
    return out


def _say(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def _server_slots(uds: str) -> int:
    """The decode slots the server sized for itself (GET /health)."""
    import httpx

    with httpx.Client(transport=httpx.HTTPTransport(uds=uds), base_url="http://localhost") as h:
        try:
            models = h.get("/health", timeout=10).json().get("models", {})
            return int(next(iter(models.values()))["slots_total"])
        except Exception:  # a peer without vsurge's /health
            return 0


def run_server(
    args, name: str, argv: list[str], uds: str, jobs: list[Job], slots: int | None
) -> dict[str, Any]:
    log = Path(args.log_dir) / f"{name}.log"
    _say(f"{name}: starting: {shlex.join(argv)}")
    server = ServerProcess(argv, uds, log)
    try:
        server.start(args.ready_timeout)
        slots = slots or _server_slots(uds) or 32
        _say(f"{name}: ready in {server.ready_s:.1f}s ({slots} slots), model {server.model!r}")
        runs = workloads(args, slots)
        rows = asyncio.run(_http_runs(args, server, jobs, runs))
    finally:
        code = server.stop()
    return dict(server=name, ready_s=server.ready_s, slots=slots, exit=code, rows=rows, log=str(log))


def engine_only(args, jobs: list[Job], runs) -> dict[str, Any]:
    """The same jobs through `vSurge.complete` in this process, built as `vsurge serve` builds its engine
    from the same flags (sized from the device the same way)."""
    import vsurge
    from vsurge.cli.main import build_surge, size_engine
    from vsurge.cli.serve_options import parse_serve_config
    from vsurge.models.compiled.compilation_cache import enable_compilation_cache

    cfg = parse_serve_config(["--model", args.model, *shlex.split(args.vsurge_args)])
    enable_compilation_cache()
    mesh = None
    if cfg.engine.mesh:
        from vsurge.models.sharding import make_mesh

        mesh = make_mesh(cfg.engine.mesh)
    model, processor = vsurge.load_model(
        cfg.model, dtype=cfg.dtype, mesh=mesh, quantization=cfg.engine.quantization
    )
    size_engine(cfg, model, mesh, _say)
    surge = build_surge(cfg, model, processor, mesh)
    surge.compile()
    surge.start()
    run_args = copy.copy(args)
    run_args.endpoint = "chat"
    one = inprocess_caller(surge, run_args)
    rows = []
    try:
        asyncio.run(one(Job("Hi", 1)))  # as the server's readiness probe: the first request's costs
        for label, rate, conc in runs:
            cpu0 = time.process_time()
            results, seconds, cut = asyncio.run(
                schedule(one, jobs, concurrency=conc, rate=rate, seed=args.seed, deadline=_deadline(args))
            )
            rows.append(
                dict(workload=label, **measured(args, results, seconds, cut, time.process_time() - cpu0))
            )
            _say(f"engine-only {label}: {rows[-1]['output_token_throughput']:.1f} tok/s")
    finally:
        surge.stop()
    return dict(server="vsurge engine-only", slots=cfg.engine.max_concurrent_decodes, rows=rows)


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    jobs = prose_jobs(args.num_requests, args.prose_words, args.output_tokens, args.seed)
    folder = args.uds_dir or tempfile.mkdtemp(prefix="vsurge-sweep-", dir="/tmp")  # AF_UNIX: <= 107 bytes
    args.log_dir = args.peers_log_dir or args.out_dir or folder
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    try:
        return _sweep(args, jobs, folder)
    finally:
        # the sockets' folder was ours and the logs are elsewhere: nothing in it to keep
        if not args.uds_dir and args.log_dir != folder:
            shutil.rmtree(folder, ignore_errors=True)


def _sweep(args: argparse.Namespace, jobs: list[Job], folder: str) -> dict[str, Any]:
    uds = os.path.join(folder, "vsurge.sock")
    argv = [sys.executable, "-m", "vsurge.cli", "serve", "--model", args.model, "--uds", uds,
            "--log-level", "warning", *shlex.split(args.vsurge_args)]  # fmt: skip
    out: dict[str, Any] = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), model=args.model, requests=len(jobs),
        rates=args.rates, slo=dict(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        prose_words=args.prose_words, output_tokens=args.output_tokens, servers=[],
    )  # fmt: skip
    vs = run_server(args, "vsurge", argv, uds, jobs, None)
    out["servers"].append(vs)
    runs = workloads(args, vs["slots"])
    if args.peer_cmd:
        peer_uds = os.path.join(folder, "peer.sock")
        peer_argv = command(args.peer_cmd, uds=peer_uds, model=args.peer_model or args.model)
        try:  # the same workloads: the fixed concurrency sized from vsurge's slots
            out["servers"].append(run_server(args, args.peer_name, peer_argv, peer_uds, jobs, vs["slots"]))
        except Exception as e:  # noqa: BLE001 - the peer's failure is reported, the rest stands
            out["servers"].append(
                dict(server=args.peer_name, error=f"{type(e).__name__}: {e}"[:2000], rows=[])
            )
    if args.engine_only:
        out["engine_only"] = engine_only(args, jobs, runs)
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / "sweep.json").write_text(json.dumps(out, indent=1, default=str))
        (Path(args.out_dir) / "sweep.md").write_text(table(out) + "\n")
    return out


def _ms(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    return "-" if v is None else f"{v * 1e3:.0f}"


def table(out: dict[str, Any]) -> str:
    """One markdown row per server and workload, the engine-only figures beside vsurge's."""
    eng = {r["workload"]: r for r in (out.get("engine_only") or {}).get("rows", [])}
    head = (
        "| server | workload | ok | out tok/s | total tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| ITL p50 / p99 ms | goodput req/s | SLO p99 | server CPU ms/tok | engine-only out tok/s "
        "| engine-only CPU ms/tok | HTTP ÷ engine tok/s | CPU HTTP ÷ engine |"
    )
    lines = [head, "|" + "---|" * 15]
    for srv in out["servers"]:
        if srv.get("error"):
            lines.append(f"| {srv['server']} | failed: {srv['error'][:150]} |" + " |" * 13)
        for r in srv["rows"]:
            e = eng.get(r["workload"]) if srv["server"] == "vsurge" else None

            def f(x, fmt="{:.1f}"):
                return "" if x is None else fmt.format(x)

            ratio = (
                e
                and e["output_token_throughput"]
                and r["output_token_throughput"] / e["output_token_throughput"]
            )
            cpu_ratio = (
                e
                and e.get("cpu_ms_per_token")
                and r["cpu_ms_per_token"]
                and r["cpu_ms_per_token"] / e["cpu_ms_per_token"]
            )
            t, p, i = r["ttft_s"], r["tpot_s"], r["itl_s"]
            lines.append(
                f"| {srv['server']} | {r['workload']} | {r['completed']}/{r['requests'] + r['cancelled']} "
                f"| {r['output_token_throughput']:.1f} | {r['total_token_throughput']:.1f} "
                f"| {_ms(t, 'p50')} / {_ms(t, 'p99')} | {_ms(p, 'p50')} / {_ms(p, 'p99')} "
                f"| {_ms(i, 'p50')} / {_ms(i, 'p99')} | {r['goodput_rps']:.2f} | {'yes' if r['slo_p99_met'] else 'no'} "
                f"| {f(r['cpu_ms_per_token'], '{:.2f}')} | {f(e and e['output_token_throughput'])} "
                f"| {f(e and e['cpu_ms_per_token'], '{:.2f}')} | {f(ratio, '{:.2f}')} | {f(cpu_ratio, '{:.2f}')} |"
            )  # fmt: skip
    slots = ", ".join(
        f"{s['server']} {s.get('slots')} slots, ready in {s.get('ready_s', 0):.0f}s" for s in out["servers"]
    )
    lines.append("")
    lines.append(
        f"{out['requests']} requests of prose ({out['prose_words'][0]}-{out['prose_words'][1]} words, chat template), "
        f"max_tokens {out['output_tokens'][0]}-{out['output_tokens'][1]}, ignore_eos; SLO TTFT <= "
        f"{out['slo']['ttft_ms']:.0f} ms, TPOT <= {out['slo']['tpot_ms']:.0f} ms; {slots}"
    )  # fmt: skip
    return "\n".join(lines)
