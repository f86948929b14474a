"""vLLM's request fields and response shapes through the official `openai` client (httpx where the client
cannot send or read the thing): fields vLLM accepts are accepted, null-vs-absent as vLLM answers, vLLM's
error wording where clients match on it."""

from __future__ import annotations

import openai
import pytest
from server_helpers import MAX_LENGTH, MODEL

MESSAGES = [{"role": "user", "content": "Hello world"}]


# ------------------------------------------------------------------------------- accepted, not refused


def test_unknown_fields_custom_roles_and_extra_message_keys_are_accepted(client, http):
    # vLLM's own test sends min_characters (a field neither OpenAI nor vLLM define) and reads every delta
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": False},
        extra_body={"min_characters": 10},
    )
    text = ""
    for chunk in stream:
        text += chunk.choices[0].delta.content  # never None: every delta carries content, as vLLM's do
    direct = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert text == direct.choices[0].message.content
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello world", "extra_field": "0"}],  # type: ignore[list-item]
        max_tokens=6,
        temperature=0,
    )
    assert r.choices[0].message.content == direct.choices[0].message.content
    # a custom role reaches the template as it is; string and text-part content read alike
    custom = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "my-custom-role", "content": content}],  # type: ignore[list-item]
            max_tokens=6,
            temperature=0,
            seed=0,
            extra_body={"return_token_ids": True},
        )
        for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}])
    ]
    assert custom[0].choices[0].message.content == custom[1].choices[0].message.content
    ids = custom[0].prompt_token_ids  # type: ignore[attr-defined]
    assert (
        "<|im_start|>my-custom-role\nwhat is 1+1?"
        in http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    )
    # model may be left out: the served model answers (vLLM's test_server_load posts without one)
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(client):
    ids = list(range(5, 45))
    for side, want in ((None, ids[-8:]), ("left", ids[-8:]), ("right", ids[:8])):
        extra = {"truncate_prompt_tokens": 8, "return_token_ids": True}
        if side:
            extra["truncation_side"] = side
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, extra_body=extra)
        assert r.choices[0].prompt_token_ids == want, side  # type: ignore[attr-defined]
        assert r.usage.prompt_tokens == 8
    # text prompts and chat are tokenized on the server, then cut; -1 is the context length
    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is Paris. " * 20,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 10},
    )
    assert r.usage.prompt_tokens == 10
    long_chat = [{"role": "user", "content": "z " * 300}]  # far beyond the context
    # ignore_eos: sampled at the default temperature, the random test model may end on EOS after one token
    r = client.chat.completions.create(
        model=MODEL,
        messages=long_chat,
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 20, "ignore_eos": True},
    )
    assert r.usage.prompt_tokens == 20 and r.usage.completion_tokens == 2
    r = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": -1, "return_token_ids": True},
    )
    assert r.choices[0].prompt_token_ids == ids  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"truncate_prompt_tokens": MAX_LENGTH + 1}
        )
    assert e.value.body["param"] == "truncate_prompt_tokens"
    assert f"is greater than max_model_len ({MAX_LENGTH})" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=1,
            extra_body={"truncate_prompt_tokens": 4, "truncation_side": "up"},
        )
    assert e.value.body["param"] == "truncation_side"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_prepends_the_assistant_message(client, stream):
    saying = "Here is a common saying about apple. An apple a day, keeps"
    messages = [
        {"role": "user", "content": "tell me a common saying"},
        {"role": "assistant", "content": saying},
    ]
    texts = {}
    for echo in (True, False):
        kw = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 5,
            "temperature": 0,
            "extra_body": {"echo": echo, "continue_final_message": True, "add_generation_prompt": False},
        }
        if stream:
            texts[echo] = "".join(
                c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
            )
        else:
            texts[echo] = client.chat.completions.create(**kw).choices[0].message.content
    assert texts[True] == saying + texts[False] and saying not in texts[False]
    # the last message is the user's: nothing to echo
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, extra_body={"echo": True}
    )
    assert not r.choices[0].message.content.startswith("Hello world")


def test_return_tokens_as_token_ids(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Hello, world! How are you today?",
        max_tokens=6,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1},
    )
    c = r.choices[0]
    logged = [int(t.removeprefix("token_id:")) for t in c.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in c.logprobs.tokens)
    assert logged == c.prompt_token_ids + c.token_ids  # type: ignore[attr-defined]
    assert all(k.startswith("token_id:") for top in c.logprobs.top_logprobs[1:] for k in top)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in chat.choices[0].token_ids]  # type: ignore[attr-defined]
    assert all(e.bytes is None and len(e.top_logprobs) == 2 for e in entries)
    # streamed: every chunk's logprobs name the ids of its token_ids
    stream = client.completions.create(
        model=MODEL,
        prompt="Tell me a short fact about Python:",
        max_tokens=8,
        temperature=0,
        stream=True,
        logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    streamed, logged, first = [], [], None
    for chunk in stream:
        logged += [int(t.removeprefix("token_id:")) for t in chunk.choices[0].logprobs.tokens]
        if first is None:
            first = chunk.choices[0].prompt_token_ids  # type: ignore[attr-defined]
        streamed += chunk.choices[0].token_ids  # type: ignore[attr-defined]
    assert first and streamed == logged and len(streamed) == 8


def test_logprob_token_ids_answers_the_named_ids(client, http):
    # vLLM's logprob_token_ids: the named ids (and the sampled token) in place of the top-k, each with the
    # same value the natural top-k gives it
    natural = (
        client.completions.create(
            model=MODEL,
            prompt="Hello there",
            max_tokens=3,
            temperature=0,
            logprobs=5,
            extra_body={"return_tokens_as_token_ids": True},
        )
        .choices[0]
        .logprobs
    )
    picked = [int(k.removeprefix("token_id:")) for k in natural.top_logprobs[1]][1:4]
    named = (
        client.completions.create(
            model=MODEL,
            prompt="Hello there",
            max_tokens=3,
            temperature=0,
            logprobs=5,
            extra_body={"return_tokens_as_token_ids": True, "logprob_token_ids": picked},
        )
        .choices[0]
        .logprobs
    )
    assert named.tokens == natural.tokens
    for at in range(3):
        assert set(named.top_logprobs[at]) == {named.tokens[at], *(f"token_id:{t}" for t in picked)}
        for key, value in named.top_logprobs[at].items():
            if key in natural.top_logprobs[at]:
                assert value == pytest.approx(natural.top_logprobs[at][key], abs=1e-4)
    # with allowed_token_ids the sampled token is an allowed one and still heads the named ids (chat,
    # streamed: each chunk's entries)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={
            "logprob_token_ids": [5, 7],
            "allowed_token_ids": [42],
            "return_tokens_as_token_ids": True,
        },
    )
    entries = [
        e
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == ["token_id:42"] * 2
    assert all(
        [t.token for t in e.top_logprobs] == ["token_id:42", "token_id:5", "token_id:7"] for e in entries
    )
    assert all(-1e4 < t.logprob <= 0 for e in entries for t in e.top_logprobs)
    # bad input names the field
    for extra in ({"logprob_token_ids": [10**9]}, {"logprob_token_ids": "5"}, {"logprob_token_ids": []}):
        r = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "logprobs": 1, **extra}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids", r.text
    r = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "logprob_token_ids": [5]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids"


# ------------------------------------------------------------------------------------- response shapes


def test_unasked_fields_are_null_not_absent(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=3,
        temperature=0,
        logprobs=1,
        extra_body={"return_token_ids": False},
    )
    assert r.choices[0].token_ids is None and r.choices[0].prompt_token_ids is None  # type: ignore[attr-defined]
    assert r.choices[0].prompt_logprobs is None and r.choices[0].stop_reason is None  # type: ignore[attr-defined]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
    assert chat.prompt_token_ids is None and chat.prompt_logprobs is None  # type: ignore[attr-defined]
    assert chat.choices[0].token_ids is None  # type: ignore[attr-defined]
    assert chat.choices[0].message.tool_calls is None  # absent when no calls, as OpenAI answers


def test_stop_reason_names_the_stop_token(client):
    base = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    third = base.choices[0].token_ids[2]  # type: ignore[attr-defined]
    r = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [third], "ignore_eos": True, "return_token_ids": True},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == third  # type: ignore[attr-defined]


def test_streamed_chat_prompt_token_ids_on_the_first_chunk_only(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids  # type: ignore[attr-defined]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == whole.choices[0].token_ids  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("seed, word", [(-(2**63) - 1, "greater_than_equal"), (2**63, "less_than_equal")])
def test_out_of_range_seed_has_vllms_words(client, seed, word):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, seed=seed)
    assert e.value.body["param"] == "seed" and word in e.value.message


def test_empty_prompt_and_out_of_vocabulary_ids_have_vllms_words(client, http):
    with pytest.raises(
        openai.BadRequestError, match="Either prompt or prompt_embeds must be provided and non-empty."
    ):
        client.completions.create(model=MODEL, prompt=None, max_tokens=5, extra_body={"prompt_embeds": []})  # type: ignore[arg-type]
    for prompt in ("", [], [[1], []]):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert (
            "Either prompt or prompt_embeds must be provided and non-empty." in r.json()["error"]["message"]
        )
    with pytest.raises(openai.BadRequestError, match="out of vocabulary") as e:
        client.completions.create(model=MODEL, prompt=[999999], max_tokens=5)
    assert e.value.body["param"] == "prompt"
    vocab = 320
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, logit_bias={str(vocab + 1): 1.0}
        )
    assert str(vocab + 1) in e.value.message and str(vocab) in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, logit_bias={"bad1": 50, "bad2": 2}
        )
    assert "bad1" in e.value.message and "bad2" in e.value.message and e.value.body["param"] == "logit_bias"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"bad_words": ["x"]}, "bad_words"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"priority": 3}, "priority"),
        ({"prompt_embeds": ["AAAA"]}, "prompt_embeds"),
    ],
)
def test_vllm_fields_that_would_be_ignored_are_refused_by_name(http, extra, param):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == "unsupported_parameter"
    neutral = {
        "bad_words": [],
        "include_stop_str_in_output": False,
        "priority": 0,
        "skip_special_tokens": True,
    }
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, **neutral})
    assert r.status_code == 200, r.text


def test_ignored_fields_are_logged_once(http, caplog):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "frobnicate_once_37": 1}
    with caplog.at_level("WARNING", logger="vsurge.server.body"):
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.post("/v1/completions", json=body).status_code == 200
    hits = [r for r in caplog.records if "frobnicate_once_37" in r.getMessage()]
    assert len(hits) == 1 and "ignored" in hits[0].getMessage()
