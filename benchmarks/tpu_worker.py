"""One model shape on the TPU, in its own process (benchmarks/tpu_bench.py starts one per shape).

    python benchmarks/tpu_worker.py --ckpt /tmp/ckpt-1b64 --shape 1b64 --paths vdriver,odriver-pallas \
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
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

T_PROCESS = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

import numpy as np  # noqa: E402

OUT: dict[str, Any] = {"runs": [], "errors": []}
_TICK = os.sysconf("SC_CLK_TCK")


def save(path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(OUT, indent=1, default=str))


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, summed by thread name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(task.name), "other")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


# ------------------------------------------------------------------------------------------ roofline


def kv_bytes_per_token(cfg, itemsize: int = 2) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def weight_read_bytes(model) -> int:
    """Bytes a decode step reads from the weights (an untied embedding table is only gathered from)."""
    import jax
    from flax import nnx

    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if model.lm_head is not None:
        emb = model.model.embed_tokens
        total -= emb.embedding[...].nbytes + (0 if emb.scale is None else emb.scale[...].nbytes)
    return total


def param_count(model) -> int:
    import jax
    from flax import nnx

    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ------------------------------------------------------------------------------------------ raw loops


def raw_paged_cache(cfg, batch: int, max_length: int, page: int, dtype):
    """The raw loop's paged cache and page table: every row owns ``max_length`` positions of pages, the
    cache holds exactly those (sized by the layout the cache itself picks: a head_dim-64 model's pages
    are padded to 128 lanes on the kernel path and cost twice the model's bytes). A table naming a page
    the cache does not hold is refused here: the TPU kernel does not bound-check its page DMAs, and an
    index past the cache halts the chip's core (E0200 RuntimeUnexpectedCoreHalt, 2026-12-06, head_dim 64)."""
    from vsurge.engines.paging import PagedAttentionCache, bytes_per_page, cache_layout
    from vsurge.models.paged_attention import use_pallas

    per = -(-max_length // page)
    kv = cache_layout(cfg, 1, kernel=use_pallas())
    storage = PagedAttentionCache.create(
        cfg, page, 0.9, (batch * per + 1) * bytes_per_page(cfg, page, dtype, kv), dtype=dtype
    )
    table = 1 + np.arange(batch * per, dtype=np.int32).reshape(batch, per)
    if int(table.max()) > storage.num_pages:
        raise ValueError(f"the page table names page {int(table.max())}, the cache holds {storage.num_pages}")
    return storage, table


def raw_loop(model, path: str, batch: int, context: int, max_length: int, steps: int = 20) -> dict:
    """Seconds per step of the bare jitted decode step (greedy argmax) over ``batch`` rows at ``context``
    positions, with the attention and cache layout the engine of ``path`` uses."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from vsurge.models.attention import DenseDecodeAttention
    from vsurge.models.paged_attention import PagedDecodeAttention
    from vsurge.models.pallas_sharded import configure

    cfg = model.config
    graphdef, params = nnx.split(model)
    dt = model.dtype
    if path == "vdriver":
        backend = DenseDecodeAttention(window=cfg.sliding_window)
        shape = (batch, max_length, cfg.num_kv_heads * cfg.head_dim)
        caches = tuple((jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.num_layers))
        meta_of = lambda pos: (pos, pos + 1)  # noqa: E731
    else:
        setup = configure("pallas" if path == "odriver-pallas" else "jax", None, cfg, dt)
        page = 128
        storage, table = raw_paged_cache(cfg, batch, max_length, page, dt)
        caches = storage.allocate()
        table = jnp.asarray(table)
        backend = PagedDecodeAttention(page, -(-context // page) + 1, window=cfg.sliding_window)
        meta_of = lambda pos: (pos, table)  # noqa: E731
        del setup

    @jax.jit
    def step(params, caches, tokens, pos):
        m = nnx.merge(graphdef, params)
        hidden, caches = m(tokens[:, None], pos[:, None], backend, caches, meta_of(pos))
        nxt = jnp.argmax(m.compute_logits(hidden[:, 0]), axis=-1).astype(jnp.int32)
        return tuple(caches), nxt, pos

    step = jax.jit(step.__wrapped__, donate_argnums=(1,))
    tokens = jnp.ones((batch,), jnp.int32)
    pos = jnp.full((batch,), context - 1, jnp.int32)
    t0 = time.perf_counter()
    caches, tokens, pos = step(params, caches, tokens, pos)
    tokens.block_until_ready()
    compile_s = time.perf_counter() - t0
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(steps):
            caches, tokens, pos = step(params, caches, tokens, pos)
        tokens.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / steps)
    del caches
    return dict(step_s=best, tok_s=batch / best, compile_s=compile_s, context=context)


# ------------------------------------------------------------------------------------------ engines


def engine_config(
    path: str, batch: int, max_length: int, decode_steps: int | None = None, kv_cache_bytes: int | None = None
):
    from vsurge.engine_config import EngineConfig

    kw: dict[str, Any] = dict(max_concurrent_decodes=batch, max_length=max_length)
    if kv_cache_bytes and path != "vdriver":
        kw["kv_cache_bytes"] = kv_cache_bytes
    if path == "vdriver":
        return EngineConfig(driver="vdriver", decode_steps=decode_steps, **kw)
    return EngineConfig(driver="odriver", attention="pallas" if path == "odriver-pallas" else "jax", **kw)


def run_requests(surge, prompts, outputs, max_in_flight: int, deadline: float) -> dict:
    """Every request through `vSurge.complete` on one asyncio loop (as the server does); tok/s over the
    whole run, TTFT per request. Requests still running at the deadline are cancelled."""
    from vsurge.request import vSurgeRequest

    counts = [0] * len(prompts)
    ttft = [None] * len(prompts)

    async def one(i, p, n, sem):
        async with sem:
            req = vSurgeRequest(
                prompt=list(map(int, p)),
                max_tokens=int(n),
                temperature=0.0,
                ignore_eos=True,
                is_client_side_tokenization=True,
            )
            t0 = time.perf_counter()
            async for items in surge.complete(req):
                for s in items:
                    if counts[i] == 0 and len(s.token_ids):
                        ttft[i] = time.perf_counter() - t0
                    counts[i] += len(s.token_ids)

    async def run():
        sem = asyncio.Semaphore(max_in_flight)
        tasks = [
            asyncio.create_task(one(i, p, n, sem))
            for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))
        ]
        _, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)

    cpu0 = thread_cpu()
    t0 = time.perf_counter()
    cut = asyncio.run(run())
    wall = time.perf_counter() - t0
    cpu1 = thread_cpu()
    tt = np.array([x for x in ttft if x is not None])
    threads = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
    return dict(
        wall_s=wall,
        tokens=sum(counts),
        tok_s=sum(counts) / wall,
        ttft_p50=float(np.percentile(tt, 50)) if tt.size else None,
        ttft_p90=float(np.percentile(tt, 90)) if tt.size else None,
        cancelled=cut,
        thread_cpu_s={k: round(v, 3) for k, v in threads.items() if v > 0.005},
    )


def workloads(
    vocab: int, batch: int, fixed_prompt: int, fixed_out: int, mixed_max_prompt: int, seed: int = 0
):
    rng = np.random.default_rng(seed)
    hi = min(vocab, 30000)
    fixed = ([rng.integers(2, hi, fixed_prompt) for _ in range(batch)], [fixed_out] * batch)
    lens = rng.integers(32, mixed_max_prompt + 1, batch)
    mixed = ([rng.integers(2, hi, n) for n in lens], list(rng.integers(16, 257, batch)))
    return fixed, mixed


def mixed_limit(step_s: float, prompts, outputs, params: int, peak_flops: float) -> float:
    """The mixed workload's limit estimate in seconds: the longest output's decode steps at the raw step
    time, plus the prompts' matmul FLOPs (2 x parameters per token) at the chip's peak."""
    prefill = 2.0 * params * sum(len(p) for p in prompts) / peak_flops
    return max(outputs) * step_s + prefill


def run_engine(model, tok, path, args, fixed, mixed, raw, deadline: float) -> dict:
    from vsurge import vSurge

    out: dict[str, Any] = dict(path=path)
    cfg = engine_config(path, args.batch, args.max_length, args.decode_steps)
    t0 = time.perf_counter()
    surge = vSurge.create(model, tok, cfg)
    out["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    surge.compile()
    out["compile_s"] = time.perf_counter() - t0
    surge.start()
    try:
        if time.perf_counter() < deadline:
            out["fixed"] = run_requests(surge, *fixed, max_in_flight=args.batch, deadline=deadline)
            if raw:
                out["fixed"]["vs_raw"] = out["fixed"]["tok_s"] / raw["tok_s"]
        if time.perf_counter() < deadline:
            out["mixed"] = run_requests(surge, *mixed, max_in_flight=args.batch, deadline=deadline)
            if raw:
                limit = mixed_limit(raw["step_s"], *mixed, param_count(model), args.peak_flops)
                out["mixed"]["limit_tok_s"] = sum(mixed[1]) / limit
                out["mixed"]["vs_limit"] = out["mixed"]["tok_s"] / out["mixed"]["limit_tok_s"]
    finally:
        surge.stop()
    return out


def warm_start(args) -> None:
    """Load, build, compile and answer one request on the default path: the start a second pod pays."""
    import jax

    import vsurge
    from vsurge.compilation_cache import enable_compilation_cache

    enable_compilation_cache()  # as vsurge serve does: VSURGE_CACHE_DIR/jax
    t_init = time.perf_counter()
    jax.devices()
    OUT["backend_init_s"] = time.perf_counter() - t_init
    t0 = time.perf_counter()
    model, tok = vsurge.load_model(args.ckpt, quantization=args.quant)
    OUT["load_s"] = time.perf_counter() - t0
    path = args.paths.split(",")[0]
    t1 = time.perf_counter()
    surge = vsurge.vSurge.create(model, tok, engine_config(path, args.batch, args.max_length))
    surge.compile()
    OUT["compile_s"] = time.perf_counter() - t1
    surge.start()
    fixed, _ = workloads(model.config.vocab_size, 1, 16, 4, 64)
    OUT["first_request"] = run_requests(surge, *fixed, max_in_flight=1, deadline=time.perf_counter() + 60)
    OUT["ready_s"] = time.perf_counter() - t0
    OUT["ready_from_process_s"] = time.perf_counter() - T_PROCESS
    surge.stop()


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
    p.add_argument("--peak-flops", type=float, default=165e12)
    p.add_argument(
        "--decode-steps", type=int, default=None, help="vdriver's decode block (default: the backend's)"
    )
    p.add_argument("--deadline-s", type=float, default=300)
    p.add_argument("--warm-start", action="store_true")
    p.add_argument(
        "--correctness", action="store_true", help="tiny model: device tokens against the CPU reference"
    )
    p.add_argument("--out")
    args = p.parse_args(argv)
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
        from vsurge.compilation_cache import enable_compilation_cache

        enable_compilation_cache()  # as vsurge serve does: VSURGE_CACHE_DIR/jax (cold here, warm at --warm-start)
        t0 = time.perf_counter()
        dev = jax.devices()[0]
        OUT.update(device=dev.device_kind, backend_init_s=time.perf_counter() - t0)
        t0 = time.perf_counter()
        model, tok = vsurge.load_model(args.ckpt, quantization=args.quant)
        OUT["load_s"] = time.perf_counter() - t0
        OUT["weight_bytes"] = weight_read_bytes(model)
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
                run.update(run_engine(model, tok, path, args, fixed, mixed, run["raw"], deadline))
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


if __name__ == "__main__":
    raise SystemExit(main())
