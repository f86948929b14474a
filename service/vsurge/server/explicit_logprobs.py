"""vLLM's `logprob_token_ids`: the logprobs of ids the client names, at every generated position, in place
of the natural top-k (the sampled token stays first, as vLLM answers).

The engine returns a position's top-k only, so each named id's logprob is read as a prompt logprob: the
context so far plus that id, scored by the engine's prompt-logprob programs (the model's raw distribution,
as every logprob here). That costs one short scoring request per named id and generated token, so the ids
and the tokens they multiply are capped (`MAX_SCORED`), and the prompt is tokenized by the server first
(generation.py) so the contexts are exactly the ids the engine saw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from vsurge.contracts.request import GenerationRequest, ReturnSample
from vsurge.contracts.sampling_params import SamplingParams

from .errors import invalid_request, unsupported_field
from .streams import engine_events

MAX_IDS = 20  # vLLM's max_logprobs, the widest top-k it answers too
MAX_SCORED = 256  # named ids x max_tokens: the scoring requests one answer may cost


def check_logprob_token_ids(
    value: Any, *, logprobs: bool, beam: bool, max_tokens: int, vocab_size: int | None
) -> list[int] | None:
    """The validated id list (None when not asked); bad input is the client's 400 naming the field."""
    if value is None:
        return None
    name = "logprob_token_ids"
    if not isinstance(value, list) or not value or not all(type(t) is int for t in value):
        raise invalid_request(f"'{name}' must be a non-empty list of token ids.", param=name)
    if len(value) > MAX_IDS:
        raise invalid_request(f"'{name}' may name at most {MAX_IDS} ids, got {len(value)}.", param=name)
    bad = next((t for t in value if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        raise invalid_request(f"'{name}' holds {bad}, which is not a token id of this model.", param=name)
    if not logprobs:
        raise invalid_request(f"'{name}' needs logprobs.", param=name)
    if beam:
        raise unsupported_field(name, "it is not supported with beam search")
    ids = list(dict.fromkeys(value))
    if len(ids) * max_tokens > MAX_SCORED:
        raise invalid_request(
            f"'{name}' times max_tokens must be at most {MAX_SCORED} (each named id is scored at every "
            f"generated token), got {len(ids)} x {max_tokens}.",
            param=name,
        )
    return ids


async def _score(surge: Any, base: GenerationRequest, context: list[int], ids: list[int]) -> list[float]:
    """log P(id | context) for each id, as the last prompt logprob of context + [id]."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    reqs = [
        GenerationRequest(
            [*context, t], params, is_client_side_tokenization=True, detokenize=False, adapter=base.adapter
        )
        for t in ids
    ]
    values = [float("-inf")] * len(ids)
    events = engine_events(surge, reqs)
    try:
        async for i, samples in events:
            for s in samples:
                if s.prompt_logprobs and s.prompt_logprobs[-1] is not None:
                    values[i] = s.prompt_logprobs[-1].logprob
    finally:
        await events.aclose()
    return values


async def with_named_logprobs(
    surge: Any,
    requests: list[GenerationRequest],
    ids: list[int],
    events: AsyncIterator[tuple[int, list[ReturnSample]]],
) -> AsyncIterator[tuple[int, list[ReturnSample]]]:
    """``events`` (engine_events' (request index, samples)) with each logprob's top replaced by the sampled
    token and the named ids. ``requests`` hold token-id prompts (the contexts start with them)."""
    generated: dict[tuple[int, int], list[int]] = {}
    try:
        async for i, samples in events:
            out = []
            for s in samples:
                so_far = generated.setdefault((i, s.index), [])
                if s.logprobs:
                    named = []
                    for lp in s.logprobs:
                        context = [*requests[i].prompt, *so_far]
                        values = await _score(surge, requests[i], context, ids)
                        top = [(lp.token_id, lp.logprob)]
                        top += [(t, v) for t, v in zip(ids, values, strict=True) if t != lp.token_id]
                        named.append(dataclasses.replace(lp, top=top))
                        so_far.append(lp.token_id)
                    s = dataclasses.replace(s, logprobs=named)
                else:
                    so_far.extend(s.token_ids)
                out.append(s)
            yield i, out
    finally:
        await events.aclose()


def named_events(
    surge: Any, requests: list[GenerationRequest], ids: list[int] | None
) -> AsyncIterator[tuple[int, list[ReturnSample]]]:
    """engine_events, with `logprob_token_ids` answered when the plan has ids."""
    events = engine_events(surge, requests)
    return events if not ids else with_named_logprobs(surge, requests, ids, events)
