"""n-gram speculative decoding on vEngine, at the engine level: tokens/s with verify steps vs plain decode.

    python benchmarks/speculative.py                         # default model, 8 rows, K=4, 128 tokens
    python benchmarks/speculative.py --rows 8 --k 4 --tokens 96 --json

Two workloads on the same engine, greedy, every row live from the start:
  repetitive  each row is asked to repeat a passage of its prompt (the output quotes its context)
  random      prompts of random words (little for prompt lookup to find)
For each: `plain` runs `vEngine.decode` steps; `ngram` proposes up to K tokens per row from the row's own
tokens (engines/dense/speculative.py, on the host, between steps) and runs one `SpeculativeVerifier.step` (K+1
tokens per row in one call); a step where no row has a draft runs the plain decode step instead. Reported:
generated tokens/s, speed-up, acceptance rate (accepted / proposed draft tokens), and whether the ngram
tokens equal the plain ones (greedy: they must, up to float ties).

This is the engine and the proposer alone, not the driver: vDriver does not run verify steps yet.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

import numpy as np

PASSAGE = (
    "The river rises in the northern hills and flows south through farmland for two hundred miles. "
    "Three towns stand on its banks, each with a stone bridge built in the last century. In spring the "
    "water is high and fast; in late summer it is slow, shallow and clear enough to see the bottom."
)
WORDS = [
    "apple",
    "stone",
    "river",
    "cloud",
    "music",
    "table",
    "window",
    "garden",
    "paper",
    "light",
    "road",
    "storm",
    "field",
    "glass",
]


def prompts(tok: Any, kind: str, rows: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        if kind == "repetitive":
            sentences = PASSAGE.split(". ")
            rng.shuffle(sentences)
            text = ". ".join(sentences)
            msg = f"Repeat the following text exactly, word for word.\n\n{text}"
        else:
            msg = " ".join(rng.choice(WORDS) for _ in range(60 + i))
        text = tok.apply_chat_template(
            [{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True
        )
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


def run(eng: Any, spec: Any, ps: list[list[int]], tokens: int, k: int, use_spec: bool) -> dict[str, Any]:
    from vsurge.contracts.sampling_params import SamplingParams
    from vsurge.engines.dense.speculative import propose_ngram_batch

    sp = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    state = eng.init_decode_state()
    seqs = []
    for slot, p in enumerate(ps):
        state, first = eng.insert(eng.prefill(p, sp), state, slot)
        seqs.append(list(p) + [int(first.tokens[0])])
    gen = [1] * len(ps)
    proposed = accepted = steps = 0
    t0 = time.perf_counter()
    while min(gen) < tokens:
        drafts = num = None
        if use_spec:
            drafts, num = propose_ngram_batch(seqs, k)
        if use_spec and num.any():
            state, res = spec.step(state, drafts, num)
            toks, acc = np.asarray(res.tokens), np.asarray(res.num_accepted)
            for i in range(len(ps)):
                seqs[i] += toks[i, : acc[i] + 1].tolist()
                gen[i] += int(acc[i]) + 1
            proposed += int(num.sum())
            accepted += int(acc.sum())
        else:
            state, out = eng.decode(state)
            toks = np.asarray(out.tokens)
            for i in range(len(ps)):
                seqs[i].append(int(toks[i]))
                gen[i] += 1
        steps += 1
    wall = time.perf_counter() - t0
    for slot in range(len(ps)):
        eng.free_resource(slot)
    total = sum(gen) - len(ps)  # the first tokens came from prefill
    return {
        "tok_s": total / wall,
        "steps": steps,
        "acceptance_rate": accepted / proposed if proposed else None,
        "outputs": [s[len(p) : len(p) + tokens] for s, p in zip(seqs, ps, strict=True)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import vsurge
    from vsurge.engines.dense.spec_verify import SpeculativeVerifier
    from vsurge.seed_api.engines import vEngine

    model, tok = vsurge.load_model(args.model)
    eng = vEngine(
        model, tok, max_concurrent_decodes=args.rows, max_length=args.max_length, prefill_lengths=[256]
    )
    spec = SpeculativeVerifier(eng, args.k)
    report: dict[str, Any] = {"rows": args.rows, "k": args.k, "tokens": args.tokens}
    for kind in ("repetitive", "random"):
        ps = prompts(tok, kind, args.rows)
        run(eng, spec, ps, 8, args.k, True)  # compiles (and warms) both programs
        run(eng, spec, ps, 8, args.k, False)
        plain = run(eng, spec, ps, args.tokens, args.k, False)
        ngram = run(eng, spec, ps, args.tokens, args.k, True)
        same = sum(a == b for a, b in zip(plain["outputs"], ngram["outputs"], strict=True))
        report[kind] = {
            "plain_tok_s": plain["tok_s"],
            "ngram_tok_s": ngram["tok_s"],
            "speedup": ngram["tok_s"] / plain["tok_s"],
            "acceptance_rate": ngram["acceptance_rate"],
            "plain_steps": plain["steps"],
            "ngram_steps": ngram["steps"],
            "rows_identical": f"{same}/{args.rows}",
        }
        print(f"# {kind}: {json.dumps(report[kind])}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"rows {args.rows}, K {args.k}, {args.tokens} tokens per row, greedy")
    print("| workload | plain tok/s | ngram tok/s | speed-up | acceptance | steps plain/ngram | identical |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("repetitive", "random"):
        r = report[kind]
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(
            f"| {kind} | {r['plain_tok_s']:.1f} | {r['ngram_tok_s']:.1f} | {r['speedup']:.2f}x | {acc} | "
            f"{r['plain_steps']}/{r['ngram_steps']} | {r['rows_identical']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
