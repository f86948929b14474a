"""Prompts: OpenAI's four completion prompt forms, and vLLM's server-side tokenization options
(`truncate_prompt_tokens`, `truncation_side`, `add_special_tokens`). Pure functions raising `APIError`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vsurge.contracts.sampling_params import MAX_N

from .errors import invalid_request
from .sampling_fields import out_of_vocabulary

# Most prompts one /v1/completions request may carry; each becomes its own engine request.
MAX_PROMPTS = MAX_N
# vLLM's words for a missing or empty prompt (clients match on them)
EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."


def completion_prompts(prompt: Any, vocab_size: int | None) -> list[str | list[int]]:
    """OpenAI's four prompt forms -> a list of text or token-id prompts, checked for emptiness and range."""
    if prompt is None:
        raise invalid_request(f"{EMPTY_PROMPT} ('prompt' is missing.)", param="prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise invalid_request(f"{EMPTY_PROMPT} ('prompt' is an empty list.)", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise invalid_request(
            f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(prompts)}.", param="prompt"
        )
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if len(p) == 0:
            raise invalid_request(f"{EMPTY_PROMPT} ('{where}' is empty.)", param="prompt")
        if isinstance(p, list) and vocab_size:
            bad = next((t for t in p if not (0 <= t < vocab_size)), None)
            if bad is not None:
                raise out_of_vocabulary(f"'{where}'", bad, vocab_size, "prompt")
    return prompts


def check_truncation(truncate: int | None, max_length: int) -> int | None:
    """vLLM's truncate_prompt_tokens: None (off), -1 (the context length) or N >= 1 tokens kept."""
    if truncate is None:
        return None
    if truncate == -1:
        return max_length
    if truncate < 1:
        raise invalid_request(
            f"Invalid value for 'truncate_prompt_tokens': must be -1 or >= 1, got {truncate}.",
            param="truncate_prompt_tokens",
        )
    if truncate > max_length:
        raise invalid_request(
            f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len ({max_length}). "
            "Please, select a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    return truncate


def truncate_ids(ids: list[int], keep: int | None, side: str | None) -> list[int]:
    """Keep ``keep`` tokens: the last ones (side 'left', vLLM's default) or the first ('right')."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep :]


def tokenize_prompts(
    prompts: list[str | list[int]],
    *,
    tokenize: Callable[[str], list[int]],
    encode: Callable[[str, bool], list[int]] | None,
    add_special_tokens: bool | None,
    keep: int | None,
    side: str | None,
    always: bool = False,
) -> list[str | list[int]]:
    """Text prompts -> token ids where a tokenization option (or ``always``) asks for it, else unchanged;
    then truncated to ``keep`` tokens.

    ``tokenize`` is the engine's own rule (BOS unless the text starts with it); an explicit
    ``add_special_tokens`` uses ``encode(text, add_special_tokens)`` instead.
    """
    if keep is None and add_special_tokens is None and not always:
        return prompts
    out: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, str):
            if add_special_tokens is not None and encode is not None:
                ids = encode(p, add_special_tokens)
            else:
                ids = tokenize(p)
        else:
            ids = p
        out.append(truncate_ids(list(ids), keep, side))
    return out
