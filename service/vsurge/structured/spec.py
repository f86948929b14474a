"""GrammarSpec: what one request constrains its output to, in the form the compiler caches by.

Every API form maps onto one of three llguidance inputs: a JSON schema (response_format json_schema /
json_object, structured_outputs.json, tool calls), a regex (structured_outputs.regex) or a Lark grammar
(structured_outputs.grammar, which also takes llama.cpp GBNF, and structured_outputs.choice). ``param`` names
the request field a compile error is reported against; it is not part of the cache key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "lark")


class GrammarError(ValueError):
    """The grammar cannot be used: invalid, unsupported, or too slow to compile. A 400 naming ``param``.
    Declared with the spec (the first place a grammar is found invalid); the compiler raises it too."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str  # the schema as compact JSON text in the client's key order, the regex, or the Lark grammar
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, param: str = "response_format") -> GrammarSpec:
        # Key order is kept, never sorted: llguidance emits an object's properties in the order the schema
        # lists them (as OpenAI and vLLM do), and a sorted order could put an unbounded array before the
        # required scalars and starve them at max_tokens. So the cache key is the schema as written.
        return cls("json", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> GrammarSpec:
        """Any JSON object (OpenAI's json_object mode)."""
        return cls.json_schema({"type": "object"}, param)

    @classmethod
    def regex(cls, pattern: str, param: str = "structured_outputs.regex") -> GrammarSpec:
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, options: list[str], param: str = "structured_outputs.choice") -> GrammarSpec:
        """Exactly one of the strings. JSON string syntax is Lark's string literal syntax."""
        return cls("lark", "start: " + " | ".join(json.dumps(o) for o in options), param)

    @classmethod
    def grammar(cls, text: str, param: str = "structured_outputs.grammar") -> GrammarSpec:
        """A Lark grammar or a llama.cpp GBNF / EBNF one (converted to Lark)."""
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return cls("lark", any_to_lark(text), param)
        except Exception as e:  # the converter raises its own error types and plain ones on bad input
            raise GrammarError(f"invalid grammar: {e}", param) from e
