"""OpenAI's Responses API, response side: the `response` object, its output items, its usage, and the typed
stream events (`event: <type>` + `data: {...}` with a `sequence_number`) in the order the official client's
stream helpers accumulate them. Pure functions."""

from __future__ import annotations

import uuid
from typing import Any

from .chat_runs import ChatOutcome
from .wire import dumps


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(msg_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant", "content": content}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A chat tool call -> a function_call output item; `call_id` is the id the client answers with."""
    fn = call["function"]
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }


def output_items(outcome: ChatOutcome, msg_id: str) -> list[dict[str, Any]]:
    """The message (when there is text, or nothing else) and one function_call item per call."""
    status = "incomplete" if outcome.finish_reason == "length" else "completed"
    items = []
    text = outcome.content if outcome.tool_calls else outcome.text
    if text or not outcome.tool_calls:
        items.append(message_item(msg_id, text or "", status))
    items += [call_item(c) for c in outcome.tool_calls or []]
    return items


def as_input_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the input items a continuation (previous_response_id) starts from."""
    out = []
    for it in output:
        if it["type"] == "message":
            text = "".join(p.get("text", "") for p in it["content"])
            out.append({"type": "message", "role": "assistant", "content": text})
        elif it["type"] == "function_call":
            out.append({k: it[k] for k in ("type", "call_id", "name", "arguments")})
    return out


def response_object(
    response_id: str,
    created: int,
    model: str,
    echo: dict[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `response` object with every field the client's model reads (null when unused)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "model": model,
        "output": output or [],
        "usage": usage,
        "reasoning": None,
        "truncation": "disabled",
        "service_tier": "default",
        **echo,
    }


def final_status(outcome: ChatOutcome) -> str:
    return "incomplete" if outcome.finish_reason == "length" else "completed"


class EventWriter:
    """Typed SSE events with increasing sequence numbers."""

    def __init__(self) -> None:
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(obj) + b"\n\n"

    def text_open(self, msg_id: str, index: int) -> bytes:
        return self.event(
            "response.output_item.added", output_index=index, item=message_item(msg_id, None, "in_progress")
        ) + self.event(
            "response.content_part.added",
            item_id=msg_id,
            output_index=index,
            content_index=0,
            part=text_part(""),
        )

    def text_delta(self, msg_id: str, index: int, delta: str) -> bytes:
        return self.event(
            "response.output_text.delta",
            item_id=msg_id,
            output_index=index,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def text_close(self, item: dict[str, Any], index: int) -> bytes:
        text = item["content"][0]["text"] if item["content"] else ""
        msg_id = item["id"]
        return (
            self.event(
                "response.output_text.done",
                item_id=msg_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            + self.event(
                "response.content_part.done",
                item_id=msg_id,
                output_index=index,
                content_index=0,
                part=text_part(text),
            )
            + self.event("response.output_item.done", output_index=index, item=item)
        )

    def call(self, item: dict[str, Any], index: int) -> bytes:
        """A whole function call: added (no arguments yet), its arguments in one delta, done."""
        return (
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            + self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            )
            + self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            + self.event("response.output_item.done", output_index=index, item=item)
        )
