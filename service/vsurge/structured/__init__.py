"""Structured output: grammars (JSON schema, regex, choice, Lark / GBNF) compiled once per schema with
llguidance, a matcher per request sample, and packed token bitmasks (int32[slots, ceil(V/32)]) that the
on-device sampler applies before any other logit processing.

- `spec`     : GrammarSpec, what a request asks for (its cache key) and the constructors per API form;
- `compiler` : GrammarCompiler, the llguidance tokenizer of a model, the compile cache, async compile with a
               timeout; GrammarError (a 400 naming the request field);
- `matcher`  : GrammarMatcher, one request sample's parser state: fills its mask row, accepts tokens;
- `bitmask`  : the packed mask layout (host side) shared with engines/sampling/.
"""

from .bitmask import ALL_ALLOWED, allocate_bitmask, bitmask_words, is_allowed
from .compiler import CompiledGrammar, GrammarCompiler, GrammarError
from .matcher import GrammarMatcher
from .spec import GrammarSpec

__all__ = [
    "ALL_ALLOWED",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "allocate_bitmask",
    "bitmask_words",
    "is_allowed",
]
