"""GrammarMatcher: the parser state of one request sample (one slot).

The detokenize side calls `accept` with each token the sampler produced; `fill` writes the mask of the next
token into the slot's row of the packed bitmask. EOS is set in the mask only where the grammar accepts, and
`done` turns true once the grammar is complete (nothing but EOS could follow), so the request can finish
without spending a step on the EOS token.
"""

from __future__ import annotations

import numpy as np


class GrammarMatcher:
    def __init__(self, matcher) -> None:  # llguidance.LLMatcher
        self._m = matcher

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's allowed set into ``row`` (int32[ceil(V/32)], C-contiguous)."""
        if row.dtype != np.int32 or not row.flags["C_CONTIGUOUS"]:
            raise ValueError("mask row must be a C-contiguous int32 array")
        # drops the GIL while it computes
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (the matcher is then in error)."""
        return bool(self._m.consume_token(int(token)))

    @property
    def done(self) -> bool:
        """The grammar is complete: the output may end here and nothing else may follow."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""
