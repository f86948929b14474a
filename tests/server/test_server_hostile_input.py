"""Hostile input never gives a 5xx: each bad request is a 4xx with a clear OpenAI-shaped error."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import MODEL

OK_MSG = [{"role": "user", "content": "hi"}]


def body(**kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": OK_MSG, "max_tokens": 4, **kw}).encode()


CASES = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400, None),
    ("not an object", b'["model", "tiny"]', 400, None),
    ("empty body", b"", 400, None),
    ("invalid UTF-8", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("deep nesting", b'{"model": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, None),
    (
        "5000-digit number",
        b'{"model": "tiny", "messages": [], "max_tokens": ' + b"9" * 5000 + b"}",
        400,
        None,
    ),
    ("messages wrong type", body(messages="hello"), 400, "messages"),
    (
        "content wrong type",
        body(messages=[{"role": "user", "content": {"a": 1}}]),
        400,
        "messages[0].content",
    ),
    ("max_tokens string", body(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens float", body(max_tokens=5.5), 400, "max_tokens"),
    ("max_tokens negative", body(max_tokens=-5), 400, "max_tokens"),
    ("max_tokens zero", body(max_tokens=0), 400, "max_tokens"),
    ("max_tokens huge", body(max_tokens=10**30), 400, "max_tokens"),
    ("temperature huge", body(temperature=1e308), 400, "temperature"),
    ("temperature inf", b'{"model": "tiny", "messages": [], "temperature": Infinity}', 400, None),
    ("temperature NaN", body(temperature=float("nan")), 400, "temperature"),
    ("top_p zero", body(top_p=0), 400, "top_p"),
    ("top_k negative", body(top_k=-1), 400, "top_k"),
    ("n huge", body(n=10**20), 400, "n"),
    ("n zero", body(n=0), 400, "n"),
    ("n above slots", body(n=100), 400, None),
    ("seed huge", body(seed=10**40), 400, "seed"),
    ("stream not bool", body(stream="yes"), 400, "stream"),
    ("stop list of ints", body(stop=[1, 2]), 400, "stop"),
    ("stop empty string", body(stop=[""]), 400, "stop"),
    ("empty messages", body(messages=[]), 400, "messages"),
    ("empty role", body(messages=[{"role": "", "content": "x"}]), 400, "messages[0].role"),
    ("role not a string", body(messages=[{"role": 5, "content": "x"}]), 400, "messages[0].role"),
    ("message without content", body(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("model null and messages missing", json.dumps({"model": None}).encode(), 400, "messages"),
    ("model wrong type", body(model=42), 400, "model"),
    ("logprobs out of range", body(logprobs=True, top_logprobs=99), 400, "top_logprobs"),
    ("min_tokens above max", body(min_tokens=10), 400, "min_tokens"),
    ("prompt too long", body(messages=[{"role": "user", "content": "z " * 300}]), 400, "messages"),
]


@pytest.mark.parametrize("name, raw, status, param", CASES, ids=[c[0] for c in CASES])
def test_hostile_chat_requests(http, name, raw, status, param):
    r = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [10**12]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "logit_bias": {"1": "a"}}, "logit_bias.1"),
        ({"prompt": "x", "allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"prompt": "x", "prompt_logprobs": 50}, "prompt_logprobs"),
    ],
)
def test_hostile_completion_requests(http, payload, param):
    r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, **payload})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_ten_megabyte_body_is_413(http):
    raw = b'{"model": "tiny", "prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'
    r = http.post("/v1/completions", content=raw)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method_are_json(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_route"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_other_routes_refuse_garbage(http):
    for path in ("/v1/count_tokens", "/tokenize", "/detokenize"):
        for raw in (b"{", b"[]", b'{"model": "tiny"}', b'{"model": "nope", "tokens": [1]}'):
            r = http.post(path, content=raw)
            assert 400 <= r.status_code < 500, (path, raw, r.text)
    r = http.post("/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# ------------------------------------------------------------------------------------------ fuzz

_json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
_json = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_fields = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "seed", "n", "logprobs",
    "top_logprobs", "stream", "stream_options", "ignore_eos", "min_tokens", "stop_token_ids", "user", "echo",
    "tools", "response_format", "logit_bias", "allowed_token_ids", "prompt_logprobs", "return_token_ids",
]  # fmt: skip
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _json},
    optional={"content": st.text(max_size=30) | _json, "name": _json},
)
_request = st.fixed_dictionaries(
    {"model": st.just(MODEL) | _json},
    optional={
        **dict.fromkeys([f for f in _fields if f != "model"], _json),
        "messages": st.lists(_message, max_size=3) | _json,
        # keep valid requests short so the fuzz run stays quick
        "max_tokens": st.integers(min_value=-3, max_value=4) | _json,
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=_request, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzz_request_schema_never_5xx(http, payload, path):
    if "max_tokens" not in payload:
        payload["max_tokens"] = 2
    raw = json.dumps(payload, allow_nan=True).encode()
    r = http.post(path, content=raw)
    assert r.status_code < 500, (payload, r.text)
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
