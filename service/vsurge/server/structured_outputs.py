"""Structured output and tool calling, request side: `response_format`, vLLM's `structured_outputs`,
`tools` / `tool_choice` / `parallel_tool_calls` -> a `ToolPlan` and the `GrammarSpec` that constrains the
output. Pure functions that raise `APIError` (400, with `param`) on bad input, before anything reaches the
engine; the grammar itself is compiled (and its errors reported) by `compile_plan_grammar`.

Output forms under tools (what the grammar enforces and `tool_parsers.py` reads back):

- ``tool_choice`` a named function: the output is that function's arguments, a JSON object that validates
  against its ``parameters``; finish_reason "stop" (as OpenAI answers a forced function);
- ``"required"``: a JSON array of ``{"name": <one of the tools>, "arguments": {...}}`` (at least one call, at
  most one unless ``parallel_tool_calls``), each entry's arguments validated by its own function's schema;
- ``"auto"``: unconstrained; the model writes its chat template's own tool-call format, read by the parser of
  its family (Llama 3 JSON, Hermes/Qwen ``<tool_call>``, Mistral ``[TOOL_CALLS]``);
- ``"none"``: plain text, tools still shown to the template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from vsurge.structured import GrammarCompiler, GrammarError, GrammarSpec

from .errors import APIError, invalid_request

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class ToolPlan:
    """What the chat route needs to render tools and read tool calls back."""

    tools: list[dict[str, Any]]  # OpenAI tool objects, normalized ({"type": "function", "function": {...}})
    choice: str  # "auto", "none", "required" or "named"
    named: str | None = None  # the function of a named choice
    parallel: bool = True
    parser: str | None = None  # tool-call parser family for "auto" (tool_parsers.PARSERS)

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return self.tools


@dataclass
class StructuredRequest:
    grammar: GrammarSpec | None = None
    tools: ToolPlan | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ response_format


def parse_response_format(rf: Any) -> GrammarSpec | None:
    """OpenAI's response_format: text (None), json_object, json_schema {name, schema, strict, description}."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise invalid_request(
            "Invalid type for 'response_format': expected an object.", param="response_format"
        )
    kind = rf.get("type")
    if kind == "text":
        _no_extra(rf, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _no_extra(rf, {"type"}, "response_format")
        return GrammarSpec.json_object("response_format")
    if kind == "json_schema":
        _no_extra(rf, {"type", "json_schema"}, "response_format")
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise invalid_request(
                "Missing required parameter: 'response_format.json_schema' (an object with name and schema).",
                param="response_format.json_schema",
            )
        _no_extra(js, {"name", "schema", "strict", "description"}, "response_format.json_schema")
        name = js.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid_request(
                "Invalid value for 'response_format.json_schema.name': expected 1-64 letters, digits, '_' or '-'.",
                param="response_format.json_schema.name",
            )
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid_request(
                "Invalid type for 'response_format.json_schema.strict': expected a boolean.",
                param="response_format.json_schema.strict",
            )
        schema = js.get("schema", {})
        _check_schema(schema, "response_format.json_schema.schema")
        return GrammarSpec.json_schema(schema, "response_format.json_schema.schema")
    raise invalid_request(
        f"Invalid value for 'response_format.type': {kind!r}; expected 'text', 'json_object' or 'json_schema'.",
        param="response_format.type",
    )


def _no_extra(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise invalid_request(
            f"Unrecognized request argument supplied: {where}.{extra[0]}", param=f"{where}.{extra[0]}"
        )


def _check_schema(schema: Any, param: str) -> None:
    """A JSON schema is an object (or a boolean); its keywords are checked by the grammar compiler."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise invalid_request(f"Invalid type for '{param}': a JSON schema must be an object.", param=param)
    kind = schema.get("type")
    if kind is not None and not isinstance(kind, str | list):
        raise invalid_request(
            f"Invalid value for '{param}.type': expected a string or a list.", param=f"{param}.type"
        )


# ------------------------------------------------------------------------------- structured_outputs


_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def parse_structured_outputs(so: Any) -> GrammarSpec | None:
    """vLLM's structured_outputs: exactly one of json (schema object or its JSON text), regex, choice
    (a list of strings), grammar (Lark or GBNF), json_object (true)."""
    if so is None:
        return None
    p = "structured_outputs"
    if not isinstance(so, dict):
        raise invalid_request(f"Invalid type for '{p}': expected an object.", param=p)
    # vLLM's own bookkeeping keys, harmless when off
    ignored = {
        "disable_fallback",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
    }
    _no_extra(so, set(_SO_KEYS) | ignored | {"structural_tag"}, p)
    if so.get("structural_tag") is not None:
        raise invalid_request(
            f"'{p}.structural_tag' is not supported by this server.", param=f"{p}.structural_tag"
        )
    given = [k for k in _SO_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise invalid_request(
            f"'{p}' must set exactly one of {', '.join(_SO_KEYS)}; got {len(given) or 'none'}.", param=p
        )
    key = given[0]
    value = so[key]
    where = f"{p}.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as e:
                raise invalid_request(
                    f"Invalid value for '{where}': not valid JSON ({e}).", param=where
                ) from None
        _check_schema(value, where)
        return GrammarSpec.json_schema(value, where)
    if key == "json_object":
        if value is not True:
            raise invalid_request(f"Invalid value for '{where}': expected true.", param=where)
        return GrammarSpec.json_object(where)
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise invalid_request(f"Invalid value for '{where}': expected a non-empty string.", param=where)
        return GrammarSpec.regex(value, where)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid_request(
                f"Invalid value for '{where}': expected a non-empty list of non-empty strings.", param=where
            )
        return GrammarSpec.choice(value, where)
    if not isinstance(value, str) or not value.strip():
        raise invalid_request(
            f"Invalid value for '{where}': expected a grammar (Lark or EBNF) as a string.", param=where
        )
    try:
        return GrammarSpec.grammar(value, where)
    except GrammarError as e:
        raise invalid_request(str(e), param=e.param) from None


# -------------------------------------------------------------------------------------------- tools


def parse_tools(tools: Any, tool_choice: Any, parallel: Any) -> ToolPlan | None:
    """Validate tools, tool_choice and parallel_tool_calls; None when no tools are given."""
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid_request(
            "Invalid type for 'parallel_tool_calls': expected a boolean.", param="parallel_tool_calls"
        )
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise invalid_request(
                "'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice"
            )
        if parallel is not None:
            raise invalid_request(
                "'parallel_tool_calls' is only allowed when 'tools' are specified.",
                param="parallel_tool_calls",
            )
        return None
    if not isinstance(tools, list):
        raise invalid_request("Invalid type for 'tools': expected an array of tools.", param="tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid_request(f"Invalid type for '{where}': expected an object.", param=where)
        if t.get("type") != "function":
            raise invalid_request(
                f"Invalid value for '{where}.type': expected 'function'.", param=f"{where}.type"
            )
        _no_extra(t, {"type", "function"}, where)
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise invalid_request(
                f"Missing required parameter: '{where}.function'.", param=f"{where}.function"
            )
        _no_extra(fn, {"name", "description", "parameters", "strict"}, f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid_request(
                f"Invalid value for '{where}.function.name': expected 1-64 letters, digits, '_' or '-'.",
                param=f"{where}.function.name",
            )
        if name in names:
            raise invalid_request(f"Duplicate tool name {name!r} in 'tools'.", param=f"{where}.function.name")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise invalid_request(
                f"Invalid type for '{where}.function.description': expected a string.",
                param=f"{where}.function.description",
            )
        # OpenAI: omitted parameters is a function without arguments; given, it must be an object schema
        params = fn.get("parameters", {"type": "object", "properties": {}})
        pwhere = f"{where}.function.parameters"
        if not isinstance(params, dict):
            raise invalid_request(
                f"Invalid type for '{pwhere}': expected a JSON schema object.", param=pwhere
            )
        if params.get("type", "object") != "object":
            raise invalid_request(
                f"Invalid value for '{pwhere}.type': function parameters must be a schema of type 'object'.",
                param=f"{pwhere}.type",
            )
        params = {"type": "object", **params}
        norm = {"name": name, "parameters": params}
        if "description" in fn:
            norm["description"] = fn["description"]
        out.append({"type": "function", "function": norm})
    if tool_choice is None:
        choice, named = "auto", None
    elif tool_choice in ("auto", "none", "required"):
        choice, named = tool_choice, None
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if (
            tool_choice.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise invalid_request(
                "Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}.",
                param="tool_choice",
            )
        if fn["name"] not in names:
            raise invalid_request(
                f"Invalid value for 'tool_choice': no tool named {fn['name']!r} in 'tools'.",
                param="tool_choice.function.name",
            )
        choice, named = "named", fn["name"]
    else:
        raise invalid_request(
            "Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or a named function.",
            param="tool_choice",
        )
    return ToolPlan(out, choice, named, parallel is not False)


def tool_grammar(plan: ToolPlan) -> GrammarSpec | None:
    """The grammar of a named or required choice (None for auto / none)."""
    fns = plan.functions
    if plan.choice == "named":
        return GrammarSpec.json_schema(fns[plan.named]["parameters"], "tools")
    if plan.choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": fn["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, fn in fns.items()
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not plan.parallel:
        schema["maxItems"] = 1
    return GrammarSpec.json_schema(schema, "tools")


def parse_chat_structured(req: Any) -> StructuredRequest:
    """The chat request's structured-output fields -> one grammar (or none) and the tool plan."""
    rf = parse_response_format(req.response_format)
    so = parse_structured_outputs(req.structured_outputs)
    tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if rf is not None and so is not None:
        raise invalid_request(
            "Set response_format or structured_outputs, not both.", param="structured_outputs"
        )
    grammar = rf or so
    if tools is not None and tools.choice != "none":
        tg = tool_grammar(tools)
        if grammar is not None and (tg is not None or tools.choice == "auto"):
            # the output is either a tool call or the requested format; one grammar cannot be both
            raise invalid_request(
                f"'{grammar.param.split('.')[0]}' cannot be combined with tools unless tool_choice is 'none'.",
                param=grammar.param.split(".")[0],
            )
        grammar = tg or grammar
    _check_sampling_combo(req, grammar)
    return StructuredRequest(grammar, tools)


def parse_completion_structured(req: Any) -> GrammarSpec | None:
    rf = parse_response_format(req.response_format)
    so = parse_structured_outputs(req.structured_outputs)
    if rf is not None and so is not None:
        raise invalid_request(
            "Set response_format or structured_outputs, not both.", param="structured_outputs"
        )
    grammar = rf or so
    _check_sampling_combo(req, grammar)
    return grammar


def _check_sampling_combo(req: Any, grammar: GrammarSpec | None) -> None:
    if grammar is None:
        return
    # the grammar decides where the output ends: EOS is allowed exactly where it is complete
    if req.ignore_eos:
        raise invalid_request("ignore_eos cannot be combined with structured output.", param="ignore_eos")
    if req.min_tokens:
        raise invalid_request("min_tokens cannot be combined with structured output.", param="min_tokens")


# ------------------------------------------------------------------------------------------ compile


def grammar_compiler(entry: Any) -> GrammarCompiler:
    """The model's grammar compiler, made on first use and kept on its ServedModel entry."""
    c = getattr(entry, "_grammar_compiler", None)
    if c is None:
        if entry.processor is None:
            raise invalid_request("This model has no tokenizer; structured output needs one.", param="model")
        eos = list(getattr(entry.surge, "eos_token_ids", None) or [])
        if not eos and getattr(entry.processor, "eos_token_id", None) is not None:
            eos = [int(entry.processor.eos_token_id)]
        vocab = entry.vocab_size or len(entry.processor)
        c = GrammarCompiler(entry.processor, vocab, eos)
        entry._grammar_compiler = c
    return c


async def compile_spec(entry: Any, spec: GrammarSpec) -> Any:
    """Compile off the event loop; a bad or too slow grammar is a 400 naming its field."""
    if not getattr(entry.surge, "supports_structured_output", False):
        raise APIError(
            400,
            f"{spec.param.split('.')[0]} needs structured output, which this engine's driver does not "
            "support.",
            param=spec.param.split(".")[0],
            code="unsupported_parameter",
        )
    try:
        return await grammar_compiler(entry).compile_async(spec)
    except GrammarError as e:
        raise invalid_request(str(e), param=e.param) from None
