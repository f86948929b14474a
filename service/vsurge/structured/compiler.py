"""GrammarCompiler: a model's llguidance tokenizer, one compile per grammar (LRU cache), compiles off the
event loop with a timeout.

llguidance compiles lazily: building a matcher checks the grammar and builds the lexer's first states (a
JSON schema of a dozen fields takes ~1-2 ms on SmolLM2's 49k vocabulary), later states are built during mask
computation. `compile` validates with the tokenizer (so an unsupported keyword, a bad regex or an unknown
Lark rule is an error here, before the request reaches the engine) and keeps a fresh matcher to copy for each
request sample.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

from .matcher import GrammarMatcher
from .spec import GrammarError, GrammarSpec

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 256
# JSON as json.dumps writes it: no free whitespace between tokens (a model left to choose whitespace may
# never stop emitting it), ", " and ": " as the separators models see most.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class CompiledGrammar:
    """A validated grammar: hands each request sample a matcher of its own."""

    def __init__(self, spec: GrammarSpec, template: Any) -> None:
        self.spec = spec
        self._template = template  # a fresh llguidance.LLMatcher, never advanced

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one model's tokenizer; thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_workers: int = 2,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.timeout_s = float(timeout_s)
        self._cache_size = int(cache_size)
        self._cache: collections.OrderedDict[GrammarSpec, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._lltok = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="vsurge-grammar")

    # ------------------------------------------------------------------ tokenizer
    def lltokenizer(self):
        """The llguidance tokenizer (built once, ~1 s for a 49k vocabulary)."""
        with self._tok_lock:
            if self._lltok is None:
                import llguidance

                backend = getattr(self._tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise GrammarError("structured output needs a fast (tokenizers) tokenizer", "model")
                # vocab_size: the logits' width, which may exceed the tokenizer's (padded embeddings); ids
                # past the tokenizer are never allowed
                self._lltok = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            return self._lltok

    def warm(self) -> concurrent.futures.Future:
        """Build the tokenizer in the background (server start), so the first request does not pay it."""
        return self._pool.submit(self.lltokenizer)

    # ------------------------------------------------------------------ compile
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or fetch from the cache) on the calling thread; raises GrammarError."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = CompiledGrammar(spec, self._build(spec))
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    async def compile_async(self, spec: GrammarSpec) -> CompiledGrammar:
        """`compile` on a worker thread; a compile past ``timeout_s`` is a GrammarError (the worker finishes
        it in the background and caches it)."""
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        fut = self._pool.submit(self.compile, spec)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"the grammar took longer than {self.timeout_s:g}s to compile; simplify it", spec.param
            ) from None

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _grammar_text(self, spec: GrammarSpec) -> str:
        import llguidance

        if spec.kind == "json":
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=_JSON_OPTIONS)
            except ValueError as e:
                raise GrammarError(f"invalid JSON schema: {e}", spec.param) from e
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        return llguidance.LLMatcher.grammar_from_lark(spec.source)

    def _build(self, spec: GrammarSpec):
        import llguidance

        text = self._grammar_text(spec)
        tok = self.lltokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tok)
        if is_error:
            what = {"json": "JSON schema", "regex": "regex", "lark": "grammar"}[spec.kind]
            raise GrammarError(f"invalid or unsupported {what}: {messages[0].strip()}", spec.param)
        matcher = llguidance.LLMatcher(tok, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"cannot use the grammar: {matcher.get_error()}", spec.param)
        return matcher
