"""One model shape on the TPU, in its own process (benchmarks/tpu_bench.py starts one per shape).

    python benchmarks/tpu_bench.py worker --ckpt /tmp/ckpt-1b64 --shape 1b64 --paths vdriver,odriver-pallas \
        --out /tmp/1b64.json --deadline-s 200

Loads the checkpoint with `vsurge.load_model`, then per driver/attention path: the raw loop (the model's
bare jitted decode step with that path's attention, greedy argmax, no scheduling), the engine built
through `vSurge.create` (compile timed) running a fixed batch and a mixed workload through
`vSurge.complete` as a user would (no HTTP). Results are written to --out after every measurement, so a
worker stopped at its deadline still leaves what it measured. ``--warm-start`` only builds the default
path, compiles and answers one request: the second-start time with a warm persistent compile cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

T_PROCESS = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

import numpy as np  # noqa: E402

OUT: dict[str, Any] = {"runs": [], "errors": []}


def save(path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(OUT, indent=1, default=str))


# ------------------------------------------------------------------------------------------ roofline


from tpu_instruments import StartBreakdown, Timeline, busy_rows_experiment, prefill_probe  # noqa: E402
from tpu_raw import kv_bytes_per_token, param_count, raw_loop, weight_read_bytes  # noqa: E402
from tpu_workloads import matmul_params, matmul_peak, mixed_limit, run_requests, workloads  # noqa: E402

# ------------------------------------------------------------------------------------------ engines


def engine_config(
    path: str, batch: int, max_length: int, decode_steps: int | None = None, kv_cache_bytes: int | None = None
):
    from vsurge.contracts.engine_config import EngineConfig

    kw: dict[str, Any] = dict(max_concurrent_decodes=batch, max_length=max_length)
    if kv_cache_bytes and path != "vdriver":
        kw["kv_cache_bytes"] = kv_cache_bytes
    if path == "vdriver":
        return EngineConfig(driver="vdriver", decode_steps=decode_steps, **kw)
    return EngineConfig(driver="odriver", attention="pallas" if path == "odriver-pallas" else "jax", **kw)


def run_engine(model, tok, path, args, fixed, mixed, raw, deadline: float, raw_walk=None) -> dict:
    from vsurge import vSurge

    out: dict[str, Any] = dict(path=path)
    if raw_walk:
        out["raw_walk"] = raw_walk
    cfg = engine_config(path, args.batch, args.max_length, args.decode_steps)
    t0 = time.perf_counter()
    surge = vSurge.create(model, tok, cfg)
    out["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    breakdown = StartBreakdown()
    surge.compile()
    out["compile_s"] = time.perf_counter() - t0
    out["compile_breakdown"] = breakdown.close()
    engine = surge.driver.engines[0]
    out["compile_report"] = getattr(engine, "compile_report", None)
    store = getattr(engine, "executable_store", None)
    if store is not None:
        # the executables a cold start compiled are written after it, on a thread of their own: measured
        # once they are on disk, so the serving figures are the steady state's
        t0 = time.perf_counter()
        store.wait()
        out["executables_written"] = dict(store.report(), waited_s=round(time.perf_counter() - t0, 2))
    if path == "vdriver" and time.perf_counter() < deadline:
        out["prefill"] = prefill_probe(engine, matmul_params(model), args.peak_flops)
    surge.start()
    try:
        if time.perf_counter() < deadline:
            timeline = Timeline(engine) if args.timeline and path == "vdriver" else None
            out["fixed"] = run_requests(surge, *fixed, max_in_flight=args.batch, deadline=deadline)
            if timeline is not None:
                out["fixed"]["timeline"] = timeline.close()
            if raw:
                out["fixed"]["vs_raw"] = out["fixed"]["tok_s"] / raw["tok_s"]
            walk = out.get("raw_walk")
            if walk and out["fixed"].get("decode_tok_s"):
                out["fixed"]["decode_vs_walk"] = out["fixed"]["decode_tok_s"] / walk["tok_s"]
                out["fixed"]["vs_walk"] = out["fixed"]["tok_s"] / walk["tok_s"]
        if time.perf_counter() < deadline:
            out["mixed"] = run_requests(surge, *mixed, max_in_flight=args.batch, deadline=deadline)
            if raw:
                limit = mixed_limit(raw["step_s"], *mixed, matmul_params(model), args.peak_flops, args.batch)
                out["mixed"]["limit_tok_s"] = sum(mixed[1]) / limit
                out["mixed"]["vs_limit"] = out["mixed"]["tok_s"] / out["mixed"]["limit_tok_s"]
        if path == "vdriver" and args.busy_rows and time.perf_counter() < deadline - 30:
            out["busy_rows"] = busy_rows_experiment(surge, engine, args, fixed, mixed, deadline)
    finally:
        surge.stop()
    out["calls_run_by_jit"] = missed_programs()
    return out


def missed_programs() -> dict[str, int]:
    """Per program, the calls with a signature start-up did not compile (engines/aot_program.py)."""
    from vsurge.engines.aot_program import missed

    return missed()


@contextlib.contextmanager
def load_phases():
    """Seconds of `load_model`'s two parts (weights placed, tokenizer read), timed around the loader's
    own functions for the block (the benchmark's view; the loader keeps no timers)."""
    from vsurge.models import loader

    phases: dict[str, float] = {}
    originals = {"weights_s": loader.build_model, "tokenizer_s": loader._hf_tokenizer}

    def timed(key, fn):
        def run(*a, **kw):
            tic = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - tic

        return run

    loader.build_model = timed("weights_s", originals["weights_s"])
    loader._hf_tokenizer = timed("tokenizer_s", originals["tokenizer_s"])
    try:
        yield phases
    finally:
        loader.build_model, loader._hf_tokenizer = originals["weights_s"], originals["tokenizer_s"]


def warm_start(args) -> None:
    """Load, build, compile and answer one request on the default path: the start a second pod pays."""
    import jax

    import vsurge
    from vsurge.models.compiled.compilation_cache import enable_compilation_cache

    enable_compilation_cache()  # as vsurge serve does: VSURGE_CACHE_DIR/jax
    t_init = time.perf_counter()
    jax.devices()
    OUT["backend_init_s"] = time.perf_counter() - t_init
    t0 = time.perf_counter()
    breakdown = StartBreakdown()
    with load_phases() as phases:
        model, tok = vsurge.load_model(args.ckpt, quantization=args.quant)
    OUT["load_s"] = time.perf_counter() - t0
    OUT["load_phases"] = phases
    path = args.paths.split(",")[0]
    t1 = time.perf_counter()
    surge = vsurge.vSurge.create(model, tok, engine_config(path, args.batch, args.max_length))
    surge.compile()
    OUT["compile_s"] = time.perf_counter() - t1
    OUT["compile_breakdown"] = breakdown.close()
    OUT["compile_report"] = getattr(surge.driver.engines[0], "compile_report", None)
    surge.start()
    fixed, _ = workloads(model.config.vocab_size, 1, 16, 4, 64)
    OUT["first_request"] = run_requests(surge, *fixed, max_in_flight=1, deadline=time.perf_counter() + 60)
    OUT["ready_s"] = time.perf_counter() - t0
    OUT["ready_from_process_s"] = time.perf_counter() - T_PROCESS
    surge.stop()
    OUT["calls_run_by_jit"] = missed_programs()


def first_mismatch(ref_model, prompts, got, want, ref_logits, cpu) -> list[dict]:
    """Per differing prompt: where the device's tokens first leave the reference's, and the reference's
    gap between its chosen token and the device's there (a gap of ~1e-3 of the logits' scale is a tie
    that summation order decides; a large one is a wrong result)."""
    import jax

    out = []
    for i, (p, g, w) in enumerate(zip(prompts, got, want, strict=True)):
        if g == w:
            continue
        k = next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
        row = dict(prompt=i, at=k, got=g[k] if k < len(g) else None, want=w[k] if k < len(w) else None)
        if row["got"] is not None and row["want"] is not None:
            with jax.default_device(cpu):
                lg = np.asarray(ref_logits(ref_model, np.asarray([list(p) + w[:k]], np.int32)))[0, -1]
            row.update(gap=float(lg[w[k]] - lg[g[k]]), scale=float(np.std(lg)))
        out.append(row)
    return out


def correctness(args) -> None:
    """Greedy tokens of a tiny model on the device, through each engine path (vdriver's dense rows,
    odriver's paged pure JAX and Pallas kernel; f32 and int8 weights), against the CPU reference of the
    very same weights (moved back to the host), all under jax.default_matmul_precision('highest')."""
    import jax
    from flax import nnx

    import vsurge
    from vsurge.models import greedy_generate
    from vsurge.models import logits as ref_logits

    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(2, 2000, n))) for n in (5, 17, 40)]
    new = 12
    rows = []
    # Process-wide, not the context manager alone: jax's config contexts are thread-local, and the engine
    # runs its steps on threads of its own (a context here left them at the TPU's default bf16 passes).
    jax.config.update("jax_default_matmul_precision", "highest")
    with jax.default_matmul_precision("highest"):
        for quant in ("none", "int8"):
            model, tok = vsurge.load_model(args.ckpt, dtype="float32", quantization=quant)
            graphdef, state = nnx.split(model)
            ref_model = nnx.merge(graphdef, jax.device_put(state, cpu))
            with jax.default_device(cpu):
                want = [greedy_generate(ref_model, [p], new)[0] for p in prompts]
            for path in ("vdriver", "odriver-jax", "odriver-pallas"):
                if quant == "int8" and path == "odriver-jax":
                    continue
                row = dict(weights="f32" if quant == "none" else "int8", path=path)
                try:
                    surge = vsurge.vSurge.create(
                        model, tok, engine_config(path, 4, 128, kv_cache_bytes=64 << 20)
                    )
                    surge.compile()
                    surge.start()
                    try:
                        got = []
                        for p in prompts:
                            ids = []

                            async def one(p=p, ids=ids, surge=surge):
                                req = vsurge.vSurgeRequest(
                                    prompt=p, max_tokens=new, temperature=0.0, ignore_eos=True,
                                    is_client_side_tokenization=True,
                                )  # fmt: skip
                                async for items in surge.complete(req):
                                    for s in items:
                                        ids.extend(s.token_ids)

                            asyncio.run(one())
                            got.append(ids)
                    finally:
                        surge.stop()
                    row.update(ok=got == want, got=got[:1], want=want[:1])
                    if got != want:  # a near-tie flipped by summation order, or a wrong path?
                        row["mismatch"] = first_mismatch(ref_model, prompts, got, want, ref_logits, cpu)
                except Exception as e:  # noqa: BLE001 - each path stands alone
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                rows.append(row)
                print(f"correctness {row}", flush=True)
                OUT["correctness"] = rows
                save(args.out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--shape", required=True)
    p.add_argument("--paths", default="vdriver,odriver-pallas")
    p.add_argument("--quant", default="none")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--fixed-prompt", type=int, default=128)
    p.add_argument("--fixed-out", type=int, default=256)
    p.add_argument("--mixed-max-prompt", type=int, default=512)
    p.add_argument(
        "--peak-flops",
        type=float,
        default=0.0,
        help="matmul FLOP/s for the limits (0: measured on the device)",
    )
    p.add_argument(
        "--decode-steps", type=int, default=None, help="vdriver's decode block (default: the backend's)"
    )
    p.add_argument("--deadline-s", type=float, default=300)
    p.add_argument("--warm-start", action="store_true")
    p.add_argument("--timeline", type=int, default=1, help="vdriver: record the fixed run's engine calls")
    p.add_argument(
        "--busy-rows",
        type=int,
        default=1,
        help="vdriver: rerun both workloads with idle-sized busy prefill calls",
    )
    p.add_argument(
        "--chunks", type=int, default=1, help="vdriver: also walk the raw loop with read chunks 128 and 512"
    )
    p.add_argument(
        "--correctness", action="store_true", help="tiny model: device tokens against the CPU reference"
    )
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.measure_peak = not args.peak_flops
    deadline = T_PROCESS + args.deadline_s
    OUT.update(shape=args.shape, quant=args.quant, batch=args.batch)
    try:
        if args.warm_start:
            warm_start(args)
            return 0
        if args.correctness:
            correctness(args)
            return 0
        import jax

        import vsurge
        from vsurge.models.compiled.compilation_cache import enable_compilation_cache

        enable_compilation_cache()  # as vsurge serve does: VSURGE_CACHE_DIR/jax (cold here, warm at --warm-start)
        t0 = time.perf_counter()
        dev = jax.devices()[0]
        OUT.update(device=dev.device_kind, backend_init_s=time.perf_counter() - t0)
        t0 = time.perf_counter()
        with load_phases() as phases:
            model, tok = vsurge.load_model(args.ckpt, quantization=args.quant)
        OUT["load_s"] = time.perf_counter() - t0
        OUT["load_phases"] = phases
        OUT["weight_bytes"] = weight_read_bytes(model)
        OUT["params"], OUT["matmul_params"] = param_count(model), matmul_params(model)
        if not args.peak_flops:  # the chip's own matmul rate, measured once: the limit's yardstick
            args.peak_flops = matmul_peak(8192 if dev.platform == "tpu" else 512)
        OUT["matmul_peak_flops"], OUT["matmul_peak_measured"] = args.peak_flops, args.measure_peak
        OUT["kv_bytes_per_token"] = kv_bytes_per_token(model.config)
        save(args.out)
        fixed, mixed = workloads(
            model.config.vocab_size, args.batch, args.fixed_prompt, args.fixed_out, args.mixed_max_prompt
        )
        context = args.fixed_prompt + args.fixed_out // 2  # the fixed run's mean context
        for path in args.paths.split(","):
            run: dict[str, Any] = dict(path=path)
            OUT["runs"].append(run)
            if time.perf_counter() > deadline - 20:
                run["skipped"] = "deadline"
                continue
            try:
                run["raw"] = raw_loop(model, path, args.batch, context, args.max_length)
                moved = OUT["weight_bytes"] + args.batch * context * OUT["kv_bytes_per_token"]
                run["raw"]["hbm_gbps"] = moved / run["raw"]["step_s"] / 1e9
                save(args.out)
                print(f"{args.shape} {path} raw: {json.dumps(run['raw'])}", flush=True)
                # the same decode work as the fixed batch: rows walking from the prompt's end, per read
                # chunk the engine could use (vdriver: the backend's default, then 128 and 512)
                walks = [None, 128, 512] if path == "vdriver" and args.chunks else [None]
                for chunk in walks:
                    if time.perf_counter() > deadline - 60:
                        break
                    w = raw_loop(
                        model, path, args.batch, args.fixed_prompt, args.max_length,
                        walk=args.fixed_out, chunk=chunk,
                    )  # fmt: skip
                    w["hbm_gbps"] = moved / w["step_s"] / 1e9
                    run.setdefault("raw_walks", []).append(w)
                    save(args.out)
                    print(f"{args.shape} {path} raw walk: {json.dumps(w)}", flush=True)
                walk = (run.get("raw_walks") or [None])[0]
                run.update(run_engine(model, tok, path, args, fixed, mixed, run["raw"], deadline, walk))
            except Exception as e:  # noqa: BLE001 - each configuration stands alone
                run["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                OUT["errors"].append(f"{path}: {run['error']}")
                print(f"{args.shape} {path} ERROR {run['error']}", flush=True)
            save(args.out)
            print(
                f"{args.shape} {path}: {json.dumps({k: v for k, v in run.items() if k != 'raw'}, default=str)}",
                flush=True,
            )
    finally:
        OUT["worker_s"] = time.perf_counter() - T_PROCESS
        save(args.out)
    return 0
