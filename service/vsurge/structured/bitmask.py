"""The packed token mask: bit ``t % 32`` of int32 word ``t // 32`` set <=> token t may be sampled.

The layout llguidance (and xgrammar, vLLM) fill; engines/sampling/ unpacks it on device. A row of all
ones (-1 words) allows every token, so unconstrained slots carry `ALL_ALLOWED` rows and cost nothing.
"""

from __future__ import annotations

import numpy as np

ALL_ALLOWED = -1  # every bit set


def bitmask_words(vocab_size: int) -> int:
    """Words per row: ceil(V / 32)."""
    return (int(vocab_size) + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """int32[rows, ceil(V/32)], every token allowed, C-contiguous (llguidance writes rows in place)."""
    return np.full((rows, bitmask_words(vocab_size)), ALL_ALLOWED, np.int32)


def is_allowed(row: np.ndarray, token: int) -> bool:
    """Whether ``token`` is set in one packed row."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)
