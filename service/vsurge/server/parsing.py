"""Request parsing: bytes -> validated pydantic model -> a `GenerationPlan` the routes hand to vSurge.

Pure functions (no I/O, no engine): each raises `APIError` with a message that names the offending field,
so every bad input becomes a 4xx and never reaches the engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from vsurge.sampling_params import MAX_N, InvalidSamplingParams, SamplingParams

from .errors import APIError, invalid_request, unsupported_field
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from .structured_outputs import parse_chat_structured, parse_completion_structured
from .tool_parsers import parser_for_template, with_tools_for_template

M = TypeVar("M", bound=BaseModel)

# Most prompts one /v1/completions request may carry; each becomes its own engine request.
MAX_PROMPTS = MAX_N
# OpenAI's default for the legacy completions endpoint.
DEFAULT_COMPLETION_MAX_TOKENS = 16
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class GenerationPlan:
    """Everything a generation route needs after parsing; engine-independent."""

    operation: str  # "chat" or "text_completion" (GenAI semconv operation names)
    model: str
    prompts: list[str | list[int]]  # text (already chat-templated) or token ids
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    user: str | None = None
    # For echo: the prompt as text, one per prompt.
    prompt_texts: list[str] = field(default_factory=list)
    # the client set max_tokens: prompt + max_tokens beyond the context is a 400, not a silent cut
    strict_max_tokens: bool = False
    # vLLM's return_token_ids: prompt and output token ids in the response
    return_token_ids: bool = False
    # the client asked for prompt_logprobs (vLLM's field); echo + logprobs also computes them, internally
    show_prompt_logprobs: bool = False
    # structured output: the GrammarSpec to compile (vsurge.structured), and the chat's ToolPlan
    grammar: Any = None
    tools: Any = None

    @property
    def prompt_param(self) -> str:
        return "messages" if self.operation == "chat" else "prompt"


# ---------------------------------------------------------------------------------------------- body


# A JSON escape of a UTF-16 surrogate (\uD800-\uDFFF). json.loads joins valid pairs into one character,
# so after parsing, any surrogate left is a lone half that no tokenizer or encoder can take.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any, where: str = "") -> tuple[str, str] | None:
    """(path, the surrogate as an escape) of the first string holding a lone surrogate, else None."""
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        return (where or "body", f"\\u{ord(m.group()):04x}") if m else None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _lone_surrogate(k, where) or _lone_surrogate(v, f"{where}.{k}" if where else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{where}[{i}]")
            if found:
                return found
    return None


def read_json(body: bytes) -> dict[str, Any]:
    """Decode a request body; malformed or non-object JSON is a 400 naming the problem."""
    if not body:
        raise invalid_request("The request body is empty; expected a JSON object.")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid_request(f"The request body is not valid UTF-8 (byte {e.start}).") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid_request(
            f"The request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}."
        ) from None
    except (ValueError, RecursionError) as e:
        # int() digit limit (a 5000-digit number) or absurd nesting: still the client's fault.
        raise invalid_request(f"The request body could not be parsed: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise invalid_request(f"The request body must be a JSON object, got {type(data).__name__}.")
    if _SURROGATE_ESCAPE.search(text):
        found = _lone_surrogate(data)
        if found:
            where, esc = found
            raise invalid_request(
                f"'{where}' contains a lone UTF-16 surrogate ({esc}), which is not valid Unicode; "
                "send both halves of a surrogate pair or the character itself.",
                param=where,
            )
    return data


def _loc_to_param(loc: tuple[Any, ...]) -> tuple[str, str | None]:
    """pydantic loc -> ("messages[0].content", union branch tag or None)."""
    out = ""
    tag = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in {"str", "int", "float", "bool", "none"} or part[:1].isupper():
            tag = tag or part  # a union branch name, not a field
        else:
            out += f".{part}" if out else part
    return out, tag


def validation_error(e: ValidationError) -> APIError:
    """Turn pydantic's first complaint into one clear 400 (OpenAI reports one problem at a time)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    param, _ = _loc_to_param(first["loc"])
    if first["type"] == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param=param)
    # A union field fails once per branch; say which forms are accepted instead of the first branch's gripe.
    same = [err for err in errors if _loc_to_param(err["loc"])[0] == param]
    tags = [t for t in (_loc_to_param(err["loc"])[1] for err in same) if t]
    if len(set(tags)) > 1:
        return invalid_request(
            f"Invalid type for '{param}': expected one of {', '.join(dict.fromkeys(tags))}.", param=param
        )
    value = first.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return invalid_request(f"Invalid value for '{param}': {first['msg']} (got {shown}).", param=param)


def validate(cls: type[M], data: dict[str, Any]) -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


# ---------------------------------------------------------------------------------- unsupported fields


def check_unsupported_chat(req: ChatCompletionRequest) -> None:
    """Refuse what would change the output if honoured; accept the harmless 'off' values."""
    if req.functions:
        raise unsupported_field("functions", "function calling is not implemented yet")
    if req.function_call not in (None, "none"):
        raise unsupported_field("function_call", "function calling is not implemented yet")
    if req.audio is not None:
        raise unsupported_field("audio")
    if req.modalities not in (None, ["text"]):
        raise unsupported_field("modalities", "only ['text'] is implemented")
    if req.prediction is not None:
        raise unsupported_field("prediction")
    if req.reasoning_effort is not None:
        raise unsupported_field("reasoning_effort")
    if req.verbosity not in (None, "low", "medium", "high"):
        # accepted and ignored: a hint for OpenAI's reasoning models, nothing a sampler can honour
        raise invalid_request(
            f"Invalid value for 'verbosity': {req.verbosity!r}; expected 'low', 'medium' or 'high'.",
            param="verbosity",
        )
    if req.web_search_options is not None:
        raise unsupported_field("web_search_options")
    _check_common_unsupported(req)


def check_unsupported_completion(req: CompletionRequest) -> None:
    if req.suffix not in (None, ""):
        raise unsupported_field("suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise unsupported_field("best_of", "only best_of == n is implemented")
    _check_common_unsupported(req)


def _check_common_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.store:
        raise unsupported_field("store", "this server does not store completions")


# ------------------------------------------------------------------------------------------ messages


def messages_to_dicts(messages: list[ChatMessage], param: str = "messages") -> list[dict[str, Any]]:
    """Validate roles and content parts; return plain dicts for the chat template."""
    if not messages:
        raise invalid_request(f"'{param}' must contain at least one message.", param=param)
    out = []
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if m.role == "tool":
            out.append(_tool_message(m, where))
            continue
        role = CHAT_ROLES.get(m.role)
        if role is None:
            if m.role == "function":
                raise unsupported_field(f"{where}.role", "'function' messages (legacy); use 'tool'")
            raise invalid_request(
                f"Invalid value for '{where}.role': {m.role!r}; expected system, developer, user or assistant.",
                param=f"{where}.role",
            )
        for name in ("tool_call_id", "function_call", "audio"):
            if getattr(m, name) is not None:
                raise unsupported_field(f"{where}.{name}")
        calls = _assistant_tool_calls(m.tool_calls, where) if m.tool_calls is not None else None
        if calls is not None and role != "assistant":
            raise invalid_request(
                f"'{where}.tool_calls' is only allowed on assistant messages.", param=f"{where}.tool_calls"
            )
        if m.refusal is not None and not isinstance(m.refusal, str):
            raise invalid_request(
                f"Invalid value for '{where}.refusal': expected a string.", param=f"{where}.refusal"
            )
        content = _content_text(m.content, where, role)
        d: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if calls:
            d["tool_calls"] = calls
        out.append(d)
    return out


def _tool_message(m: ChatMessage, where: str) -> dict[str, Any]:
    """A tool's result: content and the id of the call it answers."""
    if not isinstance(m.tool_call_id, str) or not m.tool_call_id:
        raise invalid_request(
            f"Missing required parameter: '{where}.tool_call_id'.", param=f"{where}.tool_call_id"
        )
    return {
        "role": "tool",
        "tool_call_id": m.tool_call_id,
        "content": _content_text(m.content, where, "tool"),
    }


def _assistant_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier tool calls, for the template: arguments as objects (what templates expect)."""
    p = f"{where}.tool_calls"
    if not isinstance(calls, list):
        raise invalid_request(f"Invalid type for '{p}': expected an array.", param=p)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid_request(
                f"Invalid value for '{p}[{j}]': expected {{id, type, function: {{name, arguments}}}}.",
                param=f"{p}[{j}]",
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise invalid_request(
                    f"Invalid value for '{p}[{j}].function.arguments': not valid JSON.",
                    param=f"{p}[{j}].function.arguments",
                ) from None
        out.append(
            {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def _content_text(content: str | list[dict[str, Any]] | None, where: str, role: str) -> str:
    if content is None:
        if role == "assistant":
            return ""
        raise invalid_request(f"Missing required parameter: '{where}.content'.", param=f"{where}.content")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        p = f"{where}.content[{j}]"
        kind = part.get("type")
        if kind != "text":
            if kind in ("image_url", "input_audio", "file", "image", "refusal"):
                raise unsupported_field(f"{p}.type", f"'{kind}' content parts are not supported; send text")
            raise invalid_request(
                f"Invalid value for '{p}.type': {kind!r}; expected 'text'.", param=f"{p}.type"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_request(f"Invalid value for '{p}.text': expected a string.", param=f"{p}.text")
        extra = set(part) - {"type", "text"}
        if extra:
            raise invalid_request(f"Unrecognized request argument supplied: {p}.{sorted(extra)[0]}", param=p)
        texts.append(text)
    # Several text parts read as paragraphs; templates expect one string.
    return "\n".join(texts)


def render_chat(
    processor: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    describe_tools: bool = True,
) -> str:
    """Apply the model's chat template; a template that refuses the conversation is the client's 400.
    ``tools`` go to the template's own tool support, or into a system message where it has none."""
    if processor is None:
        raise invalid_request(
            "This model has no tokenizer; send token ids to /v1/completions.", param="model"
        )
    if continue_final_message:
        if messages[-1]["role"] != "assistant":
            raise invalid_request(
                "continue_final_message needs the last message to be an assistant message.",
                param="continue_final_message",
            )
        add_generation_prompt = False
    kwargs = dict(chat_template_kwargs or {})
    for reserved in (
        "conversation",
        "messages",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
    ):
        if reserved in kwargs:
            raise invalid_request(
                f"chat_template_kwargs must not set {reserved!r}.", param=f"chat_template_kwargs.{reserved}"
            )
    messages, template_tools = with_tools_for_template(messages, tools or [], processor, describe_tools)
    if template_tools:
        kwargs["tools"] = template_tools
    try:
        text = processor.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except Exception as e:  # jinja2 errors, raise_exception() in templates, missing template
        raise invalid_request(
            f"The messages could not be rendered with the model's chat template: {e}", param="messages"
        ) from None
    if not isinstance(text, str):  # some processors return a list for batched input
        raise invalid_request("The chat template did not produce text.", param="messages")
    return text


# ------------------------------------------------------------------------------------------ sampling


def _max_tokens(requested: int | None, default: int, max_length: int, param: str) -> int:
    if requested is None:
        return default
    if requested > max_length:
        raise invalid_request(
            f"{param} is too large: {requested}. This model's maximum context length is {max_length} tokens.",
            param=param,
        )
    return requested


def build_sampling(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int,
    logprobs: bool,
    top_logprobs: int,
    vocab_size: int | None,
    rename: dict[str, str] | None = None,
) -> SamplingParams:
    """Request fields -> validated SamplingParams; omitted fields keep OpenAI's defaults.

    rename maps a SamplingParams field to the request field that set it (completions' `logprobs` int sets
    `top_logprobs`), so the error names what the client actually sent.
    """
    given = {
        k: getattr(req, k)
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "min_tokens",
            "seed",
            "n",
        )
        if getattr(req, k) is not None
    }
    for k in ("allowed_token_ids", "prompt_logprobs"):
        if getattr(req, k) is not None:
            given[k] = getattr(req, k)
    if req.logit_bias is not None:
        given["logit_bias"] = _logit_bias(req.logit_bias)
    sp = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top_logprobs, **given)
    try:
        sp.validate()
    except InvalidSamplingParams as e:
        param = (rename or {}).get(e.param, e.param)
        raise invalid_request(str(e).replace(e.param, param, 1), param=param) from None
    if vocab_size:
        # top_k at or above the vocabulary filters nothing; capping keeps a huge value out of int32 on device.
        if sp.top_k >= vocab_size:
            sp.top_k = 0
        for name, ids in (
            ("stop_token_ids", sp.stop_token_ids or ()),
            ("logit_bias", sp.logit_bias or ()),
            ("allowed_token_ids", sp.allowed_token_ids or ()),
        ):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise invalid_request(
                    f"{name} contains {bad}, outside the vocabulary of {vocab_size} tokens.", param=name
                )
    return sp


def _logit_bias(raw: dict[str, float]) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings); a key that is no id is the client's 400."""
    out = {}
    for key, value in raw.items():
        if not key.isascii() or not key.strip().isdigit():
            raise invalid_request(
                f"Invalid key in 'logit_bias': {key[:40]!r} is not a token id.", param="logit_bias"
            )
        out[int(key)] = value
    return out


def _stream_flags(req: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool, bool]:
    stream = bool(req.stream)
    so = req.stream_options
    if so is not None and not stream:
        raise invalid_request("stream_options is only allowed when stream is true.", param="stream_options")
    include = bool(so and so.include_usage)
    continuous = bool(so and so.continuous_usage_stats)
    return stream, include, continuous


def plan_chat(
    req: ChatCompletionRequest,
    processor: Any,
    *,
    max_length: int,
    vocab_size: int | None = None,
    tool_call_parser: str | None = None,
) -> GenerationPlan:
    """A validated chat request -> the rendered prompt and sampling parameters."""
    check_unsupported_chat(req)
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
    max_tokens = _max_tokens(requested, max_length, max_length, param)
    sampling = build_sampling(
        req,
        max_tokens=max_tokens,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        vocab_size=vocab_size,
    )
    prompt = render_chat(
        processor,
        messages,
        add_generation_prompt=True if req.add_generation_prompt is None else req.add_generation_prompt,
        continue_final_message=bool(req.continue_final_message),
        chat_template_kwargs=req.chat_template_kwargs,
        tools=tools.template_tools if tools is not None else None,
        describe_tools=tools is not None and tools.choice == "auto",
    )
    stream, include, continuous = _stream_flags(req)
    return GenerationPlan(
        operation="chat",
        model=req.model,
        prompts=[prompt],
        sampling=sampling,
        stream=stream,
        include_usage=include,
        continuous_usage=continuous,
        user=req.user,
        strict_max_tokens=requested is not None,
        return_token_ids=bool(req.return_token_ids),
        show_prompt_logprobs=req.prompt_logprobs is not None,
        grammar=structured.grammar,
        tools=tools,
    )


def completion_prompts(prompt: Any, vocab_size: int | None) -> list[str | list[int]]:
    """OpenAI's four prompt forms -> a list of text or token-id prompts, checked for emptiness and range."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise invalid_request("'prompt' must not be empty.", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise invalid_request(
            f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(prompts)}.", param="prompt"
        )
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if len(p) == 0:
            raise invalid_request(f"'{where}' must not be empty.", param="prompt")
        if isinstance(p, list) and vocab_size:
            bad = next((t for t in p if not (0 <= t < vocab_size)), None)
            if bad is not None:
                raise invalid_request(
                    f"'{where}' contains token id {bad}, outside the vocabulary of {vocab_size} tokens.",
                    param="prompt",
                )
    return prompts


def plan_completion(
    req: CompletionRequest,
    *,
    max_length: int,
    vocab_size: int | None = None,
) -> GenerationPlan:
    check_unsupported_completion(req)
    grammar = parse_completion_structured(req)
    prompts = completion_prompts(req.prompt, vocab_size)
    max_tokens = _max_tokens(
        req.max_tokens, min(DEFAULT_COMPLETION_MAX_TOKENS, max_length), max_length, "max_tokens"
    )
    lp = req.logprobs
    if lp is not None and lp < 0:
        raise invalid_request(f"Invalid value for 'logprobs': must be >= 0, got {lp}.", param="logprobs")
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
    if sampling.n * len(prompts) > MAX_N:
        raise invalid_request(
            f"n times the number of prompts must be at most {MAX_N}, got {sampling.n * len(prompts)}.",
            param="n",
        )
    stream, include, continuous = _stream_flags(req)
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
        show_prompt_logprobs=req.prompt_logprobs is not None,
        grammar=grammar,
    )
