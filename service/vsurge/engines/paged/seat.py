"""Seating a paged sequence in its decode slot, in two parts: `first_token` samples the token after its
prompt from the logits at the prompt's last token, and `place` sets the slot's state from it (the token
the slot feeds next, its position, the sampler's step counter, the penalty counts, the prompt mask and
the sampler row). `seat` is both, one program: what oEngine's mixed step (`seat_chunk`) and
`prefill_chunk` run after a final chunk.

The seed layer runs the two apart (vsurge/seed_api/paged.py): its `prefill` samples the first token of a prompt not
yet in any slot (`first_of_chunk`), its `insert` places it in the slot it is given (`place`). The KV stays
in the pages the chunks wrote; only the page ids move, on the host.
"""

from __future__ import annotations

from typing import Any

from ..engine_base import constrain, sampling_context
from ..sampling import SampleResult, sample, set_slot

__all__ = ["first_of_chunk", "first_token", "place", "seat"]


def first_token(
    logits: Any, inputs: Any, token_mask: Any = None, *, num_top: int, shardings: Any
) -> SampleResult:
    """The token after a prompt from the logits at its last token (f32[V]); ``inputs`` a SeqInputs;
    ``token_mask`` (i32[1, ceil(V/32)]): a structured request's allowed first tokens."""
    with sampling_context(shardings):
        return sample(
            logits[None],
            inputs.sampling,
            inputs.counts[None],
            inputs.prompt_mask[None],
            inputs.step[None],
            num_top,
            token_mask=token_mask,
        )


def place(state: Any, slot: Any, length: Any, inputs: Any, token: Any, *, shardings: Any) -> Any:
    """Put the sequence in ``slot`` of the PagedState (or of its `SamplerRows`: nothing here reads the
    pages): it feeds ``token`` (its first, sampled after its
    ``length`` prompt tokens) at position ``length`` in the next decode step."""
    new = state._replace(
        tokens=state.tokens.at[slot].set(token),
        positions=state.positions.at[slot].set(length),
        steps=state.steps.at[slot].set(inputs.step + 1),
        counts=state.counts.at[slot].set(inputs.counts.at[token].add(1)),
        prompt_mask=state.prompt_mask.at[slot].set(inputs.prompt_mask),
        sampling=set_slot(state.sampling, slot, inputs.sampling),
    )
    return constrain(new, shardings)


def seat(
    state: Any,
    logits: Any,
    slot: Any,
    length: Any,
    inputs: Any,
    token_mask: Any = None,
    *,
    num_top: int,
    shardings: Any,
):
    """Sample the token after a chunk (under ``token_mask`` if given) and seat the sequence in its slot
    (one shape for every chunk)."""
    first = first_token(logits, inputs, token_mask, num_top=num_top, shardings=shardings)
    return place(state, slot, length, inputs, first.tokens[0], shardings=shardings), first


def first_of_chunk(logits: Any, k: Any, inputs: Any, *, num_top: int, shardings: Any) -> SampleResult:
    """`first_token` after chunk ``k`` of a mixed step (``logits`` f32[K, V], one row per chunk)."""
    return first_token(logits[k], inputs, num_top=num_top, shardings=shardings)
