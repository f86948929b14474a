"""Request parsing: a validated request -> a `GenerationPlan` the routes hand to vSurge.

Pure functions (no I/O, no engine): each raises `APIError` with a message that names the offending field,
so every bad input becomes a 4xx and never reaches the engine. The seams: `body` (bytes -> pydantic model),
`messages` (chat messages -> the templated prompt), `sampling_fields` (request -> SamplingParams, refused
fields), `prompts` (completion prompts, truncation), `structured_outputs` (grammars and tools).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vsurge.contracts.sampling_params import MAX_N, SamplingParams

from .body import read_json, validate, validation_error
from .errors import invalid_request
from .explicit_logprobs import check_logprob_token_ids
from .messages import check_generation_prompt, echo_text, messages_to_dicts, render_chat
from .prompts import MAX_PROMPTS, check_truncation, completion_prompts
from .sampling_fields import (
    build_sampling,
    check_beam_search,
    check_unsupported_chat,
    check_unsupported_completion,
    max_tokens_for,
    stream_flags,
)
from .schemas import ChatCompletionRequest, CompletionRequest
from .structured_outputs import parse_chat_structured, parse_completion_structured
from .tool_parsers import parser_for_template

__all__ = [
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "MAX_PROMPTS",
    "BeamOptions",
    "GenerationPlan",
    "completion_prompts",
    "messages_to_dicts",
    "plan_chat",
    "plan_completion",
    "read_json",
    "render_chat",
    "validate",
    "validation_error",
]

# OpenAI's default for the legacy completions endpoint.
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass
class BeamOptions:
    """use_beam_search: `width` beams (the request's n), ranked by logprob / length ** length_penalty."""

    width: int
    length_penalty: float = 1.0
    ignore_eos: bool = False


@dataclass
class GenerationPlan:
    """Everything a generation route needs after parsing; engine-independent."""

    operation: str  # "chat" or "text_completion" (GenAI semconv operation names)
    model: str | None
    prompts: list[str | list[int]]  # text (already chat-templated) or token ids
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    user: str | None = None
    # For echo: the prompt as text, one per prompt (completions).
    prompt_texts: list[str] = field(default_factory=list)
    # chat echo (vLLM): the answer starts with the last message's content when that message is the assistant's
    chat_echo: str = ""
    # the client set max_tokens: prompt + max_tokens beyond the context is a 400, not a silent cut
    strict_max_tokens: bool = False
    # vLLM's return_token_ids: prompt and output token ids in the response
    return_token_ids: bool = False
    # vLLM's return_tokens_as_token_ids: logprobs' tokens written "token_id:<id>"
    tokens_as_ids: bool = False
    # the client asked for prompt_logprobs (vLLM's field); echo + logprobs also computes them, internally
    show_prompt_logprobs: bool = False
    # server-side tokenization (prompts.tokenize_prompts): keep this many prompt tokens, from this side;
    # an explicit add_special_tokens
    truncate_keep: int | None = None
    truncation_side: str | None = None
    add_special_tokens: bool | None = None
    beam: BeamOptions | None = None
    request_id: str | None = None
    # structured output: the GrammarSpec to compile (vsurge.structured), and the chat's ToolPlan
    grammar: Any = None
    tools: Any = None
    # vLLM's logprob_token_ids: these ids' logprobs at every generated position (explicit_logprobs.py)
    logprob_token_ids: list[int] | None = None

    @property
    def prompt_param(self) -> str:
        return "messages" if self.operation == "chat" else "prompt"


def _beam(req: ChatCompletionRequest | CompletionRequest) -> BeamOptions | None:
    if not req.use_beam_search:
        return None
    lp = req.length_penalty
    return BeamOptions(req.n or 1, 1.0 if lp is None else float(lp), bool(req.ignore_eos))


def plan_chat(
    req: ChatCompletionRequest,
    processor: Any,
    *,
    max_length: int,
    vocab_size: int | None = None,
    tool_call_parser: str | None = None,
    oai_like_processor: bool = True,
) -> GenerationPlan:
    """A validated chat request -> the rendered prompt and sampling parameters."""
    check_unsupported_chat(req)
    check_generation_prompt(req.add_generation_prompt, req.continue_final_message)
    structured = parse_chat_structured(req)
    tools = structured.tools
    if tools is not None and tools.choice == "auto":
        tools.parser = tool_call_parser or parser_for_template(processor)
    messages = messages_to_dicts(req.messages)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise invalid_request(
            "Set max_tokens or max_completion_tokens, not both.", param="max_completion_tokens"
        )
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # Chat has no output cap by default (OpenAI): up to the context, which the engine enforces.
    max_tokens = max_tokens_for(requested, max_length, max_length, param)
    check_beam_search(req, logprobs=bool(req.logprobs), grammar=structured.grammar, tools=tools)
    sampling = build_sampling(
        req,
        max_tokens=max_tokens,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        vocab_size=vocab_size,
    )
    keep = check_truncation(req.truncate_prompt_tokens, max_length)
    prompt = render_chat(
        processor,
        messages,
        add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
        continue_final_message=bool(req.continue_final_message),
        chat_template_kwargs=req.chat_template_kwargs,
        tools=tools.template_tools if tools is not None else None,
        describe_tools=tools is not None and tools.choice == "auto",
        documents=req.documents,
        oai_like_processor=oai_like_processor,
    )
    stream, include, continuous = stream_flags(req)
    return GenerationPlan(
        operation="chat",
        model=req.model,
        prompts=[prompt],
        sampling=sampling,
        stream=stream,
        include_usage=include,
        continuous_usage=continuous,
        user=req.user,
        chat_echo=echo_text(messages) if req.echo else "",
        strict_max_tokens=requested is not None,
        return_token_ids=bool(req.return_token_ids),
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        show_prompt_logprobs=req.prompt_logprobs is not None,
        truncate_keep=keep,
        truncation_side=req.truncation_side,
        add_special_tokens=req.add_special_tokens,
        beam=_beam(req),
        request_id=req.request_id,
        grammar=structured.grammar,
        tools=tools,
        logprob_token_ids=check_logprob_token_ids(
            req.logprob_token_ids,
            logprobs=bool(req.logprobs),
            beam=bool(req.use_beam_search),
            max_tokens=max_tokens,
            vocab_size=vocab_size,
        ),
    )


def plan_completion(
    req: CompletionRequest,
    *,
    max_length: int,
    vocab_size: int | None = None,
) -> GenerationPlan:
    check_unsupported_completion(req)
    grammar = parse_completion_structured(req)
    prompts = completion_prompts(req.prompt, vocab_size)
    max_tokens = max_tokens_for(
        req.max_tokens, min(DEFAULT_COMPLETION_MAX_TOKENS, max_length), max_length, "max_tokens"
    )
    lp = req.logprobs
    if lp is not None and lp < 0:
        raise invalid_request(f"Invalid value for 'logprobs': must be >= 0, got {lp}.", param="logprobs")
    check_beam_search(req, logprobs=lp is not None, grammar=grammar)
    sampling = build_sampling(
        req,
        max_tokens=max_tokens,
        logprobs=lp is not None,
        top_logprobs=lp or 0,
        vocab_size=vocab_size,
        rename={"top_logprobs": "logprobs"},
    )
    if req.echo and lp is not None:
        # echo + logprobs scores the prompt too (how evaluation harnesses read log-likelihoods)
        sampling.prompt_logprobs = max(lp, sampling.prompt_logprobs or 0)
    width = (req.n or 1) if req.use_beam_search else sampling.n
    if width * len(prompts) > MAX_N:
        raise invalid_request(
            f"n times the number of prompts must be at most {MAX_N}, got {width * len(prompts)}.",
            param="n",
        )
    stream, include, continuous = stream_flags(req)
    return GenerationPlan(
        operation="text_completion",
        model=req.model,
        prompts=prompts,
        sampling=sampling,
        stream=stream,
        include_usage=include,
        continuous_usage=continuous,
        echo=bool(req.echo),
        user=req.user,
        strict_max_tokens=req.max_tokens is not None,
        return_token_ids=bool(req.return_token_ids),
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        show_prompt_logprobs=req.prompt_logprobs is not None,
        truncate_keep=check_truncation(req.truncate_prompt_tokens, max_length),
        truncation_side=req.truncation_side,
        add_special_tokens=req.add_special_tokens,
        beam=_beam(req),
        request_id=req.request_id,
        grammar=grammar,
        logprob_token_ids=check_logprob_token_ids(
            req.logprob_token_ids,
            logprobs=lp is not None,
            beam=bool(req.use_beam_search),
            max_tokens=max_tokens,
            vocab_size=vocab_size,
        ),
    )
