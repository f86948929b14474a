"""Chat messages: validated roles and content parts -> plain dicts -> the prompt, via the model's chat template.

Pure functions that raise `APIError` (400, naming the field). Roles are passed to the template as given (as
vLLM does: a template may know roles of its own), except `developer`, which templates know as `system`.
"""

from __future__ import annotations

import json
from typing import Any

from .content_parts import as_content_parts, wants_content_parts
from .errors import invalid_request, unsupported_field
from .schemas import ChatMessage
from .tool_parsers import with_tools_for_template

# OpenAI's newer name for the system role; chat templates know "system"
ROLE_ALIASES = {"developer": "system"}
_PART_TYPES_REFUSED = ("image_url", "input_audio", "file", "image", "video_url", "audio_url")


def messages_to_dicts(messages: list[ChatMessage], param: str = "messages") -> list[dict[str, Any]]:
    """Validate roles and content parts; return plain dicts for the chat template. Unknown keys of a
    message are ignored (vLLM), not passed to the template."""
    if not messages:
        raise invalid_request(f"'{param}' must contain at least one message.", param=param)
    out = []
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if m.role == "tool":
            out.append(_tool_message(m, where))
            continue
        if not m.role.strip():
            raise invalid_request(
                f"Invalid value for '{where}.role': must not be empty.", param=f"{where}.role"
            )
        role = ROLE_ALIASES.get(m.role, m.role)
        for name in ("function_call", "audio"):
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
        # a part without "type" but with "text" is text (vLLM infers it); extra keys are ignored
        kind = part.get("type", "text" if "text" in part else None)
        if kind == "refusal" and role == "assistant":
            kind, part = "text", {"text": part.get("refusal")}
        if kind != "text":
            if kind in _PART_TYPES_REFUSED or kind == "refusal":
                raise unsupported_field(f"{p}.type", f"'{kind}' content parts are not supported; send text")
            raise invalid_request(
                f"Invalid value for '{p}.type': {kind!r}; expected 'text'.", param=f"{p}.type"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_request(f"Invalid value for '{p}.text': expected a string.", param=f"{p}.text")
        texts.append(text)
    # Several text parts read as paragraphs; templates expect one string.
    return "\n".join(texts)


def echo_text(messages: list[dict[str, Any]], role: str = "assistant") -> str:
    """vLLM's chat `echo`: the last message's content when it has the answer's role, else ''."""
    last = messages[-1] if messages else None
    if last and last.get("role") == role and isinstance(last.get("content"), str):
        return last["content"]
    return ""


_RESERVED_TEMPLATE_KWARGS = (
    "conversation",
    "messages",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
)


def check_generation_prompt(add_generation_prompt: bool | None, continue_final_message: bool | None) -> None:
    """vLLM refuses both set to true: the last message cannot be open-ended and followed by a new turn."""
    if continue_final_message and add_generation_prompt:
        raise invalid_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="add_generation_prompt",
        )


def render_chat(
    processor: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    describe_tools: bool = True,
    documents: list[dict[str, Any]] | None = None,
    oai_like_processor: bool = True,
) -> str:
    """Apply the model's chat template; a template that refuses the conversation is the client's 400.
    ``tools`` go to the template's own tool support, or into a system message where it has none.
    ``oai_like_processor``: a multimodal processor gets content as typed parts (content_parts.py)."""
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
    for reserved in _RESERVED_TEMPLATE_KWARGS:
        if reserved in kwargs:
            raise invalid_request(
                f"chat_template_kwargs must not set {reserved!r}.", param=f"chat_template_kwargs.{reserved}"
            )
    if documents is not None:
        kwargs["documents"] = documents
    messages, template_tools = with_tools_for_template(messages, tools or [], processor, describe_tools)
    if wants_content_parts(processor, oai_like_processor):
        messages = as_content_parts(messages)
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
