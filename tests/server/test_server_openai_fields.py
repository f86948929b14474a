"""The OpenAI fields clients send, through the official `openai` client against the real server: what is
advertised is what is accepted, logprobs as OpenAI shapes them, logit_bias / allowed_token_ids on the
device, echo + logprobs and prompt_logprobs against transformers' own logits, and hostile text on every
route answered with a 400 (never a 500, never a reset connection)."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import torch
from server_helpers import MAX_LENGTH, MODEL, PREFILL_LENGTHS

MESSAGES = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def torch_model(tiny_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


def torch_logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


# ------------------------------------------------------------------------------------ hostile text

LONE = "\ud83d"  # half of a surrogate pair: json.dumps writes it as the escape \ud83d


def test_lone_surrogate_is_a_400_invalid_request_error(http, client):
    # The Python client cannot even encode a lone surrogate (it serializes with ensure_ascii=False, so
    # UTF-8 encoding fails on the client side); JavaScript's JSON.stringify sends it as the escape \ud83d,
    # which is what reaches the server here.
    with pytest.raises(UnicodeEncodeError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": LONE}], max_tokens=2
        )
    for route, body, param in (
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": LONE}], "max_tokens": 2},
            "messages[0].content",
        ),
        ("/v1/completions", {"prompt": "a" + LONE, "max_tokens": 2}, "prompt"),
        ("/tokenize", {"prompt": LONE}, "prompt"),
    ):
        raw = json.dumps({"model": MODEL, **body}).encode()
        assert b"\\ud83d" in raw
        r = http.post(route, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (
            err["type"] == "invalid_request_error" and err["param"] == param and "surrogate" in err["message"]
        )


HOSTILE_TEXTS = [LONE, "\udc00tail", "nul\x00byte", "\U0010ffff" * 50, "‮rtl", "\ufeff" + "z" * 10]
POST_ROUTES = {
    "/v1/chat/completions": lambda t: {
        "model": MODEL,
        "messages": [{"role": "user", "content": t}],
        "max_tokens": 2,
    },
    "/v1/completions": lambda t: {"model": MODEL, "prompt": t, "max_tokens": 2},
    "/v1/count_tokens": lambda t: {"model": MODEL, "conversation": t},
    "/tokenize": lambda t: {"model": MODEL, "prompt": t},
    "/detokenize": lambda t: {"model": MODEL, "tokens": [1, 2], "x": t},
}


@pytest.mark.parametrize("route", sorted(POST_ROUTES))
@pytest.mark.parametrize("text", HOSTILE_TEXTS, ids=[f"text{i}" for i in range(len(HOSTILE_TEXTS))])
def test_hostile_text_on_every_route_is_answered_and_the_connection_survives(http, route, text):
    raw = json.dumps(POST_ROUTES[route](text)).encode()  # ensure_ascii: surrogates travel as escapes
    r = http.post(route, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/json")
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if "\ud800" <= text[0] <= "\udfff":
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    # the same kept-alive connection still answers
    assert http.get("/v1/models").status_code == 200


# ------------------------------------------------------------------------------------ context length


def test_advertised_context_is_the_accepted_context(client, http, surge):
    (card,) = client.models.list().data
    assert card.model_extra["max_model_len"] == MAX_LENGTH
    assert http.post("/tokenize", json={"model": MODEL, "prompt": "x"}).json()["max_model_len"] == MAX_LENGTH
    # longer than every prefill bucket (chunked), up to the whole context less one token
    for n in (PREFILL_LENGTHS[-1] + 1, MAX_LENGTH - 1):
        r = client.completions.create(model=MODEL, prompt=[5] * n, max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == n and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * MAX_LENGTH, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"


def test_long_prompt_greedy_equals_transformers(client, torch_model):
    rng = np.random.RandomState(3)
    ids = [int(t) for t in rng.randint(3, 300, size=PREFILL_LENGTHS[-1] + 40)]
    r = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    with torch.no_grad():
        want = torch_model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[
            0, len(ids) :
        ].tolist()
    assert r.choices[0].model_extra["token_ids"] == want


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(client):
    prompt = [5] * (MAX_LENGTH - 10)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    assert f"maximum context length is {MAX_LENGTH}" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        long_chat = [{"role": "user", "content": "z " * (MAX_LENGTH - 40)}]
        client.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=60)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    # no max_tokens on chat: up to the context, as OpenAI does
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "z " * 60}], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_LENGTH


# ------------------------------------------------------------------------------------ logprobs


def test_completion_logprobs_hold_the_sampled_token(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == 5
    for tok, lpv, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4 and top[tok] == pytest.approx(lpv)
        assert max(top, key=top.get) == tok  # greedy: the sampled token is the most likely
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]
    assert all(v < 0 for v in lp.token_logprobs)


def test_echo_with_logprobs_scores_the_prompt_like_transformers(client, http, torch_model):
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world, hello"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    want = torch_logprobs(torch_model, ids)
    n = len(ids)
    assert len(lp.token_logprobs) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:n], [want[p - 1, ids[p]] for p in range(1, n)], atol=1e-3)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # the same through the stream
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True, stream=True
        )
    )
    streamed = [
        v for ch in chunks for v in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])
    ]
    assert streamed[0] is None
    np.testing.assert_allclose(streamed[1:], lp.token_logprobs[1:], atol=1e-5)


def test_prompt_logprobs_token_ids_and_cached_tokens(client, http, torch_model):
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": "one two three"}).json()["tokens"]
    r = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=3,
        temperature=0,
        extra_body={"prompt_logprobs": 2, "return_token_ids": True, "ignore_eos": True},
    )
    c = r.choices[0].model_extra
    assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == 3
    pl = c["prompt_logprobs"]
    want = torch_logprobs(torch_model, ids)
    assert pl[0] is None and len(pl) == len(ids)
    for p in range(1, len(ids)):
        entry = pl[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(float(want[p - 1, ids[p]]), abs=1e-3)
        assert entry["rank"] == 1 + int(np.sum(want[p - 1] > want[p - 1, ids[p]]))
        assert 1 <= len(pl[p]) <= 3
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # vDriver keeps no prefix cache
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True},
    )
    extra = chat.model_extra
    assert len(extra["prompt_logprobs"]) == len(extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert chat.choices[0].model_extra["token_ids"]


# ------------------------------------------------------------------------------------ logit_bias


def test_logit_bias_and_allowed_token_ids_steer_sampling(client):
    base = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    first = base.choices[0].model_extra["token_ids"][0]
    forced = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert forced.choices[0].model_extra["token_ids"] == [42] * 4
    banned = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=1,
        temperature=0,
        logit_bias={str(first): -100},
        extra_body={"return_token_ids": True},
    )
    assert banned.choices[0].model_extra["token_ids"][0] != first
    allowed = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.0,
        seed=5,
        extra_body={"allowed_token_ids": [40, 41, 43], "return_token_ids": True, "ignore_eos": True},
    )
    assert set(allowed.choices[0].model_extra["token_ids"]) <= {40, 41, 43}
    # logit_bias on an id outside allowed_token_ids must not let it in: it shared the allowed row on the
    # device, so +100 on 42 used to force 42 (the "token outside the allowed set" of issue 37)
    both = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        logit_bias={"42": 100, "43": 100},
        extra_body={"allowed_token_ids": [40, 41, 43], "return_token_ids": True, "ignore_eos": True},
    )
    assert both.choices[0].model_extra["token_ids"] == [43] * 6  # the bias on an allowed id still counts
    for bad, param in (({"99999": 1}, "logit_bias"), ({"7": 500}, "logit_bias"), ({"x": 1}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, logit_bias=bad)
        assert e.value.body["param"] == param


def test_fields_that_change_nothing_here_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        prompt_cache_key="conv-1",
        safety_identifier="user-1",
        service_tier="auto",
        metadata={"team": "a"},
        store=False,
        verbosity="low",
    )
    assert r.choices[0].message.content is not None
