"""Request parsing as pure functions: every bad input is an APIError naming the field, never a crash."""

from __future__ import annotations

import pytest
from tiny_models import tiny_tokenizer

from vsurge.server.errors import APIError, from_exception
from vsurge.server.parsing import (
    completion_prompts,
    plan_chat,
    plan_completion,
    read_json,
    render_chat,
    validate,
)
from vsurge.server.schemas import ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def chat(tok, **body):
    body.setdefault("model", "m")
    body.setdefault("messages", MSG)
    return plan_chat(validate(ChatCompletionRequest, body), tok, max_length=100, vocab_size=320)


def completion(**body):
    body.setdefault("model", "m")
    body.setdefault("prompt", "hello")
    return plan_completion(validate(CompletionRequest, body), max_length=100, vocab_size=320)


def err(fn, *a, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*a, **kw)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"", "empty"),
        (b'{"model": ', "not valid JSON"),
        (b"\xff\xfe{}", "UTF-8"),
        (b"[1, 2]", "JSON object"),
        (b'{"a": ' + b"1" * 5000 + b"}", "could not be parsed"),
        (b"[" * 100000 + b"]" * 100000, ""),
        (b'{"messages": [{"content": "hi \\ud83d"}]}', "lone UTF-16 surrogate"),
        (b'{"prompt": "\\udc00"}', "lone UTF-16 surrogate"),
        (b'{"\\ud800": 1}', "lone UTF-16 surrogate"),
    ],
)
def test_read_json_rejects(body, fragment):
    e = err(read_json, body)
    assert fragment in e.message


def test_surrogate_pairs_are_fine_and_lone_halves_named():
    assert read_json(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}
    assert err(read_json, b'{"messages": [{"content": "\\ud83d"}]}').param == "messages[0].content"


def test_validation_errors_name_the_field(tok):
    assert err(chat, tok, max_tokens="5").param == "max_tokens"
    assert err(chat, tok, stream=1).param == "stream"
    assert err(chat, tok, messages=[{"role": "user", "content": 5}]).param == "messages[0].content"
    # unknown fields are ignored (vLLM), inside messages too; model is optional (the served model)
    plan = chat(
        tok, foo=1, min_characters=10, messages=[{"role": "user", "content": "hi", "extra_field": "0"}]
    )
    assert plan.prompts[0] == chat(tok).prompts[0]
    assert validate(ChatCompletionRequest, {"messages": MSG}).model is None
    e = err(validate, ChatCompletionRequest, {"model": "m"})
    assert e.param == "messages" and "Missing required parameter" in e.message
    e = err(validate, CompletionRequest, {"model": "m", "prompt": 5})
    assert e.param == "prompt" and "expected one of" in e.message


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f"}]),
        ("audio", {"voice": "alloy"}),
        ("modalities", ["text", "audio"]),
        ("store", True),
    ],
)
def test_unsupported_fields_are_refused_by_name(tok, field, value):
    e = err(chat, tok, **{field: value})
    assert e.param == field and "not supported" in e.message


def test_harmless_off_values_are_accepted(tok):
    plan = chat(
        tok, tools=[], tool_choice="none", response_format={"type": "text"}, modalities=["text"], store=False
    )
    assert plan.prompts[0].endswith("<|im_start|>assistant\n")


def test_fields_that_change_nothing_here_are_accepted(tok):
    # OpenAI's storage / billing / caching / abuse fields steer nothing a self-hosted model does
    plan = chat(
        tok,
        prompt_cache_key="k",
        safety_identifier="u-1",
        service_tier="flex",
        metadata={"a": "b"},
        store=False,
        verbosity="low",
    )
    assert plan.prompts[0].endswith("<|im_start|>assistant\n")
    assert err(chat, tok, verbosity="loud").param == "verbosity"


def test_logit_bias_allowed_ids_and_prompt_logprobs(tok):
    plan = chat(tok, logit_bias={"5": -100, "7": 2.5}, allowed_token_ids=[5, 7, 9], prompt_logprobs=2)
    assert plan.sampling.logit_bias == {5: -100, 7: 2.5}
    assert plan.sampling.allowed_token_ids == [5, 7, 9] and plan.sampling.prompt_logprobs == 2
    assert plan.show_prompt_logprobs
    assert err(chat, tok, logit_bias={"x": 1}).param == "logit_bias"
    assert err(chat, tok, logit_bias={"5": 101}).param == "logit_bias"
    assert err(chat, tok, logit_bias={str(i): 1 for i in range(301)}).param == "logit_bias"
    assert err(chat, tok, logit_bias={"100000": 1}).param == "logit_bias"
    assert err(chat, tok, allowed_token_ids=[320]).param == "allowed_token_ids"
    assert err(chat, tok, allowed_token_ids=[]).param == "allowed_token_ids"
    assert err(chat, tok, prompt_logprobs=21).param == "prompt_logprobs"


def test_messages_roles_and_parts(tok):
    assert err(chat, tok, messages=[]).param == "messages"
    # a custom role goes to the chat template as it is (vLLM); an empty one is refused
    assert (
        "<|im_start|>wizard\nx<|im_end|>"
        in chat(tok, messages=[{"role": "wizard", "content": "x"}]).prompts[0]
    )
    assert err(chat, tok, messages=[{"role": " ", "content": "x"}]).param == "messages[0].role"
    e = err(chat, tok, messages=[{"role": "tool", "content": "x"}])
    assert e.param == "messages[0].tool_call_id"
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    assert err(chat, tok, messages=img).param == "messages[0].content[0].type"
    parts = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    plan = chat(tok, messages=parts)
    assert "<|im_start|>system\nbe brief<|im_end|>" in plan.prompts[0]
    assert "a\nb" in plan.prompts[0]


def test_sampling_bounds(tok):
    assert err(chat, tok, max_tokens=-1).param == "max_tokens"
    assert err(chat, tok, max_tokens=10**30).param == "max_tokens"
    assert err(chat, tok, max_completion_tokens=101).param == "max_completion_tokens"
    assert err(chat, tok, temperature=1e308).param == "temperature"
    assert err(chat, tok, n=10**20).param == "n"
    assert err(chat, tok, seed=10**40).param == "seed"
    assert err(chat, tok, top_logprobs=3).param == "top_logprobs"  # without logprobs
    assert err(chat, tok, stop=["x"] * 17).param == "stop"
    assert err(chat, tok, stop_token_ids=[10**6]).param == "stop_token_ids"
    assert err(chat, tok, stream_options={"include_usage": True}).param == "stream_options"
    sp = chat(tok, top_k=10**30).sampling  # wider than the vocabulary: no filter, not an int32 overflow
    assert sp.top_k == 0
    # chat has no output cap by default: the context length, enforced by the engine
    assert chat(tok).sampling.max_tokens == 100
    assert chat(tok, max_completion_tokens=7).sampling.max_tokens == 7
    body = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    nan = validate(ChatCompletionRequest, read_json(body.encode()))
    assert err(plan_chat, nan, tok, max_length=100).param == "temperature"


def test_completion_prompts_and_logprobs():
    assert completion_prompts("a", 10) == ["a"]
    assert completion_prompts([1, 2], 10) == [[1, 2]]
    assert completion_prompts([[1], [2, 3]], 10) == [[1], [2, 3]]
    assert completion_prompts(["a", "b"], 10) == ["a", "b"]
    assert err(completion_prompts, [], 10).param == "prompt"
    assert err(completion_prompts, "", 10).param == "prompt"
    assert err(completion_prompts, [5, 99], 10).param == "prompt"
    plan = completion(logprobs=2)
    assert plan.sampling.logprobs and plan.sampling.top_logprobs == 2
    assert completion().sampling.max_tokens == 16  # OpenAI's legacy default
    assert err(completion, logprobs=21).param == "logprobs"
    assert err(completion, suffix="x").param == "suffix"
    assert err(completion, prompt=["a"] * 50, n=3).param == "n"


def test_chat_template_errors_are_400(tok):
    e = err(render_chat, tok, MSG, chat_template_kwargs={"tokenize": True})
    assert e.param == "chat_template_kwargs.tokenize"
    e = err(render_chat, tok, MSG, continue_final_message=True)
    assert e.param == "continue_final_message"
    assert err(render_chat, None, MSG).param == "model"


def test_engine_exceptions_map_to_statuses():
    from vsurge.contracts.request import PromptTooLongError, QueueFullError, RequestFailedError
    from vsurge.contracts.sampling_params import InvalidSamplingParams

    assert from_exception(InvalidSamplingParams("top_p", "bad")).param == "top_p"
    assert from_exception(PromptTooLongError("long")).code == "context_length_exceeded"
    q = from_exception(QueueFullError("full"))
    assert q.status == 429 and q.headers["Retry-After"]
    assert from_exception(RequestFailedError("boom")).status == 500
    assert from_exception(ValueError("bad ids")).status == 400
    body = from_exception(KeyError("x")).body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
