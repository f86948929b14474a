"""Streamed responses: engine ReturnSamples -> SSE frames (`chat.completion.chunk` and streamed
`text_completion`). Pure, apart from the per-stream state ChunkWriter keeps.

OpenAI's shapes, including the `usage: null` on every chunk when `stream_options.include_usage` is set and
the final chunk with empty `choices` that carries the usage; vLLM's additions as vLLM streams them: a chat
stream's first chunk carries `prompt_token_ids` (and later chunks do not have the key), every text delta has a
`content` (possibly ""), completions chunks carry `stop_reason`, and `token_ids` when asked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vsurge.contracts.request import ReturnSample

from .logprob_shapes import chat_logprob_entries, chat_logprobs, completion_logprobs, echo_logprobs
from .logprob_shapes import prompt_logprob_entries as _prompt_lps
from .wire import Extras, sse, stop_reason, usage


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
        # chat: the prompt's ids and logprobs travel on the first chunk (the role chunk) only
        self._chat_prompt_sent = False
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

    def _chat_prompt_extra(self, sample: ReturnSample | None) -> dict[str, Any]:
        """prompt_token_ids / prompt_logprobs for the chat stream's first chunk, once."""
        if self._chat_prompt_sent or sample is None or sample.prompt_token_ids is None:
            return {}
        self._chat_prompt_sent = True
        extra: dict[str, Any] = {}
        if self.extras.return_token_ids:
            extra["prompt_token_ids"] = sample.prompt_token_ids
        if self.extras.prompt_logprobs:
            extra["prompt_logprobs"] = _prompt_lps(sample.prompt_logprobs, self.decode)
        return extra

    def role_frames(self, indices: Iterable[int], first: ReturnSample | None = None) -> bytes:
        """Chat streams open each choice with a role-only delta, as OpenAI does; the first one carries the
        prompt's ids when asked (taken from ``first``, the request's first sample), and chat echo follows."""
        if not self.chat:
            return b""
        out = []
        for i in indices:
            choice = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            out.append(self._frame([choice], self._chat_prompt_extra(first) if self._extras_on else None))
            if self.extras.echo:
                delta = {"content": self.extras.echo}
                out.append(
                    self._frame([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
                )
        return b"".join(out)

    def echo_frame(self, index: int, text: str, sample: ReturnSample | None = None) -> bytes:
        self.echoed.add(index)
        self.offsets[index] = len(text)
        lps = None
        if self.with_logprobs and sample is not None:
            lps, _ = echo_logprobs(sample.prompt_token_ids or [], sample.prompt_logprobs, self.decode)
        return self._frame(
            [{"index": index, "text": text, "logprobs": lps, "finish_reason": None, "stop_reason": None}]
        )

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
            extra: dict[str, Any] = self._chat_prompt_extra(s) if self.chat and self._extras_on else {}
            quiet = not s.text and not s.logprobs and s.finish_reason is None
            owed = extra or (self.extras.return_token_ids and s.token_ids) or (first and self._extras_on)
            if quiet and not owed:
                continue  # e.g. the detokenizer is holding back half of a UTF-8 character
            lps = None
            if self.with_logprobs:
                if self.chat:
                    entries = chat_logprob_entries(
                        s.logprobs or [], self.decode, not self.extras.tokens_as_ids
                    )
                    lps = chat_logprobs(entries)
                else:
                    lps, self.offsets[i] = completion_logprobs(
                        s.logprobs or [], self.decode, self.offsets.get(i, 0), self.with_top
                    )
            elif not self.chat:
                self.offsets[i] = self.offsets.get(i, 0) + len(s.text)
            last = s.token_ids[-1] if s.token_ids else None
            if self.chat:
                choice = {
                    "index": i,
                    "delta": {"content": s.text},
                    "logprobs": lps,
                    "finish_reason": s.finish_reason,
                }
                if s.finish_reason is not None:
                    choice["stop_reason"] = stop_reason(s.finish_reason, last, self.extras)
                if self.extras.return_token_ids:
                    choice["token_ids"] = s.token_ids
            else:
                choice = {
                    "index": i,
                    "text": s.text,
                    "logprobs": lps,
                    "finish_reason": s.finish_reason,
                    "stop_reason": stop_reason(s.finish_reason, last, self.extras),
                }
                if self.extras.return_token_ids:
                    choice["token_ids"] = s.token_ids
                    if first:
                        choice["prompt_token_ids"] = s.prompt_token_ids
                if self.extras.prompt_logprobs and first:
                    choice["prompt_logprobs"] = _prompt_lps(s.prompt_logprobs, self.decode)
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
