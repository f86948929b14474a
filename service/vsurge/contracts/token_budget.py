"""How many tokens one sample may produce: its ``max_tokens``, within the context its prompt leaves.

One definition, read by both threads of a driver: the step thread frees a slot the step its last token
is dispatched (vdriver's `DenseSlots.left`, odriver's scheduler), the detokenize thread ends the sample
with finish_reason "length" when that token arrives (`ActiveRequest.add_token`), and n-gram drafts never
run past it. The request makes its budget once (`ActiveRequest.budget`), so the threads read the same
object and can never disagree by a token.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenBudget:
    prompt_len: int
    max_tokens: int | None  # None: only the context bounds the sample
    max_length: int  # the engine's context: prompt + generated tokens never exceed it

    @property
    def tokens(self) -> int:
        """Tokens the sample may produce in all (the first one, sampled at prefill, included)."""
        context = self.max_length - self.prompt_len
        return context if self.max_tokens is None else min(self.max_tokens, context)

    @property
    def end(self) -> int:
        """The longest the sequence may grow: prompt + every token it may produce."""
        return self.prompt_len + self.tokens

    def spent(self, produced: int) -> bool:
        """True once ``produced`` tokens use the whole budget: that token was the sample's last."""
        return produced >= self.tokens
