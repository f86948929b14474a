"""vLLM's use_beam_search: the pure step (expand / best) on hand-made candidates, and the real server's beams
against an independent beam search over transformers' logits for the same tiny checkpoint."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from server_helpers import MODEL

from vsurge.server.beam_search import Beam, best, expand, score

EOS = frozenset({2})


def test_expand_keeps_the_width_best_and_sets_eos_beams_aside():
    beams = [Beam((5,), -1.0), Beam((6,), -2.0)]
    cands = [[(7, -0.1), (2, -0.2), (8, -3.0)], [(9, -0.5), (2, -0.1)]]
    live, done = expand(
        beams, cands, width=2, eos_ids=EOS, ignore_eos=False, prompt_len=3, length_penalty=1.0
    )
    assert [b.tokens for b in live] == [(5, 7), (6, 9)]
    assert [(b.tokens, b.finish_reason) for b in done] == [((5, 2), "stop"), ((6, 2), "stop")]
    assert live[0].logprob == pytest.approx(-1.1)
    # ignore_eos: EOS is one more token; -inf candidates never make a beam
    live, done = expand(
        beams[:1],
        [[(2, -0.2), (7, -math.inf)]],
        width=2,
        eos_ids=EOS,
        ignore_eos=True,
        prompt_len=3,
        length_penalty=1.0,
    )
    assert [b.tokens for b in live] == [(5, 2)] and done == []


def test_best_ranks_finished_and_live_by_length_normalised_logprob():
    done = [Beam((4, 2), -3.0, "stop")]  # 3 + 1 tokens (EOS not counted): -3 / 4 = -0.75
    live = [Beam((4, 5, 6), -4.0)]  # 3 + 3 tokens: -4 / 6 = -0.667
    ranked = best(live, done, width=2, eos_ids=EOS, prompt_len=3, length_penalty=1.0)
    assert [(b.tokens, b.finish_reason) for b in ranked] == [((4, 5, 6), "length"), ((4, 2), "stop")]
    # length_penalty 0: raw cumulative logprob decides
    ranked = best(live, done, width=1, eos_ids=EOS, prompt_len=3, length_penalty=0.0)
    assert ranked[0].tokens == (4, 2)
    assert score(done[0], 3, 1.0, EOS) == pytest.approx(-0.75)


# ------------------------------------------------------------------------------------- against torch


@pytest.fixture(scope="module")
def torch_model(tiny_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


def reference_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0):
    """vLLM's algorithm written out over transformers' logits: top 2 x width per beam, keep width."""

    def norm(tokens, lp):
        n = len(prompt) + len(tokens) - (1 if tokens and tokens[-1] == eos else 0)
        return lp / n**length_penalty

    live, done = [((), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, lp in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(tokens)])).logits[0, -1].double()
            top = torch.topk(torch.log_softmax(logits, -1), 2 * width)
            for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (done if t == eos else grown).append(((*tokens, t), lp + v))
        live = sorted(grown, key=lambda b: norm(*b), reverse=True)[:width]
    ranked = sorted(done + live, key=lambda b: norm(*b), reverse=True)[:width]
    return [[t for t in tokens if t != eos] for tokens, _ in ranked]


def test_beams_match_a_reference_beam_search(client, http, torch_model, surge):
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": "The capital of France"}).json()["tokens"]
    want = reference_beam_search(torch_model, ids, width=3, max_tokens=4, eos=surge.processor.eos_token_id)
    r = client.completions.create(
        model=MODEL,
        prompt=ids,
        n=3,
        max_tokens=4,
        temperature=0,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    )
    assert [c.token_ids for c in r.choices] == want  # type: ignore[attr-defined]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == sum(len(w) for w in want)
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)


def test_beam_search_like_vllms_own_test(client):
    # vLLM's test_batch_completions: n=2 beams differ, two copies of one prompt agree, text and token ids
    for prompts in (["Hello, my name is"] * 2, [[5, 6, 7, 8, 9]] * 2):
        batch = client.completions.create(
            model=MODEL,
            prompt=prompts,
            n=2,
            max_tokens=5,
            temperature=0,
            extra_body={"use_beam_search": True},
        )
        texts = [c.text for c in batch.choices]
        assert len(texts) == 4 and texts[0] != texts[1]
        assert texts[0] == texts[2] and texts[1] == texts[3]


def test_beam_search_streams_and_chats(client):
    kw = {"model": MODEL, "max_tokens": 4, "temperature": 0, "n": 2, "extra_body": {"use_beam_search": True}}
    whole = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw)
    chunks = list(
        client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], stream=True, **kw)
    )
    streamed = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert whole.choices[0].message.content != whole.choices[1].message.content


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 11}, "n"),
        ({"logprobs": 2}, "logprobs"),
        ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(client, extra, param):
    body = {"extra_body": {"use_beam_search": True, **extra.pop("extra_body", {})}}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, **extra, **body)
    assert e.value.body["param"] == param
