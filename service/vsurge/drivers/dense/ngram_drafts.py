"""The host side of n-gram speculative decoding for one lane's slots: each slot's tokens and its drafts.

A slot's sequence (prompt + every token generated so far) lives in one row of a preallocated buffer, so a
step appends without allocating and the proposer reads a view. `propose` gives every slot that may
speculate up to K draft tokens (`engines.dense.speculative.propose_ngram`: prompt lookup), capped so that a
verify step can never emit past the request's ``max_tokens`` or the context; `advance` appends what a
step emitted (one token per row after a decode step, the accepted draft and one more after a verify step).

Which requests speculate is decided once, at insertion: those whose sampling the verification reproduces
exactly (`spec_verify.plain_sampling`: greedy or temperature alone, no logprobs; each SamplingParams field
declares whether it allows drafts). The others decode as without speculation, in the same steps.

`p_right` estimates how often a draft token is right: after every step with drafts, the share of rows
whose first draft token is the token the target chose (in a decode step too: the draft was proposed, just
not verified), as a moving average. With the verify step's measured cost it decides whether a step
verifies or decodes (`speculative.worth_verifying`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...contracts.sampling_params import SamplingParams
from ...contracts.token_budget import TokenBudget
from ...engines.dense.spec_verify import plain_sampling
from ...engines.dense.speculative import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, propose_ngram

__all__ = ["NgramDrafts"]

P_RIGHT_WEIGHT = 0.1  # of the latest step in the moving average: about the last ten steps count


class NgramDrafts:
    """Token history and drafts of ``slots`` decode slots, K draft tokens per step at most."""

    def __init__(
        self,
        slots: int,
        k: int,
        max_length: int,
        max_ngram: int = DEFAULT_MAX_NGRAM,
        min_ngram: int = DEFAULT_MIN_NGRAM,
    ):
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram
        # a verify step may run up to K + 1 tokens past the context before the slot is released
        self.tokens = np.zeros((slots, max_length + k + 2), np.int32)
        self.length = np.zeros(slots, np.int64)  # tokens held (0: a free slot)
        # a slot's length may not exceed this, whatever it drafts: prompt + max_tokens, within the context
        # (0: the slot never drafts)
        self.cap = np.zeros(slots, np.int64)
        self.p_right = 0.5  # moving average: the first draft token was the target's token

    def observe(self, draft: np.ndarray, num_draft: np.ndarray, chosen: np.ndarray) -> None:
        """A step ran with these drafts; ``chosen`` i32[R]: the token each row emitted first."""
        rows = np.flatnonzero(num_draft[: chosen.shape[0]] > 0)
        if rows.size:
            right = float(np.mean(draft[rows, 0] == chosen[rows]))
            self.p_right += P_RIGHT_WEIGHT * (right - self.p_right)

    def start(
        self, slot: int, prompt: Sequence[int], first_token: int, params: SamplingParams, budget: TokenBudget
    ):
        """A sample entered ``slot``: its prompt, its first token (sampled at insertion) and its budget."""
        n = len(prompt)
        self.tokens[slot, :n] = prompt
        self.tokens[slot, n] = first_token
        self.length[slot] = n + 1
        self.cap[slot] = budget.end if plain_sampling(params) else 0

    def release(self, slot: int) -> None:
        self.length[slot] = 0
        self.cap[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """The sample in slot ``src`` now decodes in the free slot ``dst``."""
        n = int(self.length[src])
        self.tokens[dst, :n] = self.tokens[src, :n]
        self.length[dst], self.cap[dst] = n, self.cap[src]
        self.release(src)

    def propose(self) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for every slot: (i32[S, K] zero padded, i32[S] how many are real)."""
        drafts = np.zeros((self.tokens.shape[0], self.k), np.int32)
        counts = np.zeros(self.tokens.shape[0], np.int32)
        # a verify step emits accepted + 1 tokens: at most cap - length - 1 of them may be drafts
        room = np.minimum(self.cap - self.length - 1, self.k)
        for slot in np.flatnonzero(room > 0):
            n = int(self.length[slot])
            d = propose_ngram(self.tokens[slot, :n], int(room[slot]), self.max_ngram, self.min_ngram)
            drafts[slot, : d.shape[0]] = d
            counts[slot] = d.shape[0]
        return drafts, counts

    def advance(self, tokens: np.ndarray, num_accepted: np.ndarray | None = None) -> None:
        """Append a step's tokens to the live slots: tokens i32[R] (decode step) or i32[R, K+1] with
        num_accepted i32[R] (verify step: the first num_accepted + 1 of each row)."""
        width = self.tokens.shape[1]
        for slot in np.flatnonzero(self.length[: tokens.shape[0]] > 0):
            n = int(self.length[slot])
            new = (
                tokens[slot, : int(num_accepted[slot]) + 1]
                if num_accepted is not None
                else tokens[slot : slot + 1]
            )
            m = min(new.shape[0], width - n)  # a finished row may run past its context before release
            self.tokens[slot, n : n + m] = new[:m]
            self.length[slot] = n + m
