"""Where a serving step's time goes: the mixed-32 workload in process, CPU time by thread, per decode step.

    python benchmarks/step_breakdown.py                          # vdriver, default model, mixed-32
    python benchmarks/step_breakdown.py --speculative ngram      # the same with n-gram speculation
    python benchmarks/step_breakdown.py --kv-cache-dtype bfloat16 --prefill-dtype bfloat16
    python benchmarks/step_breakdown.py --preset quote-32 --json
    python benchmarks/step_breakdown.py --max-num-batched-tokens 256   # prompts prefilled in the steps

The workload of `benchmarks/serving.py --preset P` runs through `vSurge.complete` on one asyncio loop (no
HTTP: the server's own share is in `benchmarks/host_overhead.py`). Every thread's CPU time is read from
/proc before and after, so nothing is timed inside the engine and the run is the real pipeline:

  compute        XLA's worker threads: the decode, verify and prefill programs themselves
  step thread    vsurge-generate-*: planning, slot inserts, dispatch (and, with speculation, the proposer)
  detokenize     vsurge-detokenize-*: tokens to text, stop strings, deltas to the consumers
  prefill        vsurge-prefill-* and vsurge-transfer: packing prompts, dispatching prefill, hand-off
  consumer       the asyncio loop: the client side of each stream
Figures are per decode step (CPU ms / steps). The machine has N cores: a step's wall time is at least
(all CPU) / N, and compute's share of the cores says how much of the wall the programs held. Then, for
scale, the decode program alone at the step's row count, at the run's mean context (`device step alone`),
and the prefill program's cost per prompt token at a 128-token pack.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving  # noqa: E402 - the workloads are serving.py's presets

_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by native thread id."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def category(name: str | None) -> str:
    if name is None:
        return "compute"
    for prefix, cat in (
        ("vsurge-generate", "step thread"),
        ("vsurge-detokenize", "detokenize"),
        ("vsurge-prefill", "prefill"),
        ("vsurge-transfer", "prefill"),
        ("MainThread", "consumer"),
    ):
        if name.startswith(prefix):
            return cat
    return "other"


class StepCounter:
    """Counts the engine's decode and verify steps and the rows each ran (wraps the instance's methods)."""

    def __init__(self, engine: Any):
        self.steps = self.verify_steps = self.rows = self.bucket_rows = 0
        self.limits: list[int] = []
        decode, verify = engine.decode, engine.verify

        def counted_decode(state):
            self.steps += 1
            self.rows += int(engine._active.sum())
            self.bucket_rows += engine.decode_bucket()
            live = np.flatnonzero(engine._active)
            self.limits.append(int(engine._pos[live].max()) + 1 if live.size else 1)
            return decode(state)

        def counted_verify(state, draft, num):
            self.verify_steps += 1
            self.rows += int(engine._active.sum())
            self.bucket_rows += engine.decode_bucket()
            return verify(state, draft, num)

        engine.decode, engine.verify = counted_decode, counted_verify
        if engine.mixed is not None:  # --max-num-batched-tokens: the mixed steps decode too
            mixed_step = engine.mixed.step

            def counted_mixed(state, chunks, shape):
                self.steps += 1
                self.rows += int(engine._active.sum())
                self.bucket_rows += engine.decode_bucket()
                live = np.flatnonzero(engine._active)
                self.limits.append(int(engine._pos[live].max()) + 1 if live.size else 1)
                return mixed_step(state, chunks, shape)

            engine.mixed.step = counted_mixed


def alone(engine: Any, rows: int, limit: int, reps: int = 5) -> float:
    """Seconds of one decode step of `rows` rows reading `limit` cache positions, alone in a loop."""
    import jax

    state = engine.init_decode_state()
    fn = engine._decode[rows]
    lengths = np.full(rows, limit, np.int32)  # every row at that context
    state, out = fn(engine.step_params(rows), state, lengths)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(reps):
        state, out = fn(engine.step_params(rows), state, lengths)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


def prefill_per_token(engine: Any, tokens: int = 128, reps: int = 3) -> float:
    import jax

    from vsurge.contracts.sampling_params import SamplingParams

    args = (engine.prefill_params, *engine._pack([[7] * tokens], [SamplingParams(max_tokens=1)], None))
    jax.block_until_ready(engine._prefill(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = engine._prefill(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps / tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mixed-32", choices=sorted(serving.PRESETS))
    p.add_argument("--model", default="default")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-length", type=int, default=None, help="default: vsurge serve's")
    p.add_argument("--speculative", default="none", choices=["none", "ngram"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"])
    p.add_argument("--prefill-dtype", default="auto", choices=["auto", "bfloat16"])
    p.add_argument("--decode-dtype", default="auto", choices=["auto", "bfloat16"])
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="prompts prefilled inside the decode steps"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--smoke", action="store_true", help="4 short requests, 2 in flight: the path only (tests)"
    )
    args = p.parse_args(argv)

    import vsurge
    from vsurge import vSurge

    preset = serving.PRESETS[args.preset]
    if args.smoke:
        preset = dataclasses.replace(
            preset, num_requests=4, concurrency=2, prompt_tokens=(8, 16), max_tokens=(4, 8)
        )
    model, processor = vsurge.load_model(args.model)
    kw: dict[str, Any] = {
        "max_concurrent_decodes": args.slots,
        "speculative": args.speculative,
        "kv_cache_dtype": args.kv_cache_dtype,
        "prefill_dtype": args.prefill_dtype,
        "decode_dtype": args.decode_dtype,
    }
    if args.max_length:
        kw["max_length"] = args.max_length
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    surge = vSurge.create_vdriver(model, processor, vsurge_name="bench", **kw)
    surge.compile()
    engine = surge.driver._decode_engines[0]
    counter = StepCounter(engine)
    surge.start()
    jobs = serving.make_jobs(
        preset.num_requests, preset.prompt_tokens, preset.max_tokens, args.seed, preset.prompts
    )
    run_args = argparse.Namespace(
        max_tokens=preset.max_tokens[1],
        temperature=preset.temperature,
        ignore_eos=preset.ignore_eos,
        endpoint=preset.endpoint,
        warmup=0,
        concurrency=preset.concurrency,
        request_rate=None,
        seed=args.seed,
    )
    before, t0 = thread_cpu(), time.perf_counter()
    results, duration = asyncio.run(serving.inprocess_run(surge, run_args, jobs))
    wall, after = time.perf_counter() - t0, thread_cpu()
    names = {t.native_id: t.name for t in threading.enumerate()}
    surge.stop()

    cpu: dict[str, float] = {}
    for tid, seconds in after.items():
        cat = category(names.get(tid))
        cpu[cat] = cpu.get(cat, 0.0) + seconds - before.get(tid, 0.0)
    steps = counter.steps + counter.verify_steps
    summary = serving.summarize(results, duration)
    mean_rows = counter.rows / max(steps, 1)
    mean_limit = int(np.mean(counter.limits)) if counter.limits else 1
    rows_bucket = next(
        (r for r in engine.decode_rows if r >= round(mean_rows)), engine.max_concurrent_decodes
    )
    step_alone = alone(engine, rows_bucket, mean_limit)
    per_token = prefill_per_token(engine)
    cores = os.cpu_count() or 1
    report = {
        "preset": args.preset,
        "speculative": args.speculative,
        "kv_cache_dtype": args.kv_cache_dtype,
        "prefill_dtype": args.prefill_dtype,
        "decode_dtype": args.decode_dtype,
        "wall_s": round(wall, 1),
        "output_tok_s": round(summary["output_token_throughput"], 1),
        "ttft_p50_s": summary["ttft_s"].get("p50"),
        "tpot_p50_s": summary["tpot_s"].get("p50"),
        "steps": counter.steps,
        "verify_steps": counter.verify_steps,
        "mean_rows": round(mean_rows, 1),
        "mean_bucket_rows": round(counter.bucket_rows / max(steps, 1), 1),
        "mean_context": mean_limit,
        "wall_ms_per_step": round(1000 * wall / max(steps, 1), 1),
        "cpu_ms_per_step": {k: round(1000 * v / max(steps, 1), 1) for k, v in sorted(cpu.items())},
        "compute_share_of_cores": round(cpu.get("compute", 0.0) / (wall * cores), 2),
        "device_step_alone_ms": round(1000 * step_alone, 1),
        "device_step_alone_rows": rows_bucket,
        "prefill_ms_per_prompt_token": round(1000 * per_token, 2),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
    }
    report["prefill_ms_per_step_if_serial"] = round(
        report["prefill_ms_per_prompt_token"] * report["prompt_tokens"] / max(steps, 1), 1
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{args.preset} ({args.speculative}): {report['output_tok_s']} tok/s, {steps} steps in {wall:.1f} s"
    )
    print(
        f"  per step: {report['wall_ms_per_step']} ms wall, {report['mean_rows']} rows live of "
        f"{report['mean_bucket_rows']} run, context {mean_limit}"
    )
    for k, v in report["cpu_ms_per_step"].items():
        print(f"  {k:<12} {v:8.1f} CPU ms")
    print(f"  compute held {report['compute_share_of_cores']:.0%} of {cores} cores")
    print(
        f"  device step alone ({rows_bucket} rows, context {mean_limit}): {report['device_step_alone_ms']} ms"
    )
    print(
        f"  prefill: {report['prefill_ms_per_prompt_token']} ms per prompt token alone; "
        f"{report['prefill_ms_per_step_if_serial']} ms per step if run serially"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
