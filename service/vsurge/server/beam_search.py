"""Beam search (vLLM's `use_beam_search`), run on the server over the engine's public `complete` API.

As vLLM's own server does it: each step asks the engine for one token of every live beam with the top
2 x width logprobs, extends each beam by each candidate, keeps the `width` best live beams by
cumulative logprob / sequence length ** length_penalty, and sets beams that produced EOS aside (unless
ignore_eos). After max_tokens steps (or when no beam is live) the `width` best of the finished and live beams
are the answer, best first; a beam cut by the step limit finishes with "length".

Cost: each step is `width` one-token requests whose prompts grow by one token (on the vDriver every step
re-reads its prompt: there is no prefix cache), so it suits short answers. Beams are ranked by the model's
own log-probabilities: temperature, top_p / top_k / min_p, penalties, logit_bias, allowed_token_ids and stop
strings do not apply (as in vLLM). `expand` and `best` are pure; `search` is the I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vsurge.contracts.request import GenerationRequest, ReturnSample, vSurgeMetadata
from vsurge.contracts.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

from .streams import engine_events


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]  # the generated tokens (EOS included when it ended on one)
    logprob: float  # cumulative log-probability of `tokens`
    finish_reason: str | None = None  # "stop" when it ended on EOS, else None while live


def score(beam: Beam, prompt_len: int, length_penalty: float, eos_ids: frozenset[int]) -> float:
    """vLLM's ranking: cumulative logprob / (prompt + generated tokens, EOS not counted) ** length_penalty."""
    n = prompt_len + len(beam.tokens)
    if beam.tokens and beam.tokens[-1] in eos_ids:
        n -= 1
    return beam.logprob / max(n, 1) ** length_penalty


def expand(
    beams: Sequence[Beam],
    candidates: Sequence[Sequence[tuple[int, float]]],
    *,
    width: int,
    eos_ids: frozenset[int],
    ignore_eos: bool,
    prompt_len: int,
    length_penalty: float,
) -> tuple[list[Beam], list[Beam]]:
    """One step: beam i extended by each of its ``candidates[i]`` (token, logprob) -> (the ``width`` best
    live beams, the beams that ended on EOS this step)."""
    live, done = [], []
    for beam, cands in zip(beams, candidates, strict=True):
        for token, lp in cands:
            if not math.isfinite(lp):
                continue
            grown = Beam((*beam.tokens, int(token)), beam.logprob + float(lp))
            if int(token) in eos_ids and not ignore_eos:
                done.append(Beam(grown.tokens, grown.logprob, "stop"))
            else:
                live.append(grown)
    live.sort(key=lambda b: score(b, prompt_len, length_penalty, eos_ids), reverse=True)
    return live[:width], done


def best(
    live: Sequence[Beam],
    done: Sequence[Beam],
    *,
    width: int,
    eos_ids: frozenset[int],
    prompt_len: int,
    length_penalty: float,
) -> list[Beam]:
    """The ``width`` best of the finished and the still-live beams (those finish with "length"), best first."""
    pool = [*done, *(Beam(b.tokens, b.logprob, "length") for b in live)]
    pool.sort(key=lambda b: score(b, prompt_len, length_penalty, eos_ids), reverse=True)
    return pool[:width]


async def search(
    surge: Any,
    prompt_ids: list[int],
    *,
    width: int,
    max_tokens: int,
    length_penalty: float,
    ignore_eos: bool,
    eos_ids: frozenset[int],
    max_prompt_length: int,
    request_id: str,
) -> list[Beam]:
    """Run one prompt's beam search on ``surge``; the ``width`` best beams, best first."""
    k = min(2 * width, MAX_TOP_LOGPROBS)
    step_params = SamplingParams(
        max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=k, ignore_eos=True
    )
    live, done = [Beam((), 0.0)], []
    for step in range(max_tokens):
        if len(prompt_ids) + step > max_prompt_length:
            break  # the next prompt would not fit the context: what is live ends with "length"
        requests = [
            GenerationRequest(
                [*prompt_ids, *b.tokens],
                step_params,
                metadata=vSurgeMetadata(id=f"{request_id}-beam{step}.{j}"),
                is_client_side_tokenization=True,
                detokenize=False,
            )
            for j, b in enumerate(live)
        ]
        candidates: list[list[tuple[int, float]]] = [[] for _ in live]
        events = engine_events(surge, requests)
        try:
            async for i, samples in events:
                for s in samples:
                    if s.logprobs:
                        candidates[i] = list(s.logprobs[0].top)
        finally:
            await events.aclose()
        live, finished = expand(
            live,
            candidates,
            width=width,
            eos_ids=eos_ids,
            ignore_eos=ignore_eos,
            prompt_len=len(prompt_ids),
            length_penalty=length_penalty,
        )
        done.extend(finished)
        if not live:
            break
    return best(
        live, done, width=width, eos_ids=eos_ids, prompt_len=len(prompt_ids), length_penalty=length_penalty
    )


def beam_samples(beams: Sequence[Beam], prompt_ids: list[int], decode: Any) -> list[ReturnSample]:
    """The beams as the engine's samples (one whole delta each, index = rank), for the usual shaping."""
    out = []
    for j, b in enumerate(beams):
        tokens = list(b.tokens[:-1] if b.finish_reason == "stop" else b.tokens)  # EOS is not text
        out.append(
            ReturnSample(
                text=decode(tokens) if tokens else "",
                token_ids=tokens,
                index=j,
                finish_reason=b.finish_reason or "length",
                num_generated_tokens=len(b.tokens),
                num_prompt_tokens=len(prompt_ids),
                prompt_token_ids=list(prompt_ids),
            )
        )
    return out
