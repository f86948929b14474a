"""Response shaping: engine ReturnSamples -> OpenAI JSON objects and SSE frames. Pure functions.

The shapes follow OpenAI's API reference field for field (`chat.completion`, `chat.completion.chunk`,
`text_completion`), including the `usage: null` on every chunk when `stream_options.include_usage` is set
and the final chunk with empty `choices` that carries the usage.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vsurge.request import ReturnSample, TokenLogprob

SSE_DONE = b"data: [DONE]\n\n"
# JSON has no -inf; OpenAI-compatible servers send a large negative number for impossible tokens.
LOGPROB_FLOOR = -9999.0

# ensure_ascii: model output may hold U+2028, U+2029 or U+0085, which JSON leaves unescaped but
# line-splitting SSE clients (str.splitlines) treat as line ends; escaping them keeps every frame one line.
_dumps = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(obj).encode("ascii") + b"\n\n"


def dumps(obj: Any) -> bytes:
    return _dumps(obj).encode()


def _lp(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) else LOGPROB_FLOOR


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # prompt tokens whose KV came from the prefix cache (oDriver; vDriver has none)
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class TokenDecoder:
    """Token id -> its text for logprobs, cached: the same few thousand ids recur across requests."""

    def __init__(self, processor: Any, limit: int = 65536) -> None:
        self._processor = processor
        self._cache: dict[int, str] = {}
        self._limit = limit

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            if self._processor is None:
                s = f"<{token_id}>"
            else:
                # A lone byte of a multi-byte character decodes to U+FFFD, as in OpenAI's output.
                s = self._processor.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < self._limit:
                self._cache[token_id] = s
        return s


# -------------------------------------------------------------------------------------------- logprobs


def chat_logprob_entries(
    logprobs: Iterable[TokenLogprob], decode: Callable[[int], str]
) -> list[dict[str, Any]]:
    out = []
    for lp in logprobs:
        tok = decode(lp.token_id)
        out.append(
            {
                "token": tok,
                "logprob": _lp(lp.logprob),
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := decode(tid)), "logprob": _lp(v), "bytes": list(t.encode("utf-8"))}
                    for tid, v in lp.top
                ],
            }
        )
    return out


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": entries, "refusal": None}


def _top_dict(lp: TokenLogprob, decode: Callable[[int], str]) -> dict[str, float]:
    """Legacy top_logprobs entry: the top N and the chosen token itself (OpenAI: up to N + 1 entries)."""
    top: dict[str, float] = {}
    # ids that decode alike (bytes of one character all read as U+FFFD) keep the likeliest value
    for tid, v in [*lp.top, (lp.token_id, lp.logprob)]:
        key = decode(tid)
        top[key] = max(top.get(key, -math.inf), _lp(v))
    return top


def completion_logprobs(
    logprobs: Iterable[TokenLogprob | None], decode: Callable[[int], str], offset: int, with_top: bool = True
) -> tuple[dict[str, Any], int]:
    """Legacy completions logprobs; `offset` is the character offset of the first token in the text.

    An entry of None is the first prompt token of an echo (nothing precedes it): null logprob and top.
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in logprobs:
        if lp is None:
            continue
        tok = decode(lp.token_id)
        tokens.append(tok)
        token_lps.append(_lp(lp.logprob))
        offsets.append(offset)
        offset += len(tok)
        tops.append(_top_dict(lp, decode))
    return (
        {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops if with_top else None,
            "text_offset": offsets,
        },
        offset,
    )


def echo_logprobs(
    prompt_ids: list[int], prompt_lps: list[TokenLogprob | None] | None, decode: Callable[[int], str]
) -> tuple[dict[str, Any], int]:
    """The prompt's part of an echoed completion's logprobs: its first token has null logprob and top."""
    lps = list(prompt_lps or [])
    first = prompt_ids[0] if prompt_ids else None
    body, offset = completion_logprobs(lps[1:], decode, len(decode(first)) if first is not None else 0)
    if first is not None:
        body["tokens"].insert(0, decode(first))
        body["token_logprobs"].insert(0, None)
        body["top_logprobs"].insert(0, None)
        body["text_offset"].insert(0, 0)
    return body, offset


def join_logprobs(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    return {k: head[k] + tail[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prompt_logprob_entries(
    prompt_lps: list[TokenLogprob | None] | None, decode: Callable[[int], str]
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: None for the first token, then {id: {logprob, rank, decoded_token}} holding
    the prompt token and the top k."""
    if prompt_lps is None:
        return None
    out: list[dict[str, Any] | None] = []
    for lp in prompt_lps:
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(tid): {"logprob": _lp(v), "rank": r, "decoded_token": decode(tid)}
            for r, (tid, v) in enumerate(lp.top, start=1)
        }
        entry[str(lp.token_id)] = {
            "logprob": _lp(lp.logprob),
            "rank": lp.rank,
            "decoded_token": decode(lp.token_id),
        }
        out.append(entry)
    return out


# ------------------------------------------------------------------------------------- non-streaming


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


@dataclass
class Extras:
    """What a response carries beyond OpenAI's fields, per engine request (vLLM's extensions)."""

    return_token_ids: bool = False
    prompt_logprobs: bool = False
    cached_tokens: int = 0


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
        choice = {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text, "refusal": None}
            if c.tool_calls is None
            else {"role": "assistant", "content": c.content, "refusal": None, "tool_calls": c.tool_calls},
            "logprobs": chat_logprobs(chat_logprob_entries(c.logprobs, decode)) if with_logprobs else None,
            "finish_reason": c.finish_reason,
        }
        if extras.return_token_ids:
            choice["token_ids"] = c.token_ids
        out.append(choice)
    obj = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, sum(c.generated_tokens for c in choices), extras.cached_tokens),
        "system_fingerprint": None,
    }
    if collector is not None and extras.return_token_ids:
        obj["prompt_token_ids"] = collector.prompt_token_ids
    if collector is not None and extras.prompt_logprobs:
        obj["prompt_logprobs"] = prompt_logprob_entries(collector.prompt_logprobs, decode)
    return obj


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
        choice = {
            "index": c.index,
            "text": prefix + c.text,
            "logprobs": lps,
            "finish_reason": c.finish_reason,
        }
        if col is not None and extras.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprob_entries(col.prompt_logprobs, decode)
        if col is not None and extras.return_token_ids:
            choice["prompt_token_ids"] = col.prompt_token_ids
            choice["token_ids"] = c.token_ids
        out.append(choice)
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, sum(c.generated_tokens for c in choices), extras.cached_tokens),
        "system_fingerprint": None,
    }


# ----------------------------------------------------------------------------------------- streaming


class ChunkWriter:
    """Builds the SSE frames of one streamed response (chat or text completion).

    Keeps the per-choice state a stream needs: whether the role chunk went out, character offsets for
    legacy logprobs, token counts for usage.
    """

    def __init__(
        self,
        *,
        operation: str,
        response_id: str,
        created: int,
        model: str,
        decode: Callable[[int], str],
        with_logprobs: bool,
        with_top: bool,
        include_usage: bool,
        continuous_usage: bool = False,
        extras: Extras | None = None,
        echo_texts: list[str] | None = None,
    ) -> None:
        self.chat = operation == "chat"
        self.extras = extras or Extras()
        # completions' echo: choice i opens with its prompt (and, with logprobs, the prompt's logprobs,
        # which arrive with the choice's first delta), so the frame waits for that delta
        self.echo_texts = echo_texts
        self.echoed: set[int] = set()
        self.cached: dict[int, int] = {}
        self._extras_on = self.extras.return_token_ids or self.extras.prompt_logprobs
        self.head = {
            "id": response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": model,
        }
        self.decode = decode
        self.with_logprobs = with_logprobs
        self.with_top = with_top
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage and include_usage
        self.offsets: dict[int, int] = {}
        self.generated: dict[int, int] = {}
        self.prompt_tokens: dict[int, int] = {}  # per engine request (keyed by its first choice index)

    def _frame(self, choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        obj = {**self.head, "choices": choices, **(extra or {})}
        if self.chat:
            obj["system_fingerprint"] = None
        if self.include_usage:
            obj["usage"] = self._usage() if self.continuous_usage else None
        return sse(obj)

    def _usage(self) -> dict[str, Any]:
        return usage(
            sum(self.prompt_tokens.values()), sum(self.generated.values()), sum(self.cached.values())
        )

    def role_frames(self, indices: Iterable[int]) -> bytes:
        """Chat streams open each choice with a role-only delta, as OpenAI does."""
        if not self.chat:
            return b""
        return b"".join(
            self._frame(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for i in indices
        )

    def echo_frame(self, index: int, text: str, sample: ReturnSample | None = None) -> bytes:
        self.echoed.add(index)
        self.offsets[index] = len(text)
        lps = None
        if self.with_logprobs and sample is not None:
            lps, _ = echo_logprobs(sample.prompt_token_ids or [], sample.prompt_logprobs, self.decode)
        return self._frame([{"index": index, "text": text, "logprobs": lps, "finish_reason": None}])

    def frames(self, samples: Iterable[ReturnSample], index_offset: int = 0, request_key: int = 0) -> bytes:
        """One frame per sample that has something to say (text, logprobs or a finish reason)."""
        parts = []
        for s in samples:
            i = index_offset + s.index
            if s.num_prompt_tokens:
                self.prompt_tokens[request_key] = s.num_prompt_tokens
            first = s.prompt_token_ids is not None
            if first and s.index == 0:
                self.cached[request_key] = s.num_cached_tokens
            if self.echo_texts is not None and i not in self.echoed:
                parts.append(self.echo_frame(i, self.echo_texts[i], s))
            self.generated[i] = max(self.generated.get(i, 0), s.num_generated_tokens)
            if not s.text and not s.logprobs and s.finish_reason is None and not (first and self._extras_on):
                continue  # e.g. the detokenizer is holding back half of a UTF-8 character
            lps = None
            if self.with_logprobs:
                if self.chat:
                    lps = chat_logprobs(chat_logprob_entries(s.logprobs or [], self.decode))
                else:
                    lps, self.offsets[i] = completion_logprobs(
                        s.logprobs or [], self.decode, self.offsets.get(i, 0), self.with_top
                    )
            elif not self.chat:
                self.offsets[i] = self.offsets.get(i, 0) + len(s.text)
            if self.chat:
                delta = {"content": s.text} if s.text else {}
                choice = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": s.finish_reason}
            else:
                choice = {"index": i, "text": s.text, "logprobs": lps, "finish_reason": s.finish_reason}
            extra: dict[str, Any] = {}
            if self.extras.return_token_ids:
                choice["token_ids"] = s.token_ids
                if first:
                    (extra if self.chat else choice)["prompt_token_ids"] = s.prompt_token_ids
            if self.extras.prompt_logprobs and first:
                (extra if self.chat else choice)["prompt_logprobs"] = prompt_logprob_entries(
                    s.prompt_logprobs, self.decode
                )
            parts.append(self._frame([choice], extra))
        return b"".join(parts)

    def tool_call_frames(
        self, index: int, content: str | None, tool_calls: list[dict[str, Any]], finish_reason: str | None
    ) -> bytes:
        """A tool-mode choice's answer, once its text is complete: its content (if any), then one delta per
        call carrying id, type, name and the whole arguments (OpenAI's first-delta shape), then the finish."""
        parts = []
        if content:
            parts.append(
                self._frame(
                    [{"index": index, "delta": {"content": content}, "logprobs": None, "finish_reason": None}]
                )
            )
        for k, call in enumerate(tool_calls):
            delta = {"tool_calls": [{"index": k, **call}]}
            parts.append(
                self._frame([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
            )
        parts.append(
            self._frame([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
        )
        return b"".join(parts)

    def usage_frame(self) -> bytes:
        if not self.include_usage:
            return b""
        obj = {**self.head, "choices": [], "usage": self._usage()}
        if self.chat:
            obj["system_fingerprint"] = None
        return sse(obj)

    @staticmethod
    def error_frame(body: dict[str, Any]) -> bytes:
        # After the 200 headers went out an error can only travel in-band; the openai client raises on it.
        return sse(body)
