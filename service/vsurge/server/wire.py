"""The wire format shared by whole responses and streams: compact JSON, SSE frames, ids, usage, and the
per-request options (`Extras`) that add vLLM's fields to OpenAI's shapes. Pure functions."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"

# ensure_ascii: model output may hold U+2028, U+2029 or U+0085, which JSON leaves unescaped but
# line-splitting SSE clients (str.splitlines) treat as line ends; escaping them keeps every frame one line.
_dumps = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode


def new_id(prefix: str, request_id: str | None = None) -> str:
    """`<prefix>-<hex>`; vLLM's `request_id` field, when the client sent one, replaces the hex."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(obj).encode("ascii") + b"\n\n"


def dumps(obj: Any) -> bytes:
    return _dumps(obj).encode()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # prompt tokens whose KV came from the prefix cache (oDriver; vDriver has none)
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class Extras:
    """What a response carries beyond OpenAI's fields, per request (vLLM's extensions)."""

    return_token_ids: bool = False
    prompt_logprobs: bool = False
    cached_tokens: int = 0
    # logprobs' tokens as "token_id:<id>": chat entries then carry null bytes
    tokens_as_ids: bool = False
    # the client's stop_token_ids: a choice that ended on one reports it as stop_reason
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    # chat echo: the text every choice's content starts with
    echo: str = ""


def stop_reason(finish_reason: str | None, last_token: int | None, extras: Extras) -> int | None:
    """vLLM's stop_reason: the stop token id that ended the choice; None for EOS, length and the rest.
    (A stop string is left out of the text before it reaches the server, so it cannot be named here.)"""
    if finish_reason == "stop" and last_token is not None and last_token in extras.stop_token_ids:
        return last_token
    return None
