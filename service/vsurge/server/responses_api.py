"""OpenAI's Responses API, request side: a /v1/responses body -> a chat-completions body. Pure functions.

The translation is the whole trick: `input` items become chat messages (function calls and their outputs
become the assistant's tool_calls and tool messages), `instructions` a system message, `text.format` the
chat `response_format`, function `tools` / `tool_choice` the chat ones; the chat planner then renders the
template and builds the grammar exactly as /v1/chat/completions does. Every refusal names the field of
the Responses request (`param`). The response side is in responses_shapes.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import invalid_request, unsupported_field

# Message roles an input item may have (developer is the system role of newer models).
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields that would change the answer and that this server does not honour: refused, never ignored.
_REFUSED = {
    "background": "responses run in the request; background mode is not supported",
    "conversation": "send previous_response_id, or the conversation as input items",
    "prompt": "prompt templates are not supported; send input",
}
# The chat field a planner error names -> the Responses field the client sent (Call.param_names).
PARAM_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tools": "tools",
    "tool_choice": "tool_choice",
}


@dataclass
class ResponsesPlan:
    """A parsed /v1/responses body: the chat body to plan, and what the response object repeats."""

    chat: dict[str, Any]
    # this request's input items, normalized (what a stored response keeps for a continuation)
    input_items: list[dict[str, Any]]
    # request fields the response object echoes back (instructions, tools, text, ...)
    echo: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None


def _is(value: Any, kind: type, param: str, what: str) -> Any:
    """`value` unless it is set and not of `kind` (a JSON true is never a number here)."""
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise invalid_request(f"Invalid type for '{param}': expected {what}.", param=param)
    return value


def normalize_input(value: Any) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) -> a list of item dicts, each with its `type`."""
    if value is None:
        raise invalid_request("Missing required parameter: 'input'.", param="input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid_request(
            "Invalid value for 'input': expected a string or a non-empty array.", param="input"
        )
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"Invalid type for '{where}': expected an object.", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message_item(item, where))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                _is(item.get(key), str, f"{where}.{key}", "a string")
                if item.get(key) is None:
                    raise invalid_request(
                        f"Missing required parameter: '{where}.{key}'.", param=f"{where}.{key}"
                    )
            out.append({k: item[k] for k in ("type", "call_id", "name", "arguments") if k in item})
        elif kind == "function_call_output":
            _is(item.get("call_id"), str, f"{where}.call_id", "a string")
            if not item.get("call_id"):
                raise invalid_request(
                    f"Missing required parameter: '{where}.call_id'.", param=f"{where}.call_id"
                )
            output = item.get("output")
            if not isinstance(output, str):
                output = _parts_text(output, f"{where}.output", "tool")
            out.append({"type": "function_call_output", "call_id": item["call_id"], "output": output})
        elif kind == "reasoning":
            continue  # a reasoning item of another server's model: no text this model can read
        else:
            raise invalid_request(
                f"Invalid value for '{where}.type': {kind!r}; expected 'message', 'function_call' or "
                "'function_call_output'.",
                param=f"{where}.type",
            )
    return out


def _message_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid_request(
            f"Invalid value for '{where}.role': {role!r}; expected one of {', '.join(_ROLES)}.",
            param=f"{where}.role",
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{where}.content", role)
    return {"type": "message", "role": role, "content": text}


def _parts_text(parts: Any, where: str, role: str) -> str:
    """Content parts -> their text, joined; image, file and audio parts are refused (text-only model)."""
    if not isinstance(parts, list):
        raise invalid_request(
            f"Invalid type for '{where}': expected a string or an array of parts.", param=where
        )
    texts = []
    for j, part in enumerate(parts):
        p = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and role == "assistant":
            texts.append(str(part.get("refusal", "")))
            continue
        if kind not in _TEXT_PARTS:
            if kind in ("input_image", "input_file", "input_audio"):
                raise unsupported_field(f"{p}.type", f"'{kind}' parts are not supported; send text")
            raise invalid_request(
                f"Invalid value for '{p}.type': {kind!r}; expected 'input_text'.", param=f"{p}.type"
            )
        if not isinstance(part.get("text"), str):
            raise invalid_request(f"Invalid value for '{p}.text': expected a string.", param=f"{p}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized input items -> chat messages: a function call joins the assistant turn before it (or
    opens one), its output is a tool message."""
    msgs: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            msgs.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return msgs


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid_request("Invalid type for 'tools': expected an array.", param="tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise unsupported_field(f"{where}.type", f"only 'function' tools are supported, got {kind!r}")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise invalid_request(f"Missing required parameter: '{where}.name'.", param=f"{where}.name")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid_request(
        "Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or "
        '{"type": "function", "name": ...}.',
        param="tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid_request("Invalid type for 'text': expected an object.", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid_request(
                "Missing required parameter: 'text.format.schema'.", param="text.format.schema"
            )
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise invalid_request(
        f"Invalid value for 'text.format.type': {kind!r}; expected 'text', 'json_object' or 'json_schema'.",
        param="text.format.type",
    )


def parse_responses(data: dict[str, Any], history: list[dict[str, Any]] | None) -> ResponsesPlan:
    """A /v1/responses body (and the stored conversation of previous_response_id) -> a ResponsesPlan."""
    for name, why in _REFUSED.items():
        if data.get(name) not in (None, False):
            raise unsupported_field(name, why)
    if data.get("reasoning") is not None:
        raise unsupported_field("reasoning", "this server runs no reasoning model; leave 'reasoning' unset")
    if data.get("top_logprobs"):
        raise unsupported_field("top_logprobs")
    include = _is(data.get("include"), list, "include", "an array") or []
    if include:
        raise unsupported_field("include", f"no extra output is available, got {include!r}")
    if data.get("truncation") not in (None, "disabled"):
        raise unsupported_field("truncation", "only 'disabled' (too long a conversation is a 400)")
    instructions = _is(data.get("instructions"), str, "instructions", "a string")
    prev = _is(data.get("previous_response_id"), str, "previous_response_id", "a string")
    stream = bool(_is(data.get("stream"), bool, "stream", "a boolean"))
    store = _is(data.get("store"), bool, "store", "a boolean")
    max_out = _is(data.get("max_output_tokens"), int, "max_output_tokens", "an integer")
    if max_out is not None and max_out < 1:
        raise invalid_request(
            "Invalid value for 'max_output_tokens': must be >= 1.", param="max_output_tokens"
        )
    items = normalize_input(data.get("input"))
    # instructions are this request's own: a continuation does not inherit the earlier ones (OpenAI)
    msgs = [{"role": "system", "content": instructions}] if instructions else []
    msgs += items_to_messages((history or []) + items)
    chat: dict[str, Any] = {"messages": msgs, "stream": stream}
    for key in ("model", "temperature", "top_p", "user", "parallel_tool_calls", "seed", "top_k"):
        if data.get(key) is not None:
            chat[key] = data[key]
    if max_out is not None:
        chat["max_tokens"] = max_out
    tools = _tools(data.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(data.get("tool_choice"))
    if choice is not None and tools:
        chat["tool_choice"] = choice
    rf = _response_format(data.get("text"))
    if rf is not None:
        chat["response_format"] = rf
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_out,
        "temperature": data.get("temperature"),
        "top_p": data.get("top_p"),
        "tools": data.get("tools") or [],
        "tool_choice": data.get("tool_choice") or "auto",
        "parallel_tool_calls": data.get("parallel_tool_calls") is not False,
        "text": {"format": (data.get("text") or {}).get("format") or {"type": "text"}},
        "metadata": data.get("metadata") or {},
        "user": data.get("user"),
        "previous_response_id": prev,
        "store": store is not False,
    }
    return ResponsesPlan(chat, items, echo, stream, store is not False, prev)
