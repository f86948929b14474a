"""Moving live slots down so that decode covers fewer rows (vDriver's dense slots).

A dense decode step runs the leading slots up to the highest live one, rounded up to a compiled row
bucket (`vEngine.decode_bucket`). Slots are handed out lowest first, but they finish in any order: after a
burst of 64 requests the last few long ones sit anywhere in 0..63, so every step ran all 64 rows while
17 were live on average (mixed-64, bfloat16 + ngram: `benchmarks/step_breakdown.py`). A step costs about
55 ms + 4 ms per row there (bfloat16, context 630: 110 / 176 / 313 ms at 16 / 32 / 64 rows).

`plan_moves` (pure) says which live slots to move into which free ones so that the next step fits the
smallest bucket the live slots need; `move_rows_program` (one compiled program, a loop on the device) copies each
moved slot's whole row of the state (KV cache, token, position, sampler row, counts, prompt mask) in place.
A move happens only when it shrinks the bucket, so a lane moves a slot a few times per burst at most.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import numpy as np

from ..aot_program import program
from ..engine_base import constrain


def plan_moves(
    live: Iterable[int], pinned: Iterable[int], free: Iterable[int], buckets: Sequence[int]
) -> list[tuple[int, int]]:
    """(from, to) slot pairs that bring every slot in use under the smallest bucket that holds them all.

    live: slots that may move (decoding); pinned: slots in use that stay where they are (a prompt being
    written in place, a grammar's slot); free: slots nobody holds. buckets: the compiled row counts,
    ascending. No moves when the bucket would not shrink."""
    live, pinned = sorted(live), sorted(pinned)
    if not live:
        return []
    need = max(len(live) + len(pinned), (pinned[-1] + 1) if pinned else 0)
    target = next((b for b in buckets if b >= need), buckets[-1])
    highest = max(live[-1], pinned[-1] if pinned else -1)
    if highest < target:
        return []
    movers = [s for s in live if s >= target]
    below = sorted(s for s in free if s < target)
    # slots below target: live + pinned + free; the free ones are at least as many as the movers
    return list(zip(movers, below[: len(movers)], strict=True))


def _move_rows_impl(state, src, dst, n):
    """Copy row src[i] of every state leaf to row dst[i], for i < n (src, dst i32[S], padded)."""

    def body(i, st):
        def row(x):
            one = jax.lax.dynamic_slice_in_dim(x, src[i], 1, axis=0)
            return jax.lax.dynamic_update_slice_in_dim(x, one, dst[i], axis=0)

        return jax.tree.map(row, st)

    return jax.lax.fori_loop(0, n, body, state)


def move_rows_program(shardings: object) -> object:
    """The jitted move program: (state, src, dst, n) -> state, the state donated and kept in its
    shardings (None: one device)."""
    return program(
        lambda state, src, dst, n: constrain(_move_rows_impl(state, src, dst, n), shardings),
        donate_argnums=0,
    )


def move_args(moves: Sequence[tuple[int, int]], slots: int) -> tuple[np.ndarray, np.ndarray, np.int32]:
    """The program's index arguments for these moves, padded to ``slots`` pairs (one shape for all)."""
    src, dst = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
    for i, (a, b) in enumerate(moves):
        src[i], dst[i] = a, b
    return src, dst, np.int32(len(moves))
