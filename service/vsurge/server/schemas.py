"""Pydantic models of the request bodies (responses are shaped as plain dicts in `shaping.py`).

Strict mode on purpose: `"max_tokens": "5"` or `"stream": 1` is a client bug that OpenAI rejects too, and
coercing it would hide the bug. Unknown top-level fields are refused (`extra="forbid"`) with OpenAI's own
wording; fields that OpenAI defines but we do not implement are declared as `Any` and checked in
`parsing.py`, so the refusal can say exactly what is unsupported instead of "extra field".
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    # vLLM's extension: usage on every chunk. Accepted and honoured.
    continuous_usage_stats: bool | None = None


class ChatMessage(_Strict):
    role: str
    # str, or a list of content parts ({"type": "text", "text": ...}); parts are checked in parsing.py so
    # an image part gets "not supported" rather than a type error.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # OpenAI fields we cannot honour; refused in parsing.py when set.
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None


class _SamplingFields(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    user: str | None = None
    # Accepted and ignored: they steer OpenAI's storage, billing, caching and abuse tooling, not the output
    # of a self-hosted model (prefix caching here is automatic).
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # token id (a JSON object key, so a string) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    # vLLM's structured output (json / regex / choice / grammar / json_object); checked in
    # structured_outputs.py so each problem names its field
    structured_outputs: Any = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM-compatible chat template controls (e.g. {"enable_thinking": false} for Qwen3).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # Structured output and tool calling: checked in structured_outputs.py
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    # Not implemented yet: refused by parsing.py when given a value that would change the output.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class CompletionRequest(_SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists (OpenAI's four forms).
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    response_format: Any = None  # vLLM accepts it on completions too
    suffix: Any = None
    best_of: Any = None


class CountTokensRequest(_Strict):
    """The seed's /v1/count_tokens body: a plain string or a chat conversation."""

    model: str
    conversation: str | list[ChatMessage]


class TokenizeRequest(_Strict):
    """vLLM-style /tokenize: `prompt` text, or chat `messages` rendered with the chat template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[int]
