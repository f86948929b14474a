"""Host work per generated token, and whether the host keeps up with the device at many slots.

    python benchmarks/host_overhead.py                  # micro-benchmarks + the 256-slot run
    python benchmarks/host_overhead.py --skip-e2e       # micro-benchmarks only (seconds)
    python benchmarks/host_overhead.py --slots 256 --tokens 64 --json

Micro-benchmarks, per token, with the real classes and the default model's tokenizer (SmolLM2, 49152 ids):
  detokenize     IncrementalDetokenizer.add (drivers/detokenize.py)
  stop strings   StopStringMatcher.feed with 4 stop strings, on the detokenized pieces
  add_token      ActiveRequest.add_token (detokenize + stop strings + bookkeeping; drivers/active_request.py)
  take_deltas    ActiveRequest.take_deltas (one ReturnSample per step per request)
  channel        ReturnChannel.put to an asyncio loop (call_soon_threadsafe), per request per step
  sse            the server's ChunkWriter.frames (server/shaping.py), one completions chunk per token
  pipeline       Pipeline._take + _flush for one row of a step (what the detokenize thread does per row)

The 256-slot run: a tiny random llama (2 layers, hidden 64, the SmolLM2 vocabulary, so the sampler and the
detokenizer see real sizes) in vDriver with --slots decode slots, every slot streaming through
`vSurge.complete` on one asyncio loop, each chunk framed as the server frames it. Reported:
  device step      one decode step of the engine on a full batch, alone in a loop (block_until_ready);
                   wall time, and CPU time of all threads (comparable with the host figures under load)
  host per step    the detokenize thread's work for one step of --slots rows (pipeline figure x slots),
                   plus the consumer's framing of --slots chunks (sse x slots)
  driver step      wall time per step while serving (tokens/s of the run / slots)
The host keeps up when host per step (it runs beside the device step, on other threads) stays below the
device step, and the driver step stays close to the device step. The host figures are CPU time of the
thread doing the work (time.thread_time), so a loaded machine does not inflate them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from typing import Any

import numpy as np

STOPS = ["\n\nUser:", "###", "</answer>", "<|im_end|>"]


def _sentence_ids(tok: Any, n: int, seed: int = 0) -> list[int]:
    """n token ids of plausible English (byte-level BPE pieces with spaces, punctuation, newlines)."""
    sentence = (
        "the model serves tokens to many clients at once and the host must keep up with the device while "
        'it streams text, numbers 1234 and punctuation: commas, dots. New lines\nand quotes "like this" '
        "appear; émigré café naïve 東京 🙂"
    )
    words = sentence.split(" ")
    rng = random.Random(seed)
    text = " ".join(rng.choice(words) for _ in range(n * 2))
    return tok(text, add_special_tokens=False)["input_ids"][:n]


# CPU time of this thread, not wall time: the figures are the work itself, not how long a shared,
# loaded machine took to schedule it (a wall clock under load 8 on 2 cores reads ~4x higher).
_clock = time.thread_time


def _per_token(fn, n: int, repeat: int = 3) -> float:
    """Best of `repeat` runs of fn(n) (which processes n tokens); CPU seconds per token."""
    best = float("inf")
    for _ in range(repeat):
        t = _clock()
        fn(n)
        best = min(best, (_clock() - t) / n)
    return best


def micro(tok: Any, n: int = 2000) -> dict[str, float]:
    """Seconds per token of each host stage (see the module docstring)."""
    from vsurge.contracts.sampling_params import SamplingParams
    from vsurge.drivers.active_request import ActiveRequest, ReturnChannel
    from vsurge.drivers.detokenize import IncrementalDetokenizer, StopStringMatcher
    from vsurge.drivers.pipeline import Pipeline
    from vsurge.server.shaping import ChunkWriter, TokenDecoder

    prompt = _sentence_ids(tok, 200, seed=1)
    ids = _sentence_ids(tok, n, seed=2)
    out: dict[str, float] = {}

    def detok(k):
        d = IncrementalDetokenizer(tok, prompt)
        for t in ids[:k]:
            d.add(t)

    out["detokenize"] = _per_token(detok, n)

    d = IncrementalDetokenizer(tok, prompt)
    pieces = [d.add(t) for t in ids]

    def stops(k):
        m = StopStringMatcher(STOPS)
        for p in pieces[:k]:
            m.feed(p)

    out["stop_strings"] = _per_token(stops, n)

    top = np.zeros(0, np.int32), np.zeros(0, np.float32)
    params = SamplingParams(max_tokens=n + 1, ignore_eos=True, stop=STOPS)

    def add(k):
        r = ActiveRequest(prompt, params, processor=tok)
        for t in ids[:k]:
            r.add_token(0, t, -1.0, *top, max_length=10**6)

    out["add_token"] = _per_token(add, n)

    def deltas(k):
        r = ActiveRequest(prompt, params, processor=tok)
        spent = 0.0
        for t in ids[:k]:
            r.add_token(0, t, -1.0, *top, max_length=10**6)
            t0 = _clock()
            r.take_deltas()
            spent += _clock() - t0
        return spent

    out["take_deltas"] = min(deltas(n) for _ in range(3)) / n

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        ch = ReturnChannel(loop)
        out["channel"] = _per_token(lambda k: [ch.put([]) for _ in range(k)], n)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join()
        loop.close()

    r = ActiveRequest(prompt, params, processor=tok)
    samples = []
    for t in ids:
        r.add_token(0, t, -1.0, *top, max_length=10**6)
        samples.append(r.take_deltas())
    decode = TokenDecoder(tok)

    def sse(k):
        w = ChunkWriter(
            operation="completions",
            response_id="cmpl-x",
            created=0,
            model="m",
            decode=decode,
            with_logprobs=False,
            with_top=False,
            include_usage=True,
        )
        for s in samples[:k]:
            w.frames(s)

    out["sse"] = _per_token(sse, n)

    class Owner:  # what a lane row holds: the request, the sample index, cached prompt tokens
        def __init__(self, req):
            self.req, self.index, self.cached_tokens = req, 0, 0

    pipe = Pipeline(max_queue_size=8, detokenizing_blocks=8)
    lane = pipe.new_lane(8)
    host = [np.asarray(ids, np.int32), np.zeros(n, np.float32), np.zeros((n, 0), np.int32), np.zeros((n, 0))]

    def pipeline_rows(k):
        # k requests, one row each: the detokenize thread's per-row work for a step of k rows
        reqs = [ActiveRequest(prompt, params, processor=tok) for _ in range(k)]
        owners = [Owner(q) for q in reqs]
        t0 = _clock()
        for row, o in enumerate(owners):
            pipe._take(lane, o, int(host[0][row]), host[1][row], host[2][row], host[3][row], 10**6)
        pipe._flush(reqs)
        return _clock() - t0

    # request construction (prompt detokenization) is not per step: time only the rows
    out["pipeline_row"] = min(pipeline_rows(n) for _ in range(3)) / n
    return out


# --------------------------------------------------------------------------------------- 256 slots


def tiny_random_model(vocab: int, layers: int = 2, hidden: int = 64) -> Any:
    """A random llama built with our own model code (no checkpoint, no torch)."""
    import jax.numpy as jnp
    from flax import nnx

    from vsurge.models.config import ModelConfig
    from vsurge.models.registry import architecture_for

    hf = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    cfg = ModelConfig.from_hf(hf)
    return architecture_for("llama").model_cls(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))


def device_step(engine: Any, slots: int, steps: int = 20) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every thread) per decode step of `engine` with every slot live,
    alone in a loop. The CPU figure compares with the host figures whatever else loads the machine."""
    from vsurge.contracts.sampling_params import SamplingParams

    state = engine.init_decode_state()
    prefix = engine.prefill([1] * 16, SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True))
    for slot in range(slots):
        state, _ = engine.insert(prefix, state, slot)
    state, out = engine.decode(state)
    out.tokens.block_until_ready()
    best = cpu = float("inf")
    for _ in range(2):
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            state, out = engine.decode(state)
        out.tokens.block_until_ready()
        best = min(best, (time.perf_counter() - t) / steps)
        cpu = min(cpu, (time.process_time() - c) / steps)
    return best, cpu


def serve_run(surge: Any, tok: Any, slots: int, tokens: int) -> dict[str, float]:
    """Every slot streams `tokens` tokens through vSurge.complete; chunks framed as the server does."""
    from vsurge.seed_api.request import vSurgeRequest
    from vsurge.server.shaping import ChunkWriter, TokenDecoder

    decode = TokenDecoder(tok)
    prompts = [_sentence_ids(tok, 16, seed=100 + i) for i in range(slots)]
    counts = [0] * slots

    async def one(i: int) -> None:
        w = ChunkWriter(
            operation="completions",
            response_id=f"cmpl-{i}",
            created=0,
            model="m",
            decode=decode,
            with_logprobs=False,
            with_top=False,
            include_usage=True,
        )
        req = vSurgeRequest(
            prompt=prompts[i],
            max_tokens=tokens,
            temperature=0.0,
            ignore_eos=True,
            stop=STOPS,
            is_client_side_tokenization=True,
        )
        async for samples in surge.complete(req):
            w.frames(samples)
            counts[i] += sum(len(s.token_ids) for s in samples)

    async def run() -> None:
        await asyncio.gather(*(one(i) for i in range(slots)))

    t = time.perf_counter()
    asyncio.run(run())
    wall = time.perf_counter() - t
    return {"wall_s": wall, "tokens": sum(counts), "tok_s": sum(counts) / wall}


def e2e(slots: int, tokens: int, tok: Any, figures: dict[str, float]) -> dict[str, Any]:
    from vsurge import vSurge

    model = tiny_random_model(len(tok))
    surge = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=slots, prefill_lengths=[32], max_length=32 + tokens + 8
    )
    t = time.perf_counter()
    surge.compile()
    compile_s = time.perf_counter() - t
    engine = surge.driver.engines[0]
    step, step_cpu = device_step(engine, slots)
    surge.start()
    try:
        serve_run(surge, tok, slots, 8)  # warm the serving path
        run = serve_run(surge, tok, slots, tokens)
    finally:
        surge.stop()
    host_detok = figures["pipeline_row"] * slots
    host_sse = figures["sse"] * slots
    return {
        "slots": slots,
        "compile_s": compile_s,
        "device_step_s": step,
        "device_step_cpu_s": step_cpu,
        "host_detokenize_thread_per_step_s": host_detok,
        "host_sse_per_step_s": host_sse,
        "host_per_step_s": host_detok + host_sse,
        "driver_step_s": slots / run["tok_s"],
        "serve_tok_s": run["tok_s"],
        "device_tok_s": slots / step,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64, help="tokens per request in the slot run")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from vsurge.models.default_model import default_model_path
    from vsurge.models.gguf import load_gguf_tokenizer

    tok = load_gguf_tokenizer(default_model_path())
    figures = micro(tok)
    report: dict[str, Any] = {"per_token_us": {k: v * 1e6 for k, v in figures.items()}}
    if not args.skip_e2e:
        report["slots_run"] = e2e(args.slots, args.tokens, tok, figures)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"host work per token (µs), machine load {os.getloadavg()[0]:.1f}:")
    for k, v in report["per_token_us"].items():
        print(f"  {k:14s} {v:8.1f}")
    if "slots_run" in report:
        r = report["slots_run"]
        print(f"{r['slots']} slots, tiny random llama (SmolLM2 vocabulary):")
        print(
            f"  device step                 {r['device_step_s'] * 1e3:8.1f} ms  ({r['device_tok_s']:.0f} tok/s)"
        )
        print(f"  device step, CPU (all threads) {r['device_step_cpu_s'] * 1e3:5.1f} ms")
        print(f"  host per step: detok thread {r['host_detokenize_thread_per_step_s'] * 1e3:8.1f} ms")
        print(f"  host per step: SSE framing  {r['host_sse_per_step_s'] * 1e3:8.1f} ms")
        print(
            f"  driver step while serving   {r['driver_step_s'] * 1e3:8.1f} ms  ({r['serve_tok_s']:.0f} tok/s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
