"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the real server and the official
`anthropic` client, on the suite's tiny random model: a whole message (system, content blocks, usage), the
stream as the client's helpers parse it (message_start ... message_stop), stop_sequences, a tool_use /
tool_result round trip, count_tokens equal to the prompt the generation saw, and bad input as 400s naming
the field inside Anthropic's error envelope."""

from __future__ import annotations

import anthropic
import jsonschema
import pytest

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_whole_message(claude, client):
    m = claude.messages.create(
        model="tiny",
        max_tokens=6,
        system="Be brief.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        extra_body={"temperature": 0},
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6
    assert m.content[0].type == "text" and m.content[0].text
    # the same conversation through chat completions: same prompt tokens, same greedy text
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=6,
        temperature=0,
    )
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.content[0].text == chat.choices[0].message.content
    counted = claude.messages.count_tokens(
        model="tiny", system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_stream_events_and_text(claude):
    kinds = []
    with claude.messages.stream(
        model="tiny",
        max_tokens=12,
        messages=[{"role": "user", "content": "Tell me"}],
        extra_body={"temperature": 0},
    ) as stream:
        for ev in stream:
            kinds.append(ev.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert "content_block_delta" in kinds or "text" in kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    whole = claude.messages.create(
        model="tiny",
        max_tokens=12,
        messages=[{"role": "user", "content": "Tell me"}],
        extra_body={"temperature": 0},
    )
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


def test_stop_sequences(claude):
    free = claude.messages.create(
        model="tiny",
        max_tokens=20,
        messages=[{"role": "user", "content": "abc"}],
        extra_body={"temperature": 0},
    )
    text = free.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    m = claude.messages.create(
        model="tiny",
        max_tokens=20,
        messages=[{"role": "user", "content": "abc"}],
        extra_body={"temperature": 0},
        stop_sequences=[stop],
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text and text.startswith(m.content[0].text)


def test_tool_use_round_trip(claude):
    first = claude.messages.create(
        model="tiny",
        max_tokens=60,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    second = claude.messages.create(
        model="tiny",
        max_tokens=4,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "7 C"}],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "none"},
        extra_body={"temperature": 0},
    )
    assert second.content[0].type == "text" and second.usage.input_tokens > first.usage.input_tokens
    # streamed tool use: the input arrives as input_json_delta and the helper rebuilds it
    with claude.messages.stream(
        model="tiny",
        max_tokens=60,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    jsonschema.validate(final.content[-1].input, WEATHER["input_schema"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]},
            "stop_sequences",
        ),
        ({"max_tokens": 100000, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            "temperature",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "enabled"},
            },
            "thinking",
        ),
    ],
)
def test_bad_input_is_400_naming_the_field(http, body, param):
    r = http.post("/v1/messages", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["param"] == param


def test_client_raises_bad_request(claude):
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "x"}])


def test_counted_and_traced(claude, http, span_exporter):
    claude.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert 'route="/v1/messages",status="200"' in http.get("/metrics").text
    assert any(
        s.attributes.get("vsurge.request.route") == "/v1/messages" for s in span_exporter.get_finished_spans()
    )
    claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert any(s.name == "count_tokens tiny" for s in span_exporter.get_finished_spans())


def test_the_anthropic_clients_api_key_header(server, surge):  # server: the engine runs
    """The anthropic client sends its key as `x-api-key`: a server with an API key takes it there too."""
    from vsurge.server import start, vSurgeApiServer

    running = start(
        vSurgeApiServer({"tiny": surge}, api_key="sekrit", owns_engines=False),
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        warm_up=False,
        progress=None,
    )
    try:
        running.api.mark_ready()
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        ok = anthropic.Anthropic(base_url=running.url, api_key="sekrit", max_retries=0)
        assert ok.messages.create(**body).usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=running.url, api_key="wrong", max_retries=0).messages.create(**body)
    finally:
        running.stop()
