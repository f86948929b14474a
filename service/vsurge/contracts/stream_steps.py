"""A stream's steps for `Surge.complete` (the seed's response processing): client-side steps pass through,
server-side steps are buffered while a sample's text stops inside a multi-byte character, then merged.
Pure, no jax.

The driver already holds back the text of an unfinished character (drivers/detokenize.py), so a step that
ends inside one carries token ids whose text has not been sent yet. Buffering such steps and merging them
with the next keeps every item's ``text`` and ``token_ids`` in step: the ids of an item produce its text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from .request import ReturnSample

__all__ = ["ends_inside_character", "merge_steps"]

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_REPLACEMENT = "\ufffd"


def ends_inside_character(
    response: Sequence[ReturnSample],
    decode: Callable[[list[int]], str],
    token_text: Callable[[int], str | None] | None = None,
) -> bool:
    """True if a running sample's step ends in a byte token (``<0xAB>``, ``token_text`` gives a token's
    string) or its token ids decode to text ending in U+FFFD: a character its next token completes."""
    for s in response:
        if s.finish_reason is not None or not s.token_ids:
            continue  # a finished sample's text is complete: the driver flushed it
        if token_text is not None:
            piece = token_text(s.token_ids[-1])
            if piece is not None and _BYTE_TOKEN.match(piece):
                return True
        if decode(list(s.token_ids)).endswith(_REPLACEMENT):
            return True
    return False


def merge_steps(
    response: Sequence[ReturnSample], buffered: Sequence[Sequence[ReturnSample]]
) -> list[ReturnSample]:
    """One ReturnSample per sample (by ``index``, in order of first appearance) from the buffered steps
    followed by ``response``: text, token ids and logprobs concatenated; the totals, the finish reason and
    the error from the sample's latest step; the prompt's details from the step that carried them."""
    if not buffered:
        return list(response)  # nothing held back: the step as it is (the common case, once per step)
    merged: dict[int, ReturnSample] = {}
    for step in [*buffered, response]:
        for s in step:
            m = merged.get(s.index)
            if m is None:
                merged[s.index] = dataclasses.replace(
                    s, token_ids=list(s.token_ids), logprobs=None if s.logprobs is None else list(s.logprobs)
                )
                continue
            m.text += s.text
            m.token_ids += s.token_ids
            if s.logprobs is not None:
                m.logprobs = (m.logprobs or []) + list(s.logprobs)
            for name in ("finish_reason", "num_generated_tokens", "num_prompt_tokens", "error"):
                setattr(m, name, getattr(s, name))
            m.tokens_per_second = s.tokens_per_second
            if m.time_to_first_token is None:
                m.time_to_first_token = s.time_to_first_token
            if m.prompt_token_ids is None and s.prompt_token_ids is not None:
                m.prompt_token_ids = s.prompt_token_ids
                m.prompt_logprobs = s.prompt_logprobs
                m.num_cached_tokens = s.num_cached_tokens
    return list(merged.values())
