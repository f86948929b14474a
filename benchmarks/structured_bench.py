"""Structured output's cost on a shared batch: output tok/s of C concurrent requests with 0%, 50% and 100%
JSON-schema-constrained, side by side in one process, and the host's mask time per slot and step.

    .venv/bin/python benchmarks/structured_bench.py [--concurrency 32] [--max-tokens 64] [--rounds 1] [--model M]

The default model (SmolLM2-135M-Instruct) on the vdriver; unconstrained requests ignore EOS so that every
request writes about max_tokens tokens; the schema's bounded fields make the constrained ones about as long.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import vsurge
from vsurge import vSurge
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.structured import GrammarCompiler, GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 20, "maxLength": 60},
        "summary": {"type": "string", "minLength": 60, "maxLength": 160},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
    },
    "required": ["title", "summary", "year", "tags"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a film about {} as JSON.",
    "Write a short record about {}.",
    "Tell me about {} in one paragraph.",
    "Summarize the history of {}.",
]
TOPICS = ["the sea", "a robot", "Paris", "mountains", "a cat", "the moon", "trains", "music"]


async def one_round(
    surge, tok, grammar, c: int, frac: float, max_tokens: int, seed0: int
) -> tuple[float, int]:
    k = int(round(c * frac))
    reqs = []
    for i in range(c):
        text = PROMPTS[i % len(PROMPTS)].format(TOPICS[i % len(TOPICS)])
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        if i < k:
            sp = SamplingParams(temperature=0.8, seed=seed0 + i, max_tokens=max_tokens, grammar=grammar)
        else:
            sp = SamplingParams(temperature=0.8, seed=seed0 + i, max_tokens=max_tokens, ignore_eos=True)
        reqs.append(surge.generate([prompt], sp))
    t = time.perf_counter()
    outs = await asyncio.gather(*reqs)
    wall = time.perf_counter() - t
    tokens = sum(o[0].num_generated_tokens for o in outs)
    return wall, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    model, tok = vsurge.load_model(args.model)
    surge = vSurge.create_vdriver(
        model, tok, max_concurrent_decodes=args.concurrency, max_length=512, prefill_lengths=[64, 128, 256]
    )
    t = time.perf_counter()
    surge.compile()
    print(f"compiled in {time.perf_counter() - t:.0f}s")
    surge.start()
    comp = GrammarCompiler(tok, surge.vocab_size, surge.eos_token_ids)
    grammar = comp.compile(GrammarSpec.json_schema(SCHEMA))
    c = args.concurrency
    # warm-up: the structured programs compile on first use; one short round of each kind
    asyncio.run(one_round(surge, tok, grammar, 4, 0.5, 8, 0))
    results: dict[float, list[float]] = {0.0: [], 0.5: [], 1.0: []}
    for r in range(args.rounds):
        for frac in results:  # interleaved, so drift on a shared machine hits every mix alike
            wall, tokens = asyncio.run(one_round(surge, tok, grammar, c, frac, args.max_tokens, 1000 * r))
            results[frac].append(tokens / wall)
            print(
                f"round {r} constrained {frac:4.0%}: {tokens} tokens in {wall:.1f}s = {tokens / wall:.1f} tok/s"
            )
    base = float(np.median(results[0.0]))
    for frac, xs in results.items():
        m = float(np.median(xs))
        print(f"constrained {frac:4.0%}: {m:7.1f} tok/s  ({m / base:.2f}x of unconstrained)")
    fills = []
    for slots in surge.driver._slots:
        fills += list(slots.grammars.fill_seconds)
    a = np.asarray(fills) * 1e6
    print(
        f"mask fill per slot and step: p50 {np.percentile(a, 50):.0f} us, p99 {np.percentile(a, 99):.0f} us, n={a.size}"
    )
    surge.stop()


if __name__ == "__main__":
    main()
