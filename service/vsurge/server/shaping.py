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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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


def completion_logprobs(
    logprobs: Iterable[TokenLogprob], decode: Callable[[int], str], offset: int, with_top: bool
) -> tuple[dict[str, Any], int]:
    """Legacy completions logprobs; `offset` is the character offset of the first token in the text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in logprobs:
        tok = decode(lp.token_id)
        tokens.append(tok)
        token_lps.append(_lp(lp.logprob))
        offsets.append(offset)
        offset += len(tok)
        if with_top:
            tops.append({decode(tid): _lp(v) for tid, v in lp.top})
    return (
        {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops if with_top else None,
            "text_offset": offsets,
        },
        offset,
    )


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

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Collector:
    """Accumulates ReturnSample deltas of one engine request (n samples) into Choices."""

    def __init__(self, n: int, index_offset: int = 0) -> None:
        self.choices = [Choice(index=index_offset + i) for i in range(n)]
        self.prompt_tokens = 0

    def add(self, samples: Iterable[ReturnSample]) -> None:
        for s in samples:
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


def chat_response(
    response_id: str,
    created: int,
    model: str,
    choices: list[Choice],
    prompt_tokens: int,
    decode: Callable[[int], str],
    with_logprobs: bool,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": chat_logprobs(chat_logprob_entries(c.logprobs, decode))
                if with_logprobs
                else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(prompt_tokens, sum(c.generated_tokens for c in choices)),
        "system_fingerprint": None,
    }


def completion_response(
    response_id: str,
    created: int,
    model: str,
    choices: list[Choice],
    prompt_tokens: int,
    decode: Callable[[int], str],
    with_logprobs: bool,
    with_top: bool,
    echo_prefixes: list[str] | None = None,
) -> dict[str, Any]:
    out = []
    for c in choices:
        prefix = echo_prefixes[c.index] if echo_prefixes else ""
        lps = completion_logprobs(c.logprobs, decode, len(prefix), with_top)[0] if with_logprobs else None
        out.append(
            {"index": c.index, "text": prefix + c.text, "logprobs": lps, "finish_reason": c.finish_reason}
        )
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, sum(c.generated_tokens for c in choices)),
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
    ) -> None:
        self.chat = operation == "chat"
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

    def _frame(self, choices: list[dict[str, Any]]) -> bytes:
        obj = {**self.head, "choices": choices}
        if self.chat:
            obj["system_fingerprint"] = None
        if self.include_usage:
            obj["usage"] = self._usage() if self.continuous_usage else None
        return sse(obj)

    def _usage(self) -> dict[str, int]:
        return usage(sum(self.prompt_tokens.values()), sum(self.generated.values()))

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

    def echo_frame(self, index: int, text: str) -> bytes:
        self.offsets[index] = len(text)
        return self._frame([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])

    def frames(self, samples: Iterable[ReturnSample], index_offset: int = 0, request_key: int = 0) -> bytes:
        """One frame per sample that has something to say (text, logprobs or a finish reason)."""
        parts = []
        for s in samples:
            i = index_offset + s.index
            if s.num_prompt_tokens:
                self.prompt_tokens[request_key] = s.num_prompt_tokens
            self.generated[i] = max(self.generated.get(i, 0), s.num_generated_tokens)
            if not s.text and not s.logprobs and s.finish_reason is None:
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
            parts.append(self._frame([choice]))
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
