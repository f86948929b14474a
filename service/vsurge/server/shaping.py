"""Response shaping: engine ReturnSamples -> OpenAI JSON objects (whole responses). Pure functions.

The shapes follow OpenAI's API reference field for field (`chat.completion`, `text_completion`) plus vLLM's
fields, with vLLM's null-vs-absent: a whole response carries every field, null when not asked
(`token_ids`, `prompt_token_ids`, `prompt_logprobs`, `stop_reason` ...), so clients that read them as
attributes work. Streams are shaped in `chunks.py`; logprobs in `logprob_shapes.py`; the wire format in
`wire.py` (all re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vsurge.contracts.request import ReturnSample, TokenLogprob

from .chunks import ChunkWriter
from .logprob_shapes import (
    LOGPROB_FLOOR,
    TokenDecoder,
    chat_logprob_entries,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    prompt_logprob_entries,
    token_id_string,
)
from .wire import SSE_DONE, Extras, dumps, new_id, sse, stop_reason, usage

__all__ = [
    "LOGPROB_FLOOR",
    "SSE_DONE",
    "Choice",
    "ChunkWriter",
    "Collector",
    "Extras",
    "TokenDecoder",
    "chat_message",
    "chat_response",
    "completion_response",
    "dumps",
    "new_id",
    "sse",
    "token_id_string",
    "usage",
]


@dataclass
class Choice:
    """One sample's whole output, accumulated from the engine's deltas."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    generated_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # tool calling (tool_parsers.py): the message's tool_calls, and its content without the call text
    tool_calls: list[dict[str, Any]] | None = None
    content: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Collector:
    """Accumulates ReturnSample deltas of one engine request (n samples) into Choices."""

    def __init__(self, n: int, index_offset: int = 0) -> None:
        self.choices = [Choice(index=index_offset + i) for i in range(n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, samples: Iterable[ReturnSample]) -> None:
        for s in samples:
            if s.prompt_token_ids is not None and s.index == 0:
                self.prompt_token_ids = s.prompt_token_ids
                self.prompt_logprobs = s.prompt_logprobs
                self.cached_tokens = s.num_cached_tokens
            c = self.choices[s.index]
            if s.text:
                c.text_parts.append(s.text)
            c.token_ids.extend(s.token_ids)
            if s.logprobs:
                c.logprobs.extend(s.logprobs)
            c.generated_tokens = max(c.generated_tokens, s.num_generated_tokens)
            if s.num_prompt_tokens:
                self.prompt_tokens = s.num_prompt_tokens
            if s.finish_reason is not None:
                c.finish_reason = s.finish_reason

    @property
    def completion_tokens(self) -> int:
        return sum(c.generated_tokens for c in self.choices)


def chat_message(content: str | None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The assistant message with every field OpenAI's and vLLM's clients read (null when unused);
    `tool_calls` null when there are none: the key is there, so the JSON has the keys a client's parsed
    message has (vLLM's /invocations test compares the two), and clients read null as no calls."""
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        # vLLM's reasoning fields (its older and newer name); no reasoning parser here
        "reasoning_content": None,
        "reasoning": None,
        "tool_calls": tool_calls,
    }
    return msg


def _last(c: Choice) -> int | None:
    return c.token_ids[-1] if c.token_ids else None


def chat_response(
    response_id: str,
    created: int,
    model: str,
    choices: list[Choice],
    prompt_tokens: int,
    decode: Callable[[int], str],
    with_logprobs: bool,
    collector: Collector | None = None,
    extras: Extras | None = None,
) -> dict[str, Any]:
    extras = extras or Extras()
    out = []
    for c in choices:
        if c.tool_calls is None:
            message = chat_message(extras.echo + c.text)
        else:
            content = extras.echo + (c.content or "") if extras.echo else c.content
            message = chat_message(content, c.tool_calls)
        entries = chat_logprob_entries(c.logprobs, decode, not extras.tokens_as_ids)
        out.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(entries) if with_logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": stop_reason(c.finish_reason, _last(c), extras),
                "token_ids": c.token_ids if extras.return_token_ids else None,
            }
        )
    prompt_lps = None
    if collector is not None and extras.prompt_logprobs:
        prompt_lps = prompt_logprob_entries(collector.prompt_logprobs, decode)
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out,
        # OpenAI's newer chat.completion fields (the openai client's model has them): null here
        "metadata": None,
        "moderation": None,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(prompt_tokens, sum(c.generated_tokens for c in choices), extras.cached_tokens),
        "prompt_logprobs": prompt_lps,
        "prompt_token_ids": collector.prompt_token_ids
        if collector is not None and extras.return_token_ids
        else None,
        "kv_transfer_params": None,
    }


def completion_response(
    response_id: str,
    created: int,
    model: str,
    choices: list[Choice],
    prompt_tokens: int,
    decode: Callable[[int], str],
    with_logprobs: bool,
    with_top: bool = True,
    echo_prefixes: list[str] | None = None,
    collectors: list[Collector] | None = None,
    extras: Extras | None = None,
) -> dict[str, Any]:
    """`collectors[k]` is the engine request of choice k's prompt (for echo logprobs and extras)."""
    extras = extras or Extras()
    out = []
    for k, c in enumerate(choices):
        prefix = echo_prefixes[k] if echo_prefixes else ""
        col = collectors[k] if collectors else None
        lps = None
        if with_logprobs:
            if echo_prefixes and col is not None:
                head, _ = echo_logprobs(col.prompt_token_ids, col.prompt_logprobs, decode)
                lps = join_logprobs(head, completion_logprobs(c.logprobs, decode, len(prefix))[0])
            else:
                lps = completion_logprobs(c.logprobs, decode, len(prefix), with_top)[0]
        asked_ids = col is not None and extras.return_token_ids
        out.append(
            {
                "index": c.index,
                "text": prefix + c.text,
                "logprobs": lps,
                "finish_reason": c.finish_reason,
                "stop_reason": stop_reason(c.finish_reason, _last(c), extras),
                "token_ids": c.token_ids if asked_ids else None,
                "prompt_logprobs": prompt_logprob_entries(col.prompt_logprobs, decode)
                if col is not None and extras.prompt_logprobs
                else None,
                "prompt_token_ids": col.prompt_token_ids if asked_ids else None,
            }
        )
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        # OpenAI's newer chat.completion fields (the openai client's model has them): null here
        "metadata": None,
        "moderation": None,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(prompt_tokens, sum(c.generated_tokens for c in choices), extras.cached_tokens),
        "kv_transfer_params": None,
    }
