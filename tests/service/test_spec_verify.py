"""The verify step of n-gram speculative decoding on vEngine (engines/dense/spec_verify.py), on a tiny random
llama: K+1 tokens per row in one call give exactly the tokens of plain greedy decoding, rows without a
draft (here: top_k sampling) decode exactly as in an ordinary step, and the drafts do get accepted."""

from __future__ import annotations

import numpy as np
import pytest

import vsurge
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.engines.dense.spec_verify import SpeculativeVerifier, plain_sampling
from vsurge.engines.dense.speculative import propose_ngram_batch
from vsurge.seed_api.engines import vEngine

SLOTS, K, OUT = 4, 3, 40
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],
    [10, 11, 12, 10, 11, 12, 10, 11],
    [20, 21, 22, 23, 24, 25],
    [30, 31, 30, 31, 30],
]
GREEDY = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
TOPK = SamplingParams(max_tokens=200, temperature=1.0, top_k=5, seed=3, ignore_eos=True)
PARAMS = [GREEDY, GREEDY, GREEDY, TOPK]


def start(eng: vEngine):
    state = eng.init_decode_state()
    seqs = []
    for slot, (p, sp) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        state, first = eng.insert(eng.prefill(p, sp), state, slot)
        seqs.append(list(p) + [int(first.tokens[0])])
    return state, seqs


@pytest.mark.slow  # two decode programs and a verify program to compile: ~1-2 min on 2 loaded cores
def test_verify_steps_decode_exactly_like_plain_decoding(tiny_checkpoint):
    directory, _ = tiny_checkpoint("llama")
    model, tok = vsurge.load_model(directory)
    eng = vEngine(model, tok, max_concurrent_decodes=SLOTS, max_length=128, prefill_lengths=[32])

    state, plain = start(eng)
    for _ in range(OUT):
        state, out = eng.decode(state)
        for i in range(SLOTS):
            plain[i].append(int(out.tokens[i]))
    for slot in range(SLOTS):
        eng.free_resource(slot)

    assert [plain_sampling(p) for p in PARAMS] == [True, True, True, False]
    spec = SpeculativeVerifier(eng, K)
    state, seqs = start(eng)
    steps = accepted = 0
    greedy_emitted = 0
    while min(len(s) - len(p) for s, p in zip(seqs, PROMPTS, strict=True)) < OUT + 1:
        drafts, num = propose_ngram_batch(
            [s if plain_sampling(sp) else None for s, sp in zip(seqs, PARAMS, strict=True)], K
        )
        state, res = spec.step(state, drafts, num)
        tokens, acc = np.asarray(res.tokens), np.asarray(res.num_accepted)
        assert acc[3] == 0 and (acc <= num).all()
        for i in range(SLOTS):
            seqs[i] += tokens[i, : acc[i] + 1].tolist()
        steps += 1
        accepted += int(acc.sum())
        greedy_emitted += int(acc[:3].sum()) + 3
    for i in range(SLOTS):
        n = len(plain[i])
        assert seqs[i][:n] == plain[i], f"slot {i} differs"
    # the greedy rows' drafts paid off: more than one token per row and step on average
    assert accepted > 0 and greedy_emitted > 3 * steps * 1.2
