"""Tool calls, response side: the model's tool-call text -> OpenAI ``tool_calls``, and the chat template's
view of tools and of earlier calls and results.

Parsers per family, for tool_choice "auto" (the model writes its own format):

- ``hermes``      Hermes / Qwen2 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated;
- ``llama3_json`` Llama 3.x: ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), several
                  separated by ``;``;
- ``mistral``     Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

The family is read from the chat template (`parser_for_template`) unless ``tool_call_parser`` names one. Under
"auto", a template that knows nothing of tools gets them described in a system message in the Hermes format,
and is read back with the Hermes parser (under "required" / a named function the grammar writes the call, and
such a template sees no tools, as in vLLM). Text that is not a well-formed call of a listed tool stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral")

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def template_source(processor: Any) -> str:
    t = getattr(processor, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("tool_use") or t.get("default") or next(iter(t.values()), "")
    return t or ""


def template_knows_tools(processor: Any) -> bool:
    return "tools" in template_source(processor)


def parser_for_template(processor: Any) -> str:
    src = template_source(processor)
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or ("<|start_header_id|>" in src and "parameters" in src):
        return "llama3_json"
    return "hermes"  # Qwen / Hermes templates, and the format we describe to templates without tools


# -------------------------------------------------------------------------------------------- parsing


def _call(obj: Any, names: set[str], args_key: str = "arguments") -> dict[str, str] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse_auto(text: str, parser: str, names: set[str]) -> tuple[str | None, list[dict[str, str]]]:
    """(content, calls) from a free-running model's output in its family's format."""
    if parser == "mistral":
        head, sep, tail = text.partition("[TOOL_CALLS]")
        if not sep:
            return text, []
        objs = _loads(tail.strip())
        objs = objs if isinstance(objs, list) else [objs]
        calls = [c for c in (_call(o, names) for o in objs) if c]
        return (head.strip() or None, calls) if calls else (text, [])
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        parts = [_loads(p) for p in _split_top_level(body, ";")]
        calls = [c for c in (_call(o, names, "parameters") for o in parts) if c]
        return (None, calls) if calls and len(calls) == len(parts) else (text, [])
    if "<tool_call>" not in text:
        return text, []
    head = text.split("<tool_call>", 1)[0]
    calls = [c for c in (_call(_loads(m), names) for m in _HERMES.findall(text)) if c]
    return (head.strip() or None, calls) if calls else (text, [])


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside JSON strings and brackets."""
    out, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc = ch == "\\" and not esc
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    out.append(text[start:].strip())
    return [p for p in out if p]


def parse_forced(text: str, choice: str, named: str | None) -> list[dict[str, str]]:
    """Calls from grammar-constrained output: a named function's arguments, or required's JSON array."""
    if choice == "named":
        return [{"name": named or "", "arguments": text.strip()}]
    objs = _loads(text)
    if not isinstance(objs, list):
        return []  # cut off by max_tokens before the array closed
    return [
        {"name": o["name"], "arguments": json.dumps(o.get("arguments", {}), ensure_ascii=False)}
        for o in objs
        if isinstance(o, dict) and isinstance(o.get("name"), str)
    ]


def openai_tool_calls(calls: list[dict[str, str]], ids: list[str] | None = None) -> list[dict[str, Any]]:
    ids = ids or [new_call_id() for _ in calls]
    return [
        {"id": i, "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for i, c in zip(ids, calls, strict=True)
    ]


# ------------------------------------------------------------------------------------ the template side


def tools_preamble(tools: list[dict[str, Any]]) -> str:
    """How a template without tool support hears about the tools: their signatures and the Hermes call
    format, briefly (the prompt of a small-context model must still fit)."""
    sigs = "\n".join(json.dumps(t["function"], ensure_ascii=False, separators=(",", ":")) for t in tools)
    return (
        f"Tools:\n<tools>\n{sigs}\n</tools>\n"
        'To call a tool, answer <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    )


def with_tools_for_template(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], processor: Any, describe: bool = True
):
    """(messages, tools kwarg) for apply_chat_template: the template's own tools support when it has one,
    else earlier calls written in the Hermes format and, with ``describe`` (tool_choice "auto", where the
    model must write calls itself), the tools described in the system message."""
    if template_knows_tools(processor):
        return messages, tools
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for c in calls
            )
            m["content"] = ((m.get("content") or "") + "\n" + text).strip()
        if m.get("role") == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
        out.append(m)
    if tools and describe:
        pre = tools_preamble(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + pre}
        else:
            out.insert(0, {"role": "system", "content": pre})
    return out, None


def resolve_choice(
    text: str, finish_reason: str | None, plan: Any
) -> tuple[str | None, list | None, str | None]:
    """(content, OpenAI tool_calls or None, finish_reason) of one finished chat choice under a ToolPlan.

    A named choice finishes with "stop" (as OpenAI answers a forced function); calls found otherwise
    finish with "tool_calls"; "length" stays "length"."""
    if plan is None or plan.choice == "none":
        return text, None, finish_reason
    if plan.choice in ("named", "required"):
        calls = parse_forced(text, plan.choice, plan.named)
        content = None
    else:
        content, calls = parse_auto(text, plan.parser or "hermes", set(plan.functions))
    if not calls:
        return text, None, finish_reason
    if finish_reason != "length":
        finish_reason = "stop" if plan.choice == "named" else "tool_calls"
    return content, openai_tool_calls(calls), finish_reason
