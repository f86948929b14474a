"""The gateway's render routes (/v1/chat/completions/render, /v1/completions/render) through the real server:
the token ids a render answers are the very prompt ids the generation route fed the engine (its
`prompt_token_ids` with vLLM's return_token_ids), for chat (template, tools) and completions (text, token
ids, tokenization options), in vLLM's generate-request shape; bad input is a 400 naming the field."""

from __future__ import annotations

import pytest

USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_chat_render_is_what_generation_feeds_the_engine(http):
    body = {"model": "tiny", "messages": USER, "max_tokens": 3, "temperature": 0.5, "seed": 4}
    r = http.post("/v1/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["request_id"].startswith("chatcmpl-") and got["features"] is None and got["stream"] is False
    assert got["sampling_params"]["max_tokens"] == 3 and got["sampling_params"]["temperature"] == 0.5
    assert got["sampling_params"]["seed"] == 4 and got["model"] == "tiny"
    gen = http.post("/v1/chat/completions", json={**body, "return_token_ids": True}).json()
    assert got["token_ids"] == gen["prompt_token_ids"]
    assert isinstance(got["prompt"], str) and "Hello there" in got["prompt"]
    # tools under tool_choice auto are described in the prompt: the render shows them too (and a prompt
    # that grew past the tiny context is the same 400 as generation's)
    short = {"model": "tiny", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2}
    tools = http.post("/v1/chat/completions/render", json={**short, "tools": [TOOL], "tool_choice": "auto"})
    gen = http.post(
        "/v1/chat/completions",
        json={**short, "tools": [TOOL], "tool_choice": "auto", "return_token_ids": True},
    )
    assert tools.status_code == gen.status_code, (tools.text, gen.text)
    if gen.status_code == 200:
        assert tools.json()["token_ids"] == gen.json()["prompt_token_ids"]
        assert "<tools>" in tools.json()["prompt"]
    else:
        assert tools.json()["error"]["code"] == gen.json()["error"]["code"] == "context_length_exceeded"


def test_completion_render_one_per_prompt(http, surge):
    body = {"model": "tiny", "prompt": ["abc def", "gh"], "max_tokens": 2}
    r = http.post("/v1/completions/render", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert isinstance(got, list) and len(got) == 2 and got[0]["request_id"].startswith("cmpl-")
    assert got[0]["token_ids"] == surge.tokenize("abc def") and got[0]["prompt"] == "abc def"
    gen = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    assert [c["prompt_token_ids"] for c in gen["choices"]] == [g["token_ids"] for g in got]
    ids = http.post("/v1/completions/render", json={"model": "tiny", "prompt": [5, 6, 7]}).json()
    assert ids[0]["token_ids"] == ids[0]["prompt_token_ids"] == [5, 6, 7]
    assert ids[0]["prompt"] == surge.processor.decode([5, 6, 7])
    # tokenization options apply as in generation
    opts = {
        "model": "tiny",
        "prompt": "abc def ghi",
        "add_special_tokens": False,
        "truncate_prompt_tokens": 2,
    }
    cut = http.post("/v1/completions/render", json=opts).json()[0]
    assert cut["token_ids"] == surge.processor.encode("abc def ghi", add_special_tokens=False)[-2:]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions/render", {"messages": []}, "messages"),
        ("/v1/chat/completions/render", {"messages": USER, "max_tokens": -1}, "max_tokens"),
        (
            "/v1/chat/completions/render",
            {"messages": USER, "use_beam_search": True, "n": 2},
            "use_beam_search",
        ),
        ("/v1/completions/render", {"prompt": ""}, "prompt"),
        ("/v1/completions/render", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions/render", {"prompt": "word " * 400}, "prompt"),
    ],
)
def test_bad_input_is_400_naming_the_field(http, path, body, param):
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_counted_and_traced(http, span_exporter):
    http.post("/v1/completions/render", json={"model": "tiny", "prompt": "x"})
    assert 'route="/v1/completions/render",status="200"' in http.get("/metrics").text
    assert any(s.name == "render tiny" for s in span_exporter.get_finished_spans())


def test_what_vllm_render_tests_read(http, surge):
    """vLLM's own render tests (tests/entrypoints/openai/cpu/test_render.py), their checks restated."""
    text = "When should a handler return an empty string?"
    got = http.post("/v1/completions/render", json={"model": "tiny", "prompt": text}).json()
    assert got[0]["prompt_token_ids"] and text in got[0]["prompt"]
    multi = http.post("/v1/completions/render", json={"model": "tiny", "prompt": ["Hello", "Bye"]}).json()
    assert len(multi) == 2 and all(m["prompt_token_ids"] and m["prompt"] for m in multi)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": 0.123,
        "top_p": 0.456,
        "frequency_penalty": 1.1,
    }
    r = http.post("/v1/chat/completions/render", json=body)
    assert r.headers["content-type"].startswith("application/json")
    chat = r.json()
    assert chat["token_ids"] == surge.tokenize(
        chat["prompt"]
    )  # vLLM checks BOS first; this template has none
    assert chat["stream"] is True and chat["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    sp = chat["sampling_params"]
    assert (sp["temperature"], sp["top_p"], sp["frequency_penalty"]) == (0.123, 0.456, 1.1)
    for path, body in (
        ("/v1/completions/render", {"prompt": "x"}),
        ("/v1/chat/completions/render", {"messages": []}),
    ):
        missing = http.post(path, json={"model": "nope", **body})
        assert missing.status_code == 404 and "error" in missing.json()
