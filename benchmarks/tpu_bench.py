"""The TPU benchmark: every model shape and engine path on the chip, in one call, under a time budget.

    python benchmarks/tpu_bench.py --out-dir $OUT                    # on the TPU machine, <= 8 minutes
    python benchmarks/tpu_bench.py --shapes 1b64 --paths vdriver     # a subset
    python benchmarks/tpu_bench.py --shapes tiny --budget-s 900      # CPU smoke test (tests/service/test_tpu_bench.py)
    python benchmarks/tpu_bench.py checkpoint 1b64 /tmp/ckpt-1b64    # only write a shape's checkpoint

For each shape (benchmarks/tpu_checkpoint.py: Llama-3.2-1B with head_dim 64, the same sizes with head_dim
128, Llama-3.1-8B loaded in int8) a random-weight bf16 checkpoint is written once and loaded through
`vsurge.load_model` in a worker process of its own (`tpu_bench.py worker ...`, benchmarks/tpu_worker.py; one
process holds the chip at a time, and a crash or a hang costs that shape alone). Per driver/attention path the worker measures
the raw loop (the bare jitted decode step), then the engine through `vSurge.create` / `vSurge.complete`:
a fixed batch (64 requests x 256 tokens, all in flight) and mixed arriving traffic (128 requests, prompts
32-512, outputs 16-256, 64 in flight: each arrives as another finishes). Reported: step time, tok/s, share
of the HBM roofline (weights + the KV bytes the step reads), engine / raw loop, mixed tok/s against its
limit (an estimate: decode steps at the raw step time plus the prompts' FLOPs over the parameters a token
is multiplied by, the embedding table only as a tied head, at the chip's measured matmul peak), TTFT
p50/p90, load and compile
time, host (step thread) CPU per step; then the second start of the default path in a new process with
the persistent compile cache warm. The budget is honoured between shapes (a shape starts only with time
for it) and within them (its worker is stopped at its share; what it measured is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tpu_checkpoint import write_checkpoint  # noqa: E402

# what each shape runs: paths, weights, context and the least time worth starting it with
PLAN: dict[str, dict[str, Any]] = {
    "1b64": dict(
        paths="vdriver,odriver-pallas", quant="none", max_length=1024, mixed_max_prompt=512, least=90
    ),
    "1b128": dict(
        paths="vdriver,odriver-pallas", quant="none", max_length=1024, mixed_max_prompt=512, least=90
    ),
    "8b": dict(paths="vdriver", quant="int8", max_length=640, mixed_max_prompt=384, least=150),
    "tiny": dict(paths="vdriver,odriver-jax", quant="none", max_length=256, mixed_max_prompt=64, least=10),
}
PEAK_GBPS = {"tpu v5 lite": 819.0, "tpu v5e": 819.0, "tpu v6 lite": 1640.0, "tpu v5": 2765.0}


def worker(args, shape: str, plan: dict[str, Any], ckpt: str, deadline_s: float, out: Path, extra=()) -> dict:
    cmd = [
        sys.executable,
        str(HERE / "tpu_bench.py"), "worker",
        "--ckpt", ckpt,
        "--shape", shape,
        "--paths", args.paths or plan["paths"],
        "--quant", plan["quant"],
        "--max-length", str(plan["max_length"]),
        "--mixed-max-prompt", str(plan["mixed_max_prompt"]),
        "--batch", str(args.batch),
        "--deadline-s", str(max(10.0, deadline_s - 5)),
        "--out", str(out),
        *extra,
        *args.worker_args.split(),
    ]  # fmt: skip
    if shape == "tiny":
        cmd += ["--fixed-prompt", "16", "--fixed-out", "32"]
    env = dict(os.environ, VSURGE_CACHE_DIR=str(Path(args.cache_dir) / shape))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=deadline_s, capture_output=True, text=True)
        status = f"exit {proc.returncode}"
        log = proc.stdout[-4000:] + proc.stderr[-4000:]
    except subprocess.TimeoutExpired as e:
        status = f"stopped at its {deadline_s:.0f}s share"
        log = (
            (e.stdout or b"")[-4000:].decode(errors="replace")
            if isinstance(e.stdout, bytes)
            else str(e.stdout)
        )
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update(status=status, wall_s=time.perf_counter() - t0)
    print(log, flush=True)
    return result


def table(results: dict[str, Any]) -> str:
    """A markdown table per shape and path, from the workers' JSON."""
    lines = [
        "| shape | path | raw step ms | raw tok/s | % HBM roofline | fixed tok/s | ÷ raw | mixed tok/s | "
        "÷ limit (est.) | TTFT p50/p90 (mixed) | load s | compile s | step-thread CPU ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    peak = next((v for k, v in PEAK_GBPS.items() if k in str(results.get("device", "")).lower()), None)
    for shape, res in results.get("shapes", {}).items():
        for run in res.get("runs", []):
            raw, fixed, mixed = run.get("raw") or {}, run.get("fixed") or {}, run.get("mixed") or {}

            def f(x, fmt="{:.1f}"):
                return "" if x is None else fmt.format(x)

            roof = raw.get("hbm_gbps") / peak * 100 if raw.get("hbm_gbps") and peak else None
            steps = fixed.get("tokens", 0) / max(1, results.get("batch", 64))
            step_cpu = fixed.get("thread_cpu_s", {}).get("vsurge-generate-0")
            note = run.get("error") or run.get("skipped") or ""
            lines.append(
                f"| {shape} | {run['path']}{' — ' + note[:60] if note else ''} | {f(raw.get('step_s') and raw['step_s'] * 1e3, '{:.2f}')} "
                f"| {f(raw.get('tok_s'), '{:.0f}')} | {f(roof)} | {f(fixed.get('tok_s'), '{:.0f}')} | {f(fixed.get('vs_raw'), '{:.2f}')} "
                f"| {f(mixed.get('tok_s'), '{:.0f}')} | {f(mixed.get('vs_limit'), '{:.2f}')} "
                f"| {f(mixed.get('ttft_p50'), '{:.2f}')} / {f(mixed.get('ttft_p90'), '{:.2f}')} "
                f"| {f(res.get('load_s'))} | {f(run.get('compile_s'))} "
                f"| {f(step_cpu and steps and step_cpu / steps * 1e3, '{:.2f}')} |"
            )
    lines += _limit_notes(results)
    lines += _detail(results)
    warm = results.get("warm_start")
    if warm:
        lines.append("")
        lines.append(
            f"second start of {warm.get('shape')} (new process, warm compile cache): load {warm.get('load_s', 0):.1f} s, "
            f"compile {warm.get('compile_s', 0):.1f} s, ready {warm.get('ready_s', 0):.1f} s after the backend "
            f"({warm.get('ready_from_process_s', 0):.1f} s from process start, backend init {warm.get('backend_init_s', 0):.1f} s)"
        )
        if warm.get("compile_breakdown"):
            lines.append(
                f"its compile, by JAX's events (sum / count / wall): {json.dumps(warm['compile_breakdown'])}"
            )
    for shape, res in results.get("shapes", {}).items():
        for run in res.get("runs", []):
            if run.get("compile_breakdown"):
                lines.append(
                    f"{shape} {run['path']} cold compile by JAX's events: {json.dumps(run['compile_breakdown'])}"
                )
    return "\n".join(lines)


def _limit_notes(results: dict[str, Any]) -> list[str]:
    """What the mixed workload is and what its limit counts, per shape: the limit is an estimate."""
    out = []
    for shape, res in results.get("shapes", {}).items():
        peak, params = res.get("matmul_peak_flops"), res.get("matmul_params")
        if not peak or not params:
            continue
        how = "measured on the device" if res.get("matmul_peak_measured") else "given (--peak-flops)"
        out.append(
            f"{shape}: mixed = arriving traffic, {2 * results.get('batch', 64)} requests with "
            f"{results.get('batch', 64)} in flight; its limit is an estimate: decode steps at the raw step time "
            f"+ prompts at 2 x {params / 1e9:.3f} B multiplied parameters a token (the embedding table is "
            f"gathered, counted only as a tied head; of {res.get('params', 0) / 1e9:.3f} B in all) at a matmul "
            f"peak of {peak / 1e12:.1f} TFLOP/s {how}; attention FLOPs and overlap left out"
        )
    return [""] + out if out else []


def _detail(results: dict[str, Any]) -> list[str]:
    """Per shape and path: the raw loop walking the fixed batch's positions (per read chunk) against the
    engine's decode once every request has its first token; the prefill program alone per pack; where
    start-up spent its compile time."""
    walks = [
        "",
        "| shape | path | raw walk ms (read chunk) | fixed decode-phase tok/s | ÷ walk | fixed ÷ walk |",
        "|---|---|---|---|---|---|",
    ]
    packs = [
        "",
        "| shape | path | prefill rows x tokens | call ms | prompt tok/s | % of matmul peak |",
        "|---|---|---|---|---|---|",
    ]
    starts = [
        "",
        "| shape | path | programs | parallel pool s | total s | compiled after the pool (s) |",
        "|---|---|---|---|---|---|",
    ]
    busy = [
        "",
        "| shape | busy prefill calls | fixed tok/s | fixed TTFT p50/p90 | mixed tok/s | mixed TTFT p50/p90 |",
        "|---|---|---|---|---|---|",
    ]

    def pair(w: dict) -> str:
        p50, p90 = w.get("ttft_p50"), w.get("ttft_p90")
        return f"{w.get('tok_s', 0):.0f} | {'' if p50 is None else f'{p50:.2f}'} / {'' if p90 is None else f'{p90:.2f}'}"

    for shape, res in results.get("shapes", {}).items():
        for run in res.get("runs", []):
            fixed = run.get("fixed") or {}
            b = run.get("busy_rows")
            if b and fixed:
                busy.append(f"| {shape} | default | {pair(fixed)} | {pair(run.get('mixed') or {})} |")
                busy.append(
                    f"| {shape} | {b['prompts']} prompts in {b['rows']} rows | {pair(b.get('fixed') or {})} | {pair(b.get('mixed') or {})} |"
                )
            ws = ", ".join(
                f"{w['step_s'] * 1e3:.2f} ({w.get('chunk') or 'default'})" for w in run.get("raw_walks", [])
            )
            if ws:
                d, v, a = fixed.get("decode_tok_s"), fixed.get("decode_vs_walk"), fixed.get("vs_walk")
                walks.append(
                    f"| {shape} | {run['path']} | {ws} | {'' if d is None else f'{d:.0f}'} "
                    f"| {'' if v is None else f'{v:.2f}'} | {'' if a is None else f'{a:.2f}'} |"
                )
            for pk in run.get("prefill") or []:
                packs.append(
                    f"| {shape} | {run['path']} | {pk['rows']} x {pk['tokens'] // pk['rows']} | {pk['call_s'] * 1e3:.1f} "
                    f"| {pk['tok_s']:.0f} | {pk['of_peak'] * 100:.0f} |"
                )
            rep = run.get("compile_report")
            if rep:
                late = ", ".join(f"{n} {t:.1f}" for n, t in rep.get("after_pool", [])[:6])
                late += "; slowest in the pool: " + ", ".join(
                    f"{n} {t:.1f}" for n, t in rep.get("slowest", [])[:5]
                )
                starts.append(
                    f"| {shape} | {run['path']} | {rep['programs']} | {rep['pool_s']:.1f} | {rep['total_s']:.1f} "
                    f"| {len(rep.get('after_pool', []))}: {late} |"
                )
    return [t for block in (walks, packs, starts, busy) if len(block) > 3 for t in block]


def lora_rates(args, out_dir: Path, budget_s: float) -> dict[str, Any]:
    """benchmarks/lora.py on the --lora shape's checkpoint in bfloat16, in its own process."""
    ckpt = str(Path(args.ckpt_dir) / args.lora)
    write_checkpoint(args.lora, ckpt)
    out = out_dir / "lora.json"
    cmd = [sys.executable, str(HERE / "lora.py"), "--model", ckpt, "--dtype", "bfloat16", "--json", str(out)]
    try:
        proc = subprocess.run(cmd, timeout=budget_s, capture_output=True, text=True)
        print(proc.stdout[-2000:] + proc.stderr[-2000:], flush=True)
        status = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"stopped at {budget_s:.0f}s"
    return dict(json.loads(out.read_text()) if out.exists() else {}, status=status)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1b64,1b128,8b")
    p.add_argument("--paths", default=None, help="driver paths for every shape (default: each shape's plan)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=470)
    p.add_argument("--ckpt-dir", default="/tmp/vsurge-tpu-ckpt")
    p.add_argument("--cache-dir", default="/tmp/vsurge-tpu-cache")
    p.add_argument("--out-dir", default=".")
    p.add_argument("--warm-start", default="1b64", help="shape whose second start is measured ('' skips)")
    p.add_argument(
        "--correctness", default="tiny", help="checkpoint shape for the correctness run ('' skips)"
    )
    p.add_argument(
        "--worker-args", default="", help="passed to every tpu_worker.py, e.g. '--chunks 0 --busy-rows 0'"
    )
    p.add_argument(
        "--lora", default="", help="shape whose decode rate with 0, 1 and 4 LoRA adapters is measured last"
    )
    args = p.parse_args(argv)
    t_end = time.perf_counter() + args.budget_s
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = dict(shapes={}, batch=args.batch, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    if args.correctness:  # first: it is short, and a wrong answer makes every speed moot
        ckpt = str(Path(args.ckpt_dir) / args.correctness)
        write_checkpoint(args.correctness, ckpt)
        res = worker(
            args, args.correctness, PLAN[args.correctness], ckpt, min(150.0, args.budget_s / 3),
            out_dir / "correctness.json", extra=("--correctness",),
        )  # fmt: skip
        results["correctness"] = res.get("correctness", res.get("status"))
        (out_dir / "tpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
    shapes = [s for s in args.shapes.split(",") if s]
    for i, shape in enumerate(shapes):
        plan = PLAN[shape]
        left = t_end - time.perf_counter()
        # the rest of the budget is shared by the shapes still to run (the warm start takes ~a share)
        share = left / (len(shapes) - i + (1 if args.warm_start else 0) * 0.5)
        if left < plan["least"]:
            results["shapes"][shape] = dict(status=f"skipped: {left:.0f}s left, needs {plan['least']}s")
            continue
        ckpt = str(Path(args.ckpt_dir) / shape)
        t0 = time.perf_counter()
        written = write_checkpoint(shape, ckpt)
        res = worker(args, shape, plan, ckpt, max(plan["least"], share), out_dir / f"{shape}.json")
        res["checkpoint_write_s"] = time.perf_counter() - t0 - res["wall_s"]
        res["checkpoint_bytes_written"] = written
        results["device"] = results.get("device") or res.get("device")
        results["shapes"][shape] = res
        (out_dir / "tpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
    if args.warm_start and args.warm_start in results["shapes"] and t_end - time.perf_counter() > 30:
        shape = args.warm_start
        res = worker(
            args, shape, PLAN[shape], str(Path(args.ckpt_dir) / shape), t_end - time.perf_counter(),
            out_dir / f"{shape}-warm.json", extra=("--warm-start",),
        )  # fmt: skip
        results["warm_start"] = dict(res, shape=shape)
    if args.lora and t_end - time.perf_counter() > 60:
        results["lora"] = lora_rates(args, out_dir, t_end - time.perf_counter())
    report = table(results)
    lora = results.get("lora") or {}
    if lora.get("rates"):
        base = lora["rates"].get("no bank")
        report += f"\n\nLoRA on {args.lora} ({lora.get('dtype')}, batch {lora.get('batch')}, rank {lora.get('rank')}):"
        report += "".join(
            f"\n- {name}: {rate:.0f} tok/s ({rate / base:.2f} of no bank)"
            for name, rate in lora["rates"].items()
        )
    elif lora:
        report += f"\n\nLoRA on {args.lora}: {lora.get('status')}"
    checks = results.get("correctness")
    if isinstance(checks, list):
        report += (
            "\n\n| weights | path | greedy tokens = CPU reference (highest precision) |\n|---|---|---|\n"
        )
        report += "\n".join(
            f"| {c['weights']} | {c['path']} | {'yes' if c['ok'] else 'NO ' + str(c.get('error') or c.get('got'))} |"
            for c in checks
        )
    print(report, flush=True)
    (out_dir / "tpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
    (out_dir / "tpu_bench.md").write_text(report + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:  # one shape in the process worker() starts
        from tpu_worker import main as worker_main

        raise SystemExit(worker_main(sys.argv[2:]))
    if sys.argv[1:2] == ["checkpoint"]:  # a shape's checkpoint alone, e.g. for serving.py --serve on the chip
        write_checkpoint(*sys.argv[2:4])
        raise SystemExit(0)
    raise SystemExit(main())
