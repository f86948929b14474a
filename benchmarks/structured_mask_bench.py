"""Grammar engines side by side: per-step token-mask time on the default model's tokenizer.

    .venv/bin/python benchmarks/structured_mask_bench.py [--engines llguidance,xgrammar]

For a JSON schema and a regex, each engine walks the tokens of a valid answer (tokenized the way the model
would produce it) and times, at every step, the fill of one packed bitmask row (int32[ceil(V/32)]) and the
token's acceptance. Prints compile time and p50 / p99 / max of the mask fill in microseconds. The tokenizer is
SmolLM2-135M-Instruct's (49152 ids), built from the cached GGUF the way vsurge.models does, no hub.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from vsurge.models.default_model import default_model_path
from vsurge.models.gguf import load_gguf_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["person", "robot", "other"]},
    },
    "required": ["name", "age", "email", "tags", "address", "kind"],
    "additionalProperties": False,
}
JSON_TEXT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "email": "ada@example.org",
        "tags": ["math", "poetry", "engines"],
        "address": {"city": "London", "zip": "12345"},
        "kind": "person",
    }
)
REGEX = r"(\+1 )?\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
REGEX_TEXT = "+1 (555) 123-4567 ext. 89"


def _pct(xs: list[float]) -> str:
    a = np.asarray(xs) * 1e6
    return f"p50 {np.percentile(a, 50):7.1f} us  p99 {np.percentile(a, 99):7.1f} us  max {a.max():7.1f} us"


def bench_llguidance(tok, vocab: int, eos: int, reps: int) -> None:
    import llguidance

    t = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
    print(f"llguidance {llguidance.__name__}: tokenizer {time.perf_counter() - t:.2f}s")
    for label, grammar, text in (
        ("json_schema", llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), JSON_TEXT),
        ("regex", llguidance.LLMatcher.grammar_from_regex(REGEX), REGEX_TEXT),
    ):
        ids = tok.encode(text, add_special_tokens=False) + [eos]
        mask = np.full((1, (vocab + 31) // 32), -1, np.int32)
        times: list[float] = []
        compile_s = []
        for _ in range(reps):
            t = time.perf_counter()
            m = llguidance.LLMatcher(lltok, grammar, log_level=0)
            compile_s.append(time.perf_counter() - t)
            assert not m.is_error(), m.get_error()
            for tid in ids:
                t = time.perf_counter()
                m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
                times.append(time.perf_counter() - t)
                assert (mask[0, tid // 32] >> (tid % 32)) & 1, f"{label}: token {tid} masked out"
                assert m.consume_token(tid), m.get_error()
            assert m.is_stopped() or m.is_accepting()
        print(
            f"  {label:12s} compile {np.median(compile_s) * 1e3:6.1f} ms   mask {_pct(times)}  ({len(times)} steps)"
        )


def bench_xgrammar(tok, vocab: int, eos: int, reps: int) -> None:
    t = time.perf_counter()
    import xgrammar as xgr

    imp = time.perf_counter() - t
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    print(f"xgrammar: import {imp:.1f}s (imports torch), tokenizer {time.perf_counter() - t:.2f}s")
    for label, make, text in (
        ("json_schema", lambda: compiler.compile_json_schema(json.dumps(SCHEMA)), JSON_TEXT),
        ("regex", lambda: compiler.compile_regex(REGEX), REGEX_TEXT),
    ):
        ids = tok.encode(text, add_special_tokens=False) + [eos]
        mask = np.full((1, (vocab + 31) // 32), -1, np.int32)
        import torch

        tmask = torch.from_numpy(mask)
        times: list[float] = []
        compile_s = []
        for _ in range(reps):
            t = time.perf_counter()
            compiled = make()
            compile_s.append(time.perf_counter() - t)
            m = xgr.GrammarMatcher(compiled)
            for tid in ids:
                t = time.perf_counter()
                m.fill_next_token_bitmask(tmask, 0)
                times.append(time.perf_counter() - t)
                assert (mask[0, tid // 32] >> (tid % 32)) & 1, f"{label}: token {tid} masked out"
                assert m.accept_token(tid)
            assert m.is_terminated()
        print(
            f"  {label:12s} compile {np.median(compile_s) * 1e3:6.1f} ms   mask {_pct(times)}  ({len(times)} steps)"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    tok = load_gguf_tokenizer(default_model_path())
    vocab = len(tok)
    eos = int(tok.eos_token_id)
    print(f"tokenizer: {vocab} ids, eos {eos}")
    for name in args.engines.split(","):
        try:
            __import__(name)
        except ImportError:  # xgrammar is not a dependency: compared where someone installed it
            print(f"{name}: not installed, skipped")
            continue
        {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}[name](tok, vocab, eos, args.reps)


if __name__ == "__main__":
    main()
