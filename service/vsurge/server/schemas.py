"""Pydantic models of the request bodies (responses are shaped as plain dicts in `shaping.py`).

Strict types on purpose: `"max_tokens": "5"` or `"stream": 1` is a client bug that OpenAI rejects too, and
coercing it would hide the bug. Unknown fields are accepted and ignored, as vLLM's server does (clients
written for it send extra sampling fields such as `min_characters`, and extra keys inside messages); the
server logs their names once (`body.log_ignored`). Fields that OpenAI or vLLM define and that would change the
output if honoured, but that this server does not implement, are declared as `Any` and checked in
`sampling_fields.py`, so the refusal can say exactly what is unsupported instead of silently ignoring it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Lenient(BaseModel):
    # strict: no type coercion; extra: unknown keys kept in model_extra, then ignored (vLLM's behaviour)
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool | None = None
    # vLLM's extension: usage on every chunk. Accepted and honoured.
    continuous_usage_stats: bool | None = None


class ChatMessage(_Lenient):
    # any role: system, developer, user, assistant, tool, or a custom one the chat template knows (vLLM)
    role: str
    # str, or a list of content parts ({"type": "text", "text": ...}); parts are checked in messages.py so
    # an image part gets "not supported" rather than a type error.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # tool calling: an assistant's earlier calls, a tool result's call id (checked in messages.py)
    tool_calls: Any = None
    tool_call_id: Any = None
    # OpenAI fields we cannot honour; refused in messages.py when set.
    function_call: Any = None
    refusal: Any = None
    audio: Any = None


class _SamplingFields(_Lenient):
    """Fields shared by chat and text completions."""

    # vLLM: optional; omitted means the served model (the first one when several are served)
    model: str | None = None
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
    # logprobs' tokens as "token_id:<id>" strings (tokens that are no valid UTF-8 stay identifiable)
    return_tokens_as_token_ids: bool | None = None
    # keep only the last (truncation_side "left", the default) or first ("right") N prompt tokens; -1: the
    # model's context length
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    # whether the tokenizer adds its special tokens (BOS) to the prompt; None: as generation does (BOS unless
    # the text already starts with it)
    add_special_tokens: bool | None = None
    # beam search (beam_search.py): n beams, ranked by cumulative logprob / length ** length_penalty
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    # vLLM's request id: the response id becomes "<prefix>-<request_id>"
    request_id: str | None = None
    # vLLM fields accepted with their neutral value only (refused otherwise, see sampling_fields.py)
    priority: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    logprob_token_ids: Any = None
    kv_transfer_params: Any = None
    chat_template: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # accepted and ignored: a prefix-cache salt (no cross-tenant cache here to salt), custom-extension args
    cache_salt: str | None = None
    vllm_xargs: Any = None
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
    # vLLM: RAG documents handed to the chat template (templates without RAG ignore them)
    documents: list[dict[str, Any]] | None = None
    # vLLM: the answer starts with the last message's content when that message is the assistant's
    echo: bool | None = None
    # Structured output and tool calling: checked in structured_outputs.py
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    # Not implemented yet: refused by sampling_fields.py when given a value that would change the output.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class CompletionRequest(_SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists (OpenAI's four forms);
    # optional here so that a missing prompt gets vLLM's own message (prompts.py).
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    prompt_embeds: Any = None  # vLLM's; refused when non-empty
    logprobs: int | None = None
    echo: bool | None = None
    response_format: Any = None  # vLLM accepts it on completions too
    suffix: Any = None
    best_of: Any = None


class CountTokenRequest(_Lenient):
    """The seed's /v1/count_tokens body: a plain string or a chat conversation."""

    model: str | None = None
    conversation: str | list[ChatMessage]


CountTokensRequest = CountTokenRequest  # the name this module used before it took the seed's


class TokenizeRequest(_Lenient):
    """vLLM's /tokenize: `prompt` text, or chat `messages` rendered with the chat template (and `tools`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    # also return each token's string (the tokenizer's own vocabulary entry)
    return_token_strs: bool | None = None
    chat_template: Any = None


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]
