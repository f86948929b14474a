"""The paged driver's numbers (issue 5), each against its baseline in the same process.

    python benchmarks/paged.py concurrency   # same KV memory, mixed workload: sequences held at once
    python benchmarks/paged.py prefix        # shared 1,000-token system prompt: TTFT with / without caching
    python benchmarks/paged.py throughput    # 32 concurrent requests: odriver vs vdriver tokens/s
    python benchmarks/paged.py all --json paged.json

concurrency  A vEngine with --dense-slots rows of max_length 2048 and an oEngine given exactly the same KV
             bytes (and 64 slots) serve the same mixed workload (most requests short, some long). For
             --window seconds after the first token, the number of sequences decoding at once is sampled
             every 10 ms; the rest is cancelled.
prefix       One oEngine; requests made of the same 1,000-token system prompt and a short distinct
             question, one at a time. TTFT of requests 2.. with prefix caching, then with it switched off
             (cache dropped), against the first (cold) request.
throughput   vDriver and oDriver, same slots, same KV bytes, --batch requests submitted together
             (prompt 32, output 128 tokens, greedy), alternating rounds; output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import numpy as np

BYTES = None  # bytes of KV per token, set once the model is loaded


def load(src: str):
    import vsurge

    if src == "default":
        from vsurge.models.default_model import default_model_path

        src = str(default_model_path())
    model, tok = vsurge.load_model(src)
    global BYTES
    c = model.config
    BYTES = 2 * c.num_layers * c.num_kv_heads * c.head_dim * np.dtype(np.float32).itemsize
    return model, tok


def build(model, tok, driver: str, **kw):
    from vsurge import vSurge

    t = time.perf_counter()
    s = (
        vSurge.create_odriver(model, tok, **kw)
        if driver == "odriver"
        else vSurge.create_vdriver(model, tok, **kw)
    )
    s.compile()
    print(f"# {driver} compiled in {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
    s.start()
    return s


def request(prompt, max_tokens):
    from vsurge.seed_api.request import vSurgeRequest

    return vSurgeRequest(
        prompt=[int(x) for x in prompt],
        max_tokens=int(max_tokens),
        temperature=0.0,
        ignore_eos=True,
        is_client_side_tokenization=True,
    )


def drain(active) -> tuple[int, float | None]:
    n, ttft = 0, None
    for items in active.channel:
        for s in items:
            n += len(s.token_ids)
            if ttft is None and s.time_to_first_token is not None:
                ttft = s.time_to_first_token
    return n, ttft


# ---------------------------------------------------------------------------------------- concurrency


def mixed_workload(rng, n: int, vocab: int):
    """80% short (prompt 16-128, output 16-96), 20% long (prompt 512-1536, output 64-256)."""
    out = []
    for _ in range(n):
        if rng.rand() < 0.8:
            p, o = rng.randint(16, 129), rng.randint(16, 97)
        else:
            p, o = rng.randint(512, 1537), rng.randint(64, 257)
        out.append((list(rng.randint(100, vocab, size=p)), o))
    return out


def decoding_now(s) -> int:
    d = s.driver
    if hasattr(d, "scheduler"):
        return sum(1 for q in list(d.scheduler.slots) if q is not None and q.decoding)
    return d.num_used_slots


def hold(s, work, window: float) -> dict:
    reqs = [s.submit(request(p, o)) for p, o in work]
    samples, t0, first = [], time.perf_counter(), None
    while time.perf_counter() - t0 < window + 600:
        n = decoding_now(s)
        if first is None and n:
            first = time.perf_counter()
        if first is not None:
            samples.append(n)
            if time.perf_counter() - first > window:
                break
        time.sleep(0.01)
    m = s.metrics()
    for r in reqs:
        r.cancel()
    for r in reqs:
        drain(r)
    return {
        "mean": statistics.fmean(samples),
        "max": max(samples),
        "preemptions": m.preemptions_total,
        "pages_total": m.pages_total,
        "tokens": m.generation_tokens_total,
    }


def concurrency(model, tok, args) -> dict:
    max_length, dense_slots = 2048, args.dense_slots
    kv_bytes = dense_slots * max_length * BYTES
    work = mixed_workload(np.random.RandomState(0), args.requests, model.config.vocab_size)
    out = {"kv_bytes": kv_bytes, "max_length": max_length, "requests": len(work), "window_s": args.window}
    # the dense engine prefills a prompt in one piece: it needs a bucket for the longest
    s = build(
        model,
        tok,
        "vdriver",
        max_concurrent_decodes=dense_slots,
        prefill_lengths=[64, 256, 512, 2048],
        max_length=max_length,
    )
    out["vdriver"] = hold(s, work, args.window)
    s.stop()
    del s
    s = build(
        model,
        tok,
        "odriver",
        max_concurrent_decodes=64,
        page_size=args.page_size,
        kv_cache_bytes=kv_bytes,
        prefill_lengths=[64, 256, 512],
        max_length=max_length,
    )
    out["odriver"] = hold(s, work, args.window)
    s.stop()
    out["ratio"] = out["odriver"]["mean"] / out["vdriver"]["mean"]
    print(
        f"same KV bytes ({kv_bytes / 2**20:.0f} MiB = {dense_slots} x {max_length} tokens), mixed workload:"
    )
    for d in ("vdriver", "odriver"):
        r = out[d]
        print(
            f"  {d}: {r['mean']:.1f} sequences decoding on average, {r['max']} at most "
            f"(preemptions {r['preemptions']})"
        )
    print(f"  ratio {out['ratio']:.1f}x")
    return out


# ---------------------------------------------------------------------------------------- prefix


def prefix(model, tok, args) -> dict:
    rng = np.random.RandomState(1)
    vocab = model.config.vocab_size
    system = list(rng.randint(100, vocab, size=1000))
    questions = [
        list(rng.randint(100, vocab, size=rng.randint(20, 41))) for _ in range(2 * args.prefix_requests)
    ]
    s = build(
        model,
        tok,
        "odriver",
        max_concurrent_decodes=8,
        page_size=args.page_size,
        max_length=2048,
        prefill_lengths=[32, 64, 128, 256, 512],
        kv_cache_bytes=64 * 2048 * BYTES // 8,
    )
    mgr = s.driver.engine.manager

    def ttfts(qs):
        return [drain(s.submit(request(system + q, 8)))[1] for q in qs]

    drain(s.submit(request(list(rng.randint(100, vocab, size=600)), 4)))  # warm the threads and host paths
    with_cache = ttfts(questions[: args.prefix_requests])
    hits = mgr.hits
    mgr.prefix_caching = False  # benchmark-only switch: nothing is published or reused from here on
    mgr.drop_cache()
    without = ttfts(questions[args.prefix_requests :])
    s.stop()
    out = {
        "page_size": args.page_size,
        "cold_ttft_s": with_cache[0],
        "cached_ttft_s": statistics.fmean(with_cache[1:]),
        "uncached_ttft_s": statistics.fmean(without[1:]),
        "hits": hits,
    }
    out["speedup"] = out["uncached_ttft_s"] / out["cached_ttft_s"]
    print(
        f"1,000-token shared system prompt, page size {args.page_size}: first request {out['cold_ttft_s']:.3f}s; "
        f"later requests {out['cached_ttft_s']:.3f}s with prefix caching vs {out['uncached_ttft_s']:.3f}s "
        f"without: {out['speedup']:.1f}x"
    )
    return out


# ---------------------------------------------------------------------------------------- throughput


def run_batch(s, prompts, outputs) -> float:
    t0 = time.perf_counter()
    reqs = [s.submit(request(p, o)) for p, o in zip(prompts, outputs, strict=True)]
    counts = [0] * len(reqs)

    def one(i):
        counts[i] = drain(reqs[i])[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def throughput(model, tok, args) -> dict:
    # --smoke: the same path at a size that compiles quickly (tests)
    b, max_length = args.batch, 128 if args.smoke else 1024
    lengths = [32, 64] if args.smoke else [32, 64, 128, 256, 512]
    common = dict(max_concurrent_decodes=b, prefill_lengths=lengths, max_length=max_length)
    kv_bytes = b * max_length * BYTES  # what the dense engine holds
    surges = {
        "vdriver": build(model, tok, "vdriver", **common),
        "odriver": build(model, tok, "odriver", page_size=args.page_size, kv_cache_bytes=kv_bytes, **common),
    }
    rng = np.random.RandomState(2)
    prompts = [list(rng.randint(100, model.config.vocab_size, size=32)) for _ in range(b)]
    outputs = [16 if args.smoke else 128] * b
    rates: dict[str, list[float]] = {d: [] for d in surges}
    for s in surges.values():  # warm-up round, not counted
        run_batch(s, prompts[:4], [8] * len(prompts[:4]))
    for _ in range(args.rounds):
        for d, s in surges.items():
            rates[d].append(run_batch(s, prompts, outputs))
            print(f"  {d}: {rates[d][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    for s in surges.values():
        s.stop()
    out = {d: {"tok_s": statistics.fmean(r), "rounds": r} for d, r in rates.items()}
    out["ratio"] = out["odriver"]["tok_s"] / out["vdriver"]["tok_s"]
    print(
        f"{b} concurrent (prompt 32, output {outputs[0]}): vdriver {out['vdriver']['tok_s']:.1f} tok/s, "
        f"odriver {out['odriver']['tok_s']:.1f} tok/s (page size {args.page_size}): ratio {out['ratio']:.2f}"
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["concurrency", "prefix", "throughput", "all"])
    ap.add_argument("--model", default="default")
    ap.add_argument(
        "--page-size", type=int, default=None, help="default: 16 (concurrency, prefix), 64 (throughput)"
    )
    ap.add_argument("--dense-slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--prefix-requests", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="throughput: 128 positions, 16 tokens out (tests)")
    args = ap.parse_args(argv)
    model, tok = load(args.model)
    results = {"model": args.model}
    page_size = args.page_size
    for name, fn, ps in (
        ("concurrency", concurrency, 16),
        ("prefix", prefix, 16),
        ("throughput", throughput, 64),
    ):
        if args.what in (name, "all"):
            args.page_size = page_size or ps
            results[name] = fn(model, tok, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
