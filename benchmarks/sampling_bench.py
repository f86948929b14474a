"""Device time of one sampling step (`vsurge.engines.sampling.sample`) over all decode slots, per case.

    PYTHONPATH=service python benchmarks/sampling_bench.py [--shapes 64x128256,32x49152] [--impl auto|cpu|tpu|both]
        [--iters N] [--json out.json]

Needs only jax, numpy and the vsurge package (runs standalone on a TPU machine). Each shape compiles one
program per implementation: ``iters`` sampling steps inside one jitted ``lax.fori_loop`` (different logits
and step, hence different uniforms, every iteration), so per-call dispatch does not count; the case is a
runtime argument (the per-slot parameters), so every case shares that one compile. A baseline loop that
only brings each iteration's logits into a fresh buffer is subtracted: ``ms`` is the sampler's own device
time per step, ``gross`` includes the baseline.

Cases: greedy without / with top-20 logprobs; T=0.8 top_p=0.9 on "peaked" logits (most of the mass on ~20
tokens, as a trained LM's usually is) and on "flat" logits (N(0, 1.5^2): a nucleus thousands of tokens
wide, every slot on the exact bisection path: the worst case); top_k=50; plain T=1 (the OpenAI default:
the full-vocabulary sampler); penalties on; and a mix of all with a quarter of the slots asking logprobs.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from vsurge.contracts.sampling_params import SamplingParams as SP
from vsurge.engines.sampling import make_slot_sampling, sample, sampler_impl, seed_key_data

TOP = 20  # the engines' default num_top_logprobs
POOL = 2  # distinct logit arrays per kind, cycled through the loop


def peaked_logits(rng: np.random.Generator, s: int, v: int) -> np.ndarray:
    """N(0, 2^2) background and ~20 tokens per row high above it: at T=0.8 they hold ~90% of the mass."""
    x = rng.normal(size=(s, v)).astype(np.float32) * 2.0
    for i in range(s):
        x[i, rng.choice(v, 20, replace=False)] = rng.uniform(14.0, 16.0, size=20) + np.log(v / 128256)
    return x


def flat_logits(rng: np.random.Generator, s: int, v: int) -> np.ndarray:
    return rng.normal(size=(s, v)).astype(np.float32) * 1.5


def nucleus_size(x: np.ndarray, temperature: float, top_p: float) -> float:
    """Mean number of tokens top_p keeps at this temperature (host reference, for the table's caption)."""
    z = np.sort(x.astype(np.float64) / temperature, axis=-1)[:, ::-1]
    p = np.exp(z - z[:, :1])
    c = np.cumsum(p, -1) / p.sum(-1, keepdims=True)
    return float(np.mean(np.argmax(c >= top_p, -1) + 1))


def cases(s: int) -> dict[str, tuple[list[SP], str]]:
    """name -> (per-slot params, logits kind)."""
    lp = dict(logprobs=True, top_logprobs=TOP)
    pen = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3)
    blend = [
        SP(temperature=0.0),
        SP(temperature=0.7, top_p=0.9),
        SP(temperature=0.8, top_k=50, repetition_penalty=1.1),
        SP(temperature=1.0, min_p=0.05, presence_penalty=0.5, **lp),
    ]
    return {
        "greedy": ([SP(temperature=0.0)] * s, "peaked"),
        "greedy + top-20 logprobs": ([SP(temperature=0.0, **lp)] * s, "peaked"),
        "T=0.8 top_p=0.9 (peaked)": ([SP(temperature=0.8, top_p=0.9)] * s, "peaked"),
        "T=0.8 top_p=0.9 (flat, exact path)": ([SP(temperature=0.8, top_p=0.9)] * s, "flat"),
        "T=0.8 top_k=50": ([SP(temperature=0.8, top_k=50)] * s, "peaked"),
        "T=1 (full-vocab sampler)": ([SP(temperature=1.0)] * s, "peaked"),
        "T=0.8 top_p=0.9 + penalties": ([SP(temperature=0.8, top_p=0.9, **pen)] * s, "peaked"),
        "mixed (1/4 logprobs, penalties)": ([blend[i % 4] for i in range(s)], "peaked"),
    }


def loop_program(impl: str, iters: int, baseline: bool):
    """jit(pool, params, counts, pmask) -> token checksum after `iters` steps."""

    def run(pool, params, counts, pmask):
        s = pool.shape[1]

        def body(i, acc):
            # a fresh buffer each iteration, as the model's logits are
            x = lax.optimization_barrier(lax.dynamic_index_in_dim(pool, i % POOL, keepdims=False))
            if baseline:
                return acc + x[0, 0].astype(jnp.int32)
            step = jnp.full((s,), i, jnp.int32)
            out = sample(x, params, counts, pmask, step, TOP, impl=impl)
            return acc + jnp.sum(out.tokens) + out.top_ids[0, 0] + out.logprob[0].astype(jnp.int32)

        return lax.fori_loop(0, iters, body, jnp.int32(0))

    return jax.jit(run)


def best_of(fn, args, repeats: int) -> tuple[float, int]:
    """(fastest seconds per call, the call's result: a checksum of every token sampled)."""
    out = int(jax.block_until_ready(fn(*args)))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_shape(s: int, v: int, impls: list[str], iters: int, repeats: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    host = {"peaked": [peaked_logits(rng, s, v) for _ in range(POOL)]}
    host["flat"] = [flat_logits(rng, s, v) for _ in range(POOL)]
    pools = {k: jnp.asarray(np.stack(a)) for k, a in host.items()}
    counts = jnp.asarray(rng.integers(0, 3, size=(s, v)) * (rng.random((s, v)) < 0.002), jnp.int32)
    pmask = jnp.asarray(rng.random((s, v)) < 0.002)
    keys = [seed_key_data(i) for i in range(s)]
    params = {name: (make_slot_sampling(sps, keys=keys), kind) for name, (sps, kind) in cases(s).items()}
    out = {
        "slots": s,
        "vocab": v,
        "iters": iters,
        "nucleus_T0.8_p0.9": {k: nucleus_size(a[0], 0.8, 0.9) for k, a in host.items()},
        "impls": {},
    }
    base_fn = loop_program("cpu", iters, baseline=True)
    any_params = next(iter(params.values()))[0]
    base = best_of(base_fn, (pools["peaked"], any_params, counts, pmask), repeats)[0] / iters
    out["baseline_ms"] = base * 1e3
    for impl in impls:
        fn = loop_program(impl, iters, baseline=False)
        t = time.perf_counter()
        jax.block_until_ready(fn(pools["peaked"], any_params, counts, pmask))
        rows = {"compile_s": time.perf_counter() - t, "cases": {}}
        for name, (p, kind) in params.items():
            gross, checksum = best_of(fn, (pools[kind], p, counts, pmask), repeats)
            gross /= iters
            rows["cases"][name] = {"ms": (gross - base) * 1e3, "gross_ms": gross * 1e3, "checksum": checksum}
            print(f"  [{s}x{v}] {impl:3s} {name:36s} {(gross - base) * 1e3:8.3f} ms", flush=True)
        out["impls"][impl] = rows
    return out


def print_table(report: dict) -> None:
    print()
    print(
        f"sample() device time per step, jax {report['jax']} on {report['device']} "
        f"(default impl: {report['default_impl']}); {report['note']}"
    )
    for shape in report["shapes"]:
        impls = list(shape["impls"])
        nuc = ", ".join(f"{k} {n:.0f}" for k, n in shape["nucleus_T0.8_p0.9"].items())
        print(
            f"\n[{shape['slots']} x {shape['vocab']}]  {shape['iters']} steps per call; baseline "
            f"{shape['baseline_ms']:.3f} ms/step subtracted; top_p=0.9 nucleus at T=0.8: {nuc} tokens"
        )
        both = len(impls) > 1
        head = "".join(f"{impl + ' ms':>12s}" for impl in impls)
        print(f"  {'case':38s}{head}" + ("   same tokens" if both else ""))
        for name in shape["impls"][impls[0]]["cases"]:
            row = [shape["impls"][i]["cases"][name] for i in impls]
            cells = "".join(f"{r['ms']:12.3f}" for r in row)
            same = ("   yes" if len({r["checksum"] for r in row}) == 1 else "   NO") if both else ""
            print(f"  {name:38s}{cells}{same}")
        print(f"  {'(compile, s)':38s}" + "".join(f"{shape['impls'][i]['compile_s']:12.1f}" for i in impls))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="64x128256,32x49152", help="comma-separated SxV")
    ap.add_argument("--impl", default="auto", choices=["auto", "cpu", "tpu", "both"])
    ap.add_argument("--iters", type=int, default=None, help="steps per call (default: 50; 5 on CPU)")
    ap.add_argument("--repeats", type=int, default=3, help="calls per case; the fastest counts")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args()
    on_cpu = jax.default_backend() == "cpu"
    iters = args.iters or (5 if on_cpu else 50)
    impls = {"auto": [sampler_impl()], "both": ["cpu", "tpu"]}.get(args.impl, [args.impl])
    t0 = time.perf_counter()
    report = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "default_impl": sampler_impl(),
        "note": "lower is better",
        "shapes": [],
    }
    for spec in args.shapes.split(","):
        s, v = (int(n) for n in spec.lower().split("x"))
        report["shapes"].append(bench_shape(s, v, impls, iters, args.repeats))
    report["total_s"] = time.perf_counter() - t0
    print_table(report)
    print(f"\ntotal {report['total_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
