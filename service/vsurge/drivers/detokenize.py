"""Host-side, per-request text streaming: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns one token at a time into the newly finished text. It decodes only a small
window of recent tokens (the prefix-offset / read-offset technique of TGI and vLLM): ``prefix_offset`` marks
tokens already emitted that stay in the window as context (so a decoder that strips or joins at the window
start, e.g. SentencePiece's leading "▁", treats the boundary as it does inside the full text) and
``read_offset`` marks the end of what was emitted. New text is the decoded window minus the decoded context.
While the decoded window ends in U+FFFD (an incomplete UTF-8 sequence: byte-level BPE tokens, or <0xAB>
byte-fallback tokens, that split a character) the text is held back, so a broken character is never sent.

A window that starts on a <0xAB> byte-fallback token gets one plain token (the *anchor*) in front of it, in
the context and in the window alike. Byte-fallback decoders fuse a run of byte tokens into one piece, and
SentencePiece's Metaspace decoder drops every "▁" of the first piece: without the anchor, a byte-encoded
"▁" in a run that the window starts inside of would be dropped here but kept as a space in the full text.
The one run where the full text drops them too is the text's own first piece: a window starting inside
the run of byte tokens that opens the text is decoded from the text's start instead (exact for every
decoder; that run is short in practice: a prompt opens with BOS or a template).

The concatenation of everything ``add`` returned plus ``flush()`` equals
``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`` of the generated
ids (with ``prompt_ids``: the continuation of the prompt's text). Space clean-up is a lossy rewrite across
token boundaries that cannot be streamed; transformers already skips it for BPE tokenizers.

`StopStringMatcher` cuts the output at the first stop string, across chunk boundaries: it holds back any
tail that could still become a stop string, and when one completes it returns the text before it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import tokenizers

__all__ = ["INITIAL_CONTEXT_TOKENS", "IncrementalDetokenizer", "StopStringMatcher", "make_decode_fn"]

# Prompt tokens kept as decoding context before the first generated token (vLLM uses 5 as well).
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def make_decode_fn(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """ids -> text for a transformers tokenizer or a `tokenizers.Tokenizer`, without space clean-up.

    Fast tokenizers are called through their Rust backend directly: the Python wrapper costs several
    times the decode of a 2-token window, and this runs once per generated token.
    """
    backend = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else None
    if backend is None:
        candidate = getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(candidate, tokenizers.Tokenizer):
            backend = candidate
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@functools.lru_cache(maxsize=16)
def byte_pieces_and_anchor(tokenizer: Any) -> tuple[frozenset[int], int | None]:
    """The ids of a tokenizer's <0xAB> byte-fallback pieces, and a plain one-letter token to put in front
    of a window that starts on one (None when there are no byte pieces, or no such letter)."""
    vocab = tokenizer.get_vocab()
    byte_ids = frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.fullmatch(piece))
    if not byte_ids:
        return byte_ids, None
    decode = make_decode_fn(tokenizer, skip_special_tokens=False)
    for letter in "aeoxAEOX":
        i = vocab.get(letter)
        if i is not None and i not in byte_ids and decode([i]) == letter:
            return byte_ids, i
    return byte_ids, None


class IncrementalDetokenizer:
    """Streams the text of one request's generated tokens, never splitting a character."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        max_held_tokens: int = 16,
    ) -> None:
        """``max_held_tokens``: a UTF-8 character spans at most 4 bytes, so more held tokens than this
        means garbage bytes (an untrained model); text up to the last, possibly incomplete, character is
        then released so the stream does not stall."""
        self._decode = make_decode_fn(tokenizer, skip_special_tokens)
        try:
            self._byte_ids, self._anchor = byte_pieces_and_anchor(tokenizer)
        except (AttributeError, TypeError):  # no vocabulary to read: no byte pieces to guard against
            self._byte_ids, self._anchor = frozenset(), None
        self.token_ids: list[int] = [int(t) for t in (prompt_ids or ())]
        # How many byte pieces open the text (the first piece of a byte-fallback decode; see above).
        self._leading_bytes = 0
        self._count_leading_bytes()
        self.num_prompt_tokens = len(self.token_ids)
        self.prefix_offset = max(len(self.token_ids) - INITIAL_CONTEXT_TOKENS, 0)
        self.read_offset = len(self.token_ids)
        self.max_held_tokens = max_held_tokens
        # decode(token_ids[prefix_offset:read_offset]): the context, computed once per window move.
        self._context_text = self._text(self.prefix_offset, self.read_offset)
        # The prompt's context must start on a character boundary: byte-fallback decoders turn a whole
        # run of <0xAB> tokens into U+FFFDs when it starts mid-character. A character spans <= 4 bytes.
        for _ in range(3):
            if self.prefix_offset == 0 or _REPLACEMENT not in self._context_text:
                break
            self.prefix_offset -= 1
            self._context_text = self._text(self.prefix_offset, self.read_offset)
        # Characters released past the context while tokens are held (garbage-byte case only).
        self._released = 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is incomplete)."""
        self.token_ids.append(int(token_id))
        self._count_leading_bytes()
        window = self._text(self.prefix_offset, len(self.token_ids))
        start = len(self._context_text) + self._released
        if window.endswith(_REPLACEMENT):
            if len(self.token_ids) - self.read_offset <= self.max_held_tokens:
                return ""
            # Only the trailing replacement character can still change; release what precedes it.
            out = window[start:-1]
            self._released += len(out)
            return out
        return self._advance(window, start)

    def flush(self) -> str:
        """Release held-back text at the end of the request (an unfinished character becomes U+FFFD)."""
        if self.read_offset == len(self.token_ids):
            return ""
        window = self._text(self.prefix_offset, len(self.token_ids))
        return self._advance(window, len(self._context_text) + self._released)

    def _advance(self, window: str, start: int) -> str:
        out = window[start:]
        # The tokens just emitted become the next window's context.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._context_text = self._text(self.prefix_offset, self.read_offset)
        self._released = 0
        return out

    def _count_leading_bytes(self) -> None:
        ids = self.token_ids
        while self._leading_bytes < len(ids) and ids[self._leading_bytes] in self._byte_ids:
            self._leading_bytes += 1

    def _text(self, start: int, end: int) -> str:
        """decode(token_ids[start:end]), the anchor in front when ``start`` falls on a byte piece; from the
        text's start when ``start`` falls inside the byte run that opens the text (the context and the window
        of one step agree: the run can only grow past a ``start`` that was already inside it)."""
        if start <= self._leading_bytes:
            start = 0
        ids = self.token_ids[start:end]
        if start > 0 and self._anchor is not None and ids and ids[0] in self._byte_ids:
            ids = [self._anchor, *ids]
        return self._decode(ids)


class StopStringMatcher:
    """Cuts streamed text at the first occurrence of any stop string (the stop string is not returned).

    The result equals processing the whole text at once: the output is ``text[:p]`` where ``p`` is the
    smallest start of any stop string in ``text`` (and ``text`` when none occurs), however it is chunked.
    """

    def __init__(self, stop: Sequence[str] | None) -> None:
        self.stop: list[str] = list(stop or ())
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        # Every proper prefix of a stop string: a text tail equal to one may still grow into a match.
        self._prefixes = {s[:k] for s in self.stop for k in range(1, len(s))}
        self._longest_prefix = max((len(s) - 1 for s in self.stop), default=0)
        self._held = ""
        self.hit: str | None = None  # the stop string that ended the text, once one did

    @property
    def held(self) -> str:
        """Text received but not yet released (it might be the start of a stop string)."""
        return self._held

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit). After a hit: ('', True)."""
        if self.hit is not None:
            return "", True
        if not self.stop:
            return text, False
        buf = self._held + text
        match_at, match = self._first_match(buf)
        partial_at = self._partial_start(buf)
        if match is not None and match_at <= partial_at:
            self._held = ""
            self.hit = match
            return buf[:match_at], True
        # Either no match yet, or an earlier partial match could still complete first: hold from there.
        self._held = buf[partial_at:]
        return buf[:partial_at], False

    def flush(self) -> str:
        """Release what is held at the end of the text (cut at a complete stop string held back behind
        a partial one that never completed; `hit` tells whether that happened)."""
        if self.hit is not None:
            return ""
        buf, self._held = self._held, ""
        match_at, match = self._first_match(buf)
        if match is not None:
            self.hit = match
            return buf[:match_at]
        return buf

    def _first_match(self, buf: str) -> tuple[int, str | None]:
        best, which = len(buf), None
        for s in self.stop:
            i = buf.find(s, 0, best + len(s) - 1)  # only an earlier start can improve on `best`
            if i != -1 and (which is None or i < best):
                best, which = i, s
        return best, which

    def _partial_start(self, buf: str) -> int:
        # The longest tail of buf that is a proper prefix of some stop string starts earliest.
        for k in range(min(len(buf), self._longest_prefix), 0, -1):
            if buf[-k:] in self._prefixes:
                return len(buf) - k
        return len(buf)
