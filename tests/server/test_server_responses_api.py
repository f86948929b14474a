"""OpenAI's Responses API (/v1/responses) through the real server and the official `openai` client, on the
suite's tiny random model: a whole response, the typed stream as the client's stream helpers accumulate
it, a function-tool round trip (function_call -> function_call_output via previous_response_id), a
JSON-schema format that always validates, a chained conversation, the stored response's GET / DELETE /
cancel, and bad input as 400s naming the Responses field. Plus the store's bound and TTL (pure)."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import openai
import pytest
from patience import ceiling

from vsurge.server.responses_api import items_to_messages, normalize_input, parse_responses
from vsurge.server.responses_store import ResponseStore, StoredResponse

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_whole_response_with_usage(client):
    r = client.responses.create(
        model="tiny", input="Hello there", instructions="Be brief.", max_output_tokens=6, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert isinstance(r.output_text, str) and r.output_text
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 3
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.instructions == "Be brief." and r.max_output_tokens == 6
    # the same prompt through chat completions: the same tokens in, the same greedy text out
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0,
    )
    assert chat.usage.prompt_tokens == r.usage.input_tokens
    assert chat.choices[0].message.content == r.output_text


def test_streamed_events_as_the_client_helpers_read_them(client):
    kinds = []
    deltas = []
    with client.responses.stream(
        model="tiny",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Give me JSON."}]}],
        text={"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA}},
        max_output_tokens=120,
        temperature=1.0,
        extra_body={"seed": 3},
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        assert kinds[-1] == "response.completed", kinds[-6:]
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert len(deltas) > 1 and final.status == "completed"
    assert "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), SCHEMA)  # the grammar closed the object


def test_json_schema_format_validates(client):
    r = client.responses.create(
        model="tiny",
        input="A name please",
        text={"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}},
        max_output_tokens=120,
        temperature=1.0,
        extra_body={"seed": 3},
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_tool_call_round_trip(client):
    first = client.responses.create(
        model="tiny",
        input="What is the weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 7}'}],
        tools=[WEATHER],
        tool_choice="none",  # auto would describe the tools in the prompt: too long for the tiny context
        max_output_tokens=5,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    # the continuation's prompt holds the first turn, the call and its output
    assert second.usage.input_tokens > first.usage.input_tokens


def test_chained_previous_response_id_and_stored_object(client, http):
    first = client.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=4, temperature=0)
    second = client.responses.create(
        model="tiny",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=4,
        temperature=0,
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    # not stored: nothing to continue from
    loose = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(loose.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="y", previous_response_id=loose.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    # a finished response cannot be cancelled; deleting it forgets it
    r = http.post(f"/v1/responses/{first.id}/cancel")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert http.delete(f"/v1/responses/{first.id}").status_code == 404


def test_cancel_a_running_response(server, http):
    out = {}

    def run():
        body = {"model": "tiny", "input": "long", "max_output_tokens": 150, "temperature": 0}
        out["r"] = http.post("/v1/responses", json=body).json()

    t = threading.Thread(target=run)
    t.start()
    store = server.api.responses_store
    running = None
    deadline = time.monotonic() + ceiling(20)
    while running is None and time.monotonic() < deadline:  # stored as in_progress while it runs
        time.sleep(0.01)
        ids = [k for k, v in list(store._entries.items()) if v.response["status"] == "in_progress"]
        running = ids[0] if ids else None
    assert running is not None
    r = http.post(f"/v1/responses/{running}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    t.join(ceiling(30))
    assert out["r"]["status"] == "cancelled"
    assert http.get(f"/v1/responses/{running}").json()["status"] == "cancelled"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "temperature": "hot"}, "temperature"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ],
)
def test_bad_input_is_400_naming_the_field(http, body, param):
    r = http.post("/v1/responses", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_route_is_counted_and_traced(client, http, span_exporter):
    client.responses.create(model="tiny", input="count me", max_output_tokens=2)
    text = http.get("/metrics").text
    assert 'route="/v1/responses",status="200"' in text
    assert any(
        s.name == "chat tiny" and s.attributes.get("vsurge.request.route") == "/v1/responses"
        for s in span_exporter.get_finished_spans()
    )


def test_translation_is_pure():
    items = normalize_input(
        [
            {"role": "user", "content": "q"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ]
    )
    msgs = items_to_messages(items)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["tool_calls"][0]["function"]["name"] == "f" and msgs[2]["tool_call_id"] == "c1"
    plan = parse_responses(
        {"input": "x", "instructions": "sys"}, [{"type": "message", "role": "user", "content": "a"}]
    )
    assert [m["role"] for m in plan.chat["messages"]] == ["system", "user", "user"]


def test_store_is_bounded_and_expires():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    for i in range(3):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}))
    assert store.get("r0") is None and store.get("r2") is not None and len(store) == 2
    now[0] = 11
    assert store.get("r2") is None
    # the byte bound: big conversations push the oldest out, the newest stays
    big = ResponseStore(max_entries=10, ttl_s=10, max_bytes=3000)
    for i in range(3):
        big.put(f"b{i}", StoredResponse({"id": f"b{i}"}, [{"type": "message", "content": "x" * 1000}]))
    assert big.get("b0") is None and big.get("b2") is not None and big.bytes <= 3000
    big.delete("b2")
    big.delete("b1")
    assert big.bytes == 0 and len(big) == 0


def test_a_stream_left_mid_way_is_stored_incomplete(server, http):
    body = {"model": "tiny", "input": "long", "max_output_tokens": 150, "temperature": 0, "stream": True}
    rid = None
    with http.stream("POST", "/v1/responses", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and rid is None:
                rid = json.loads(line[5:])["response"]["id"]
            if "output_text.delta" in line:
                break  # leave while it still generates
    store = server.api.responses_store

    def ended():
        entry = store.get(rid)
        return entry is not None and entry.cancel is None and entry.response["status"] != "in_progress"

    deadline = time.monotonic() + ceiling(20)
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.02)
    left = store.get(rid).response
    # not the length cut (also "incomplete"): nothing was finished, so no output was stored
    assert left["status"] == "incomplete" and left["output"] == []


def test_stored_response_routes_are_counted_without_their_ids(client, http, span_exporter):
    r = client.responses.create(model="tiny", input="x", max_output_tokens=2)
    client.responses.retrieve(r.id)
    http.post(f"/v1/responses/{r.id}/cancel")
    text = http.get("/metrics").text
    assert 'route="/v1/responses/{response_id}",status="200"' in text
    assert 'route="/v1/responses/{response_id}/cancel",status="400"' in text
    assert r.id not in text
    names = {s.name for s in span_exporter.get_finished_spans()}
    assert {"responses.retrieve tiny", "responses.cancel tiny"} <= names


def test_streamed_function_call_as_the_client_helpers_read_it(client):
    kinds = []
    with client.responses.stream(
        model="tiny",
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
