"""Structured output and tool calling through the real server and the official openai client, on the tiny
random model (constraint correctness needs no smart model), on each driver (the suite's vdriver server, and
a paged odriver one over the same checkpoint): regex and choice under temperature 1.0 with seeds, ending
with "stop" as soon as the grammar is complete, JSON schemas that always validate, a tool round trip
(required and a named function), streamed == non-streamed for the same seed, a half-constrained batch whose
free half is untouched, and bad input as 400s naming the field, before anything reaches the engine."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest
from server_helpers import MODEL, make_odriver_surge, serve_surge

USER = [{"role": "user", "content": "Tell me something."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "ok", "kind", "n"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module", params=["vdriver", "odriver"])
def served(request, tiny_dir):
    """(client, surge) per driver: the suite's vdriver server, or an odriver server of the same shapes."""
    if request.param == "vdriver":
        surge, base_url = request.getfixturevalue("surge"), request.getfixturevalue("base_url")
        running = None
    else:
        surge = make_odriver_surge(tiny_dir)
        running = serve_surge(surge)
        base_url = f"{running.url}/v1"
    assert surge.supports_structured_output
    surge.warm_structured()  # else the first constrained request waits for it
    yield openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300), surge
    if running is not None:
        running.stop()


@pytest.fixture(scope="module")
def client(served):
    return served[0]


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 100)
    return client.chat.completions.create(**kw)


def test_regex_and_choice_hold_under_temperature(client):
    pattern = r"[0-9]{3}-[a-z]{2,5}( ok)?"
    out = chat(client, temperature=1.0, seed=11, n=4, extra_body={"structured_outputs": {"regex": pattern}})
    for c in out.choices:
        assert re.fullmatch(pattern, c.message.content), c.message.content
        assert c.finish_reason == "stop"  # the grammar completes long before max_tokens
    assert out.usage.completion_tokens < 4 * 20  # at most 12 characters each, of 100 allowed
    options = ["red", "green", "blue sky"]
    for seed in (1, 2, 3):
        out = chat(client, temperature=1.0, seed=seed, extra_body={"structured_outputs": {"choice": options}})
        assert out.choices[0].message.content in options
    # completions take them too
    comp = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=30,
        temperature=1.0,
        seed=5,
        n=2,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert all(re.fullmatch(pattern, c.text) for c in comp.choices)


def test_json_schema_and_json_object_validate(client):
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    out = chat(
        client,
        temperature=1.0,
        seed=3,
        n=3,
        max_tokens=150,
        response_format=rf,
        logprobs=True,
        top_logprobs=2,
    )
    for c in out.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        # logprobs of the masked distribution: every reported alternative was allowed, so none is -inf
        assert all(t.logprob > -9999 for e in c.logprobs.content for t in e.top_logprobs[:1])
    obj = chat(client, temperature=0.8, seed=4, max_tokens=150, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # an open-ended object may not close within max_tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_streamed_equals_non_streamed(client):
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    kw = dict(temperature=1.0, seed=21, max_tokens=150, response_format=rf)
    whole = chat(client, **kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in chat(client, stream=True, **kw) if c.choices]
    assert "".join(parts) == whole
    # tool calls stream as deltas with ids
    tk = dict(temperature=1.0, seed=22, max_tokens=150, tools=[WEATHER, TIME], tool_choice="required")
    ref = chat(client, **tk).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    for chunk in chat(client, stream=True, **tk):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = c["id"] or d.id
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in ref
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_round_trip_required_and_named(client):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    out = chat(
        client,
        temperature=1.0,
        seed=5,
        max_tokens=150,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    named = chat(
        client,
        temperature=1.0,
        seed=6,
        max_tokens=150,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    ncall = named.choices[0].message.tool_calls[0]
    assert ncall.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(ncall.function.arguments), params["get_weather"])
    # the result goes back through the chat template; the answer is text
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [ncall.model_dump()]},
        {"role": "tool", "tool_call_id": ncall.id, "content": "21"},
    ]
    second = chat(client, messages=history, tools=[WEATHER, TIME], tool_choice="none", max_tokens=4, seed=1)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content


def test_half_constrained_batch_leaves_the_free_half_untouched(client):
    free = [dict(temperature=1.0, seed=100 + i, max_tokens=24) for i in range(3)]
    alone = [chat(client, **kw).choices[0].message.content for kw in free]
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    constrained = [dict(temperature=1.0, seed=200 + i, max_tokens=60, response_format=rf) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(chat, client, **kw) for kw in constrained + free]
        res = [f.result() for f in futs]
    assert [r.choices[0].message.content for r in res[3:]] == alone
    for r in res[:3]:
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


BAD = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"extra_body": {"structured_outputs": {"regex": "a{3,2}"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    (
        {"extra_body": {"structured_outputs": {"grammar": "start: nothing_here"}}},
        "structured_outputs.grammar",
    ),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
        "tools[0].function.parameters.type",
    ),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
]


@pytest.mark.parametrize(("kw", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field(served, kw, param):
    client, surge = served
    before = surge.metrics().prompt_tokens_total
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    assert e.value.body["param"] == param, e.value.body
    assert surge.metrics().prompt_tokens_total == before  # nothing reached the engine


CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
        # unbounded, and long: 64 items cannot fit in the answer below
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
            "minItems": 64,
        },
    },
    "required": ["name", "population_millions", "landmarks"],
    "additionalProperties": False,
}


def test_json_follows_the_schemas_property_order_so_required_scalars_are_not_starved(client):
    """Issue 37: keys were emitted sorted, so "landmarks" (an unbounded array) came before "name" and
    "population_millions", and an answer cut at max_tokens had neither. In the schema's order they are
    written first, whatever the array does after them."""
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=80, temperature=1.0, seed=seed, response_format=rf
        )
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "length", text  # cut inside the 64-item array
        assert text.startswith('{"name": "'), text
        head = text[: text.index('"landmarks": [')]
        parsed = json.loads(head.rstrip(", ") + "}")
        assert list(parsed) == ["name", "population_millions"] and 0 <= parsed["population_millions"] <= 99
    # a bounded array completes: the whole answer validates, keys in the schema's order
    small = {**CITY, "properties": {**CITY["properties"], "landmarks": {**CITY["properties"]["landmarks"]}}}
    small["properties"]["landmarks"].update(minItems=1, maxItems=2)
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": small}},
    )
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, small)
    assert list(answer) == ["name", "population_millions", "landmarks"]
