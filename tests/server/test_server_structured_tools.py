"""Tool-call text -> OpenAI tool_calls, per family (pure functions), and the parser picked from a template."""

from __future__ import annotations

import json

from vsurge.server.structured_outputs import parse_tools, tool_grammar
from vsurge.server.tool_parsers import parse_auto, parser_for_template, resolve_choice

NAMES = {"get_weather", "get_time"}


def test_hermes_calls_and_content():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    content, calls = parse_auto(text, "hermes", NAMES)
    assert content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"zone": "UTC"}),
    ]
    # an unknown tool or broken JSON stays text
    assert parse_auto('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "hermes", NAMES)[1] == []
    assert parse_auto("<tool_call>{oops</tool_call>", "hermes", NAMES)[1] == []


def test_llama3_json_and_mistral():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}'
    content, calls = parse_auto(text, "llama3_json", NAMES)
    assert content is None and [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "a;b"}
    assert parse_auto("The weather is fine.", "llama3_json", NAMES) == ("The weather is fine.", [])
    text = 'ok [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]'
    content, calls = parse_auto(text, "mistral", NAMES)
    assert content == "ok" and calls[0]["name"] == "get_time"


class _Tok:
    def __init__(self, template):
        self.chat_template = template


def test_parser_from_template():
    assert parser_for_template(_Tok("{{ '[TOOL_CALLS]' }}")) == "mistral"
    assert (
        parser_for_template(_Tok("<|start_header_id|>{{ tool.parameters }}<|python_tag|>")) == "llama3_json"
    )
    assert parser_for_template(_Tok("<tool_call>{{ tools }}</tool_call>")) == "hermes"
    assert parser_for_template(_Tok(None)) == "hermes"


def test_forced_choices_resolve_to_tool_calls():
    tool = {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    }
    plan = parse_tools([tool], "required", False)
    spec = tool_grammar(plan)
    assert json.loads(spec.source)["maxItems"] == 1
    content, calls, finish = resolve_choice('[{"name": "get_time", "arguments": {}}]', "stop", plan)
    assert content is None and finish == "tool_calls" and calls[0]["function"]["name"] == "get_time"
    assert calls[0]["id"].startswith("call_")
    # cut off by max_tokens: the text stays content
    assert resolve_choice('[{"name": "get_t', "length", plan) == ('[{"name": "get_t', None, "length")
    named = parse_tools([tool], {"type": "function", "function": {"name": "get_time"}}, None)
    content, calls, finish = resolve_choice("{}", "stop", named)
    assert finish == "stop" and calls[0]["function"]["arguments"] == "{}"
