"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): a Messages body -> a chat-completions
body, and the chat outcome -> Anthropic's `message` object and stream events. Pure functions.

Content blocks map onto chat messages: text blocks join into the message's text, an assistant's
`tool_use` blocks become its tool_calls, a user's `tool_result` blocks become tool messages (before the
user's own text); `system` is the system message; `tools` (input_schema) and `tool_choice` (auto / any /
tool / none) become the chat ones, so the chat template, the tool grammar and the tool-call parser are
those of /v1/chat/completions. Errors keep Anthropic's envelope (`{"type": "error", "error": {...}}`) with
OpenAI's fields inside (`message`, `type`, `param`, `code`), so the field at fault is named either way.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .chat_runs import ChatOutcome
from .errors import APIError, invalid_request, unsupported_field
from .wire import dumps

# The chat field a planner error names -> the Messages field the client sent.
PARAM_NAMES = {"messages": "messages", "max_tokens": "max_tokens", "stop": "stop_sequences"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def _text_blocks(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise invalid_request(
            f"Invalid type for '{where}': expected a string or an array of blocks.", param=where
        )
    texts = []
    for j, b in enumerate(blocks):
        p = f"{where}[{j}]"
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind in ("image", "document"):
                raise unsupported_field(f"{p}.type", f"'{kind}' blocks are not supported; send text")
            raise invalid_request(f"Invalid value for '{p}': expected a text block.", param=p)
        texts.append(b["text"])
    return "\n".join(texts)


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise invalid_request(
            f"Invalid value for '{where}.role': expected 'user' or 'assistant'.", param=f"{where}.role"
        )
    role, content = m["role"], m.get("content")
    if content is None:
        raise invalid_request(f"Missing required parameter: '{where}.content'.", param=f"{where}.content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid_request(f"Invalid type for '{where}.content'.", param=f"{where}.content")
    texts, calls, results = [], [], []
    for j, b in enumerate(content):
        p = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise invalid_request(f"'{p}' needs a string 'id' and 'name'.", param=p)
            args = json.dumps(b.get("input") or {}, ensure_ascii=False)
            calls.append(
                {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}}
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise invalid_request(
                    f"Missing required parameter: '{p}.tool_use_id'.", param=f"{p}.tool_use_id"
                )
            text = _text_blocks(b.get("content", ""), f"{p}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif kind in ("image", "document", "thinking", "redacted_thinking"):
            raise unsupported_field(f"{p}.type", f"'{kind}' blocks are not supported")
        else:
            raise invalid_request(f"Invalid value for '{p}.type': {kind!r}.", param=f"{p}.type")
    out = results
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out = out + [msg]
    return out


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    if tools is None:
        if choice is not None:
            raise invalid_request("'tool_choice' needs 'tools'.", param="tool_choice")
        return {}
    if not isinstance(tools, list):
        raise invalid_request("Invalid type for 'tools': expected an array.", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise invalid_request(f"Missing required parameter: 'tools[{i}].name'.", param=f"tools[{i}].name")
        if t.get("type") not in (None, "custom"):
            raise unsupported_field(f"tools[{i}].type", f"server tools are not supported, got {t['type']!r}")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    body: dict[str, Any] = {"tools": out}
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool" and isinstance(choice.get("name"), str):
            mapped = {"type": "function", "function": {"name": choice["name"]}}
        if mapped is None:
            raise invalid_request("Invalid value for 'tool_choice.type'.", param="tool_choice.type")
        body["tool_choice"] = mapped
        if choice.get("disable_parallel_tool_use"):
            body["parallel_tool_calls"] = False
    return body


def messages_to_chat(data: dict[str, Any], *, count_only: bool = False) -> dict[str, Any]:
    """A /v1/messages body -> a chat-completions body (raises APIError naming the Messages field)."""
    thinking = data.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise unsupported_field("thinking", "this server runs no extended-thinking model")
    if not count_only:
        mt = data.get("max_tokens")
        if mt is None:
            raise invalid_request("Missing required parameter: 'max_tokens'.", param="max_tokens")
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise invalid_request(
                "Invalid value for 'max_tokens': expected an integer >= 1.", param="max_tokens"
            )
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid_request("'messages' must be a non-empty array.", param="messages")
    chat_msgs: list[dict[str, Any]] = []
    if data.get("system") is not None:
        chat_msgs.append({"role": "system", "content": _text_blocks(data["system"], "system")})
    for i, m in enumerate(msgs):
        chat_msgs += _message(m, i)
    chat: dict[str, Any] = {"messages": chat_msgs, **_tools(data.get("tools"), data.get("tool_choice"))}
    for key in ("model", "temperature", "top_p", "top_k", "max_tokens", "stream"):
        if data.get(key) is not None:
            chat[key] = data[key]
    stops = data.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid_request(
                "'stop_sequences' must be an array of non-empty strings.", param="stop_sequences"
            )
        chat["stop"] = stops
    if count_only:
        chat.pop("stream", None)
    return chat


def stop_details(outcome: ChatOutcome, stops: list[str], full_text: str) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a stop string is cut from the text, so the one that ended it is the
    one the whole decoded output continues with after the text."""
    if outcome.tool_calls:
        return "tool_use", None
    if outcome.finish_reason in _STOP_REASONS:
        return _STOP_REASONS[outcome.finish_reason], None
    rest = full_text[len(outcome.text) :] if full_text.startswith(outcome.text) else full_text
    for s in stops:
        if s in rest or (s in full_text and s not in outcome.text):
            return "stop_sequence", s
    return "end_turn", None


def content_blocks(outcome: ChatOutcome) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    text = outcome.content if outcome.tool_calls else outcome.text
    if text:
        blocks.append({"type": "text", "text": text})
    for c in outcome.tool_calls or []:
        blocks.append(
            {
                "type": "tool_use",
                "id": "toolu_" + c["id"].removeprefix("call_"),
                "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"] or "{}"),
            }
        )
    return blocks


def anthropic_usage(outcome: ChatOutcome) -> dict[str, Any]:
    return {
        "input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
        "output_tokens": outcome.completion_tokens,
        "cache_read_input_tokens": outcome.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def message_object(
    msg_id: str, model: str, blocks: list[dict[str, Any]], stop: tuple[str | None, str | None], usage: dict
) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def error_body(err: APIError) -> bytes:
    """Anthropic's error envelope around OpenAI's error fields."""
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(err.status)
    inner = err.body()["error"]
    inner["type"] = kind or ("invalid_request_error" if err.status < 500 else "api_error")
    return dumps({"type": "error", "error": inner})


def event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **fields}) + b"\n\n"
