"""Logprobs as OpenAI and vLLM shape them: chat's `content` entries, the legacy completions block (with
echo's prompt part) and vLLM's `prompt_logprobs`. Pure functions; -inf becomes `LOGPROB_FLOOR`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from vsurge.contracts.request import TokenLogprob

# JSON has no -inf; OpenAI-compatible servers send a large negative number for impossible tokens.
LOGPROB_FLOOR = -9999.0


def _lp(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) else LOGPROB_FLOOR


class TokenDecoder:
    """Token id -> its text for logprobs, cached: the same few thousand ids recur across requests."""

    def __init__(self, processor: Any, limit: int = 65536) -> None:
        self._processor = processor
        self._cache: dict[int, str] = {}
        self._limit = limit

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            if self._processor is None:
                s = f"<{token_id}>"
            else:
                # A lone byte of a multi-byte character decodes to U+FFFD, as in OpenAI's output.
                s = self._processor.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < self._limit:
                self._cache[token_id] = s
        return s


def token_id_string(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids: a token written so that any id survives JSON unchanged."""
    return f"token_id:{token_id}"


def chat_logprob_entries(
    logprobs: Iterable[TokenLogprob], decode: Callable[[int], str], with_bytes: bool = True
) -> list[dict[str, Any]]:
    """OpenAI's chat entries; ``with_bytes`` False (tokens as ids) sends null bytes, as vLLM does."""

    def byts(tok: str) -> list[int] | None:
        return list(tok.encode("utf-8")) if with_bytes else None

    out = []
    for lp in logprobs:
        tok = decode(lp.token_id)
        out.append(
            {
                "token": tok,
                "logprob": _lp(lp.logprob),
                "bytes": byts(tok),
                "top_logprobs": [
                    {"token": (t := decode(tid)), "logprob": _lp(v), "bytes": byts(t)} for tid, v in lp.top
                ],
            }
        )
    return out


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": entries, "refusal": None}


def _top_dict(lp: TokenLogprob, decode: Callable[[int], str]) -> dict[str, float]:
    """Legacy top_logprobs entry: the chosen token itself, then the top N (OpenAI: up to N + 1 entries).
    The chosen token first, as vLLM orders it: a client reads the first key as the token at that place."""
    top: dict[str, float] = {}
    # ids that decode alike (bytes of one character all read as U+FFFD) keep the likeliest value
    for tid, v in [(lp.token_id, lp.logprob), *lp.top]:
        key = decode(tid)
        top[key] = max(top.get(key, -math.inf), _lp(v))
    return top


def completion_logprobs(
    logprobs: Iterable[TokenLogprob | None], decode: Callable[[int], str], offset: int, with_top: bool = True
) -> tuple[dict[str, Any], int]:
    """Legacy completions logprobs; `offset` is the character offset of the first token in the text.

    An entry of None is the first prompt token of an echo (nothing precedes it): null logprob and top.
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in logprobs:
        if lp is None:
            continue
        tok = decode(lp.token_id)
        tokens.append(tok)
        token_lps.append(_lp(lp.logprob))
        offsets.append(offset)
        offset += len(tok)
        tops.append(_top_dict(lp, decode))
    return (
        {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops if with_top else None,
            "text_offset": offsets,
        },
        offset,
    )


def echo_logprobs(
    prompt_ids: list[int], prompt_lps: list[TokenLogprob | None] | None, decode: Callable[[int], str]
) -> tuple[dict[str, Any], int]:
    """The prompt's part of an echoed completion's logprobs: its first token has null logprob and top."""
    lps = list(prompt_lps or [])
    first = prompt_ids[0] if prompt_ids else None
    body, offset = completion_logprobs(lps[1:], decode, len(decode(first)) if first is not None else 0)
    if first is not None:
        body["tokens"].insert(0, decode(first))
        body["token_logprobs"].insert(0, None)
        body["top_logprobs"].insert(0, None)
        body["text_offset"].insert(0, 0)
    return body, offset


def join_logprobs(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    return {k: head[k] + tail[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prompt_logprob_entries(
    prompt_lps: list[TokenLogprob | None] | None, decode: Callable[[int], str]
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: None for the first token, then {id: {logprob, rank, decoded_token}} holding
    the prompt token and the top k."""
    if prompt_lps is None:
        return None
    out: list[dict[str, Any] | None] = []
    for lp in prompt_lps:
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(tid): {"logprob": _lp(v), "rank": r, "decoded_token": decode(tid)}
            for r, (tid, v) in enumerate(lp.top, start=1)
        }
        entry[str(lp.token_id)] = {
            "logprob": _lp(lp.logprob),
            "rank": lp.rank,
            "decoded_token": decode(lp.token_id),
        }
        out.append(entry)
    return out
