"""Where each prompt of a prefill call goes: one packed row, or several rows of one length.

A pack of prompts runs as tokens [R, L]: prompts one after another within a row, each row its own
attention. One row (R = 1) is the bucket that holds all of them. Several rows, when prompts queue up, keep
attention per row (its cost grows with the row's length squared, so one 1024-token row of 16 prompts
costs 4x the same prompts in 8 rows of 128) and give the matmuls more rows per call, which XLA:CPU runs
cheaper per token (measured, the 135M model, float32: 133 ms for one 128-token row, 446 ms for 4 rows).
"""

from __future__ import annotations

from collections.abc import Sequence


def row_counts(max_rows: int) -> list[int]:
    """The multi-row shapes compiled: powers of two from 2 up to max_rows."""
    out, r = [], 2
    while r <= max_rows:
        out.append(r)
        r *= 2
    return out


def first_fit(lengths: Sequence[int], row_length: int) -> list[int]:
    """The row of each prompt, oldest first into the first row with room (no prompt may exceed
    row_length)."""
    room: list[int] = []
    rows = []
    for n in lengths:
        if n > row_length:
            raise ValueError(f"a prompt of {n} tokens does not fit a {row_length}-token row")
        r = next((i for i, left in enumerate(room) if left >= n), len(room))
        if r == len(room):
            room.append(row_length)
        room[r] -= n
        rows.append(r)
    return rows


def rows_needed(lengths: Sequence[int], row_length: int) -> int | None:
    """How many rows of row_length the prompts fill; None when one of them is longer than a row."""
    if any(n > row_length for n in lengths):
        return None
    return max(first_fit(lengths, row_length), default=-1) + 1
