"""The seed's engine-level records: ResultTokens / SlotData (what a prefill or decode step produced, per
slot), the prefix a dense `prefill` hands to `insert`, and the paged engine's ActiveSequenceBatch,
NextIterationPlan and ModelOutputBatch (what `oEngine.forward` steps, runs and returns).

These are the seed API's shapes over the engines' real steps (dense.py, paged.py); the drivers
never use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ModelOutputBatch", "NextIterationPlan", "ResultTokens", "SeedPrefix", "SlotData"]


class SlotData(NamedTuple):
    """One slot's part of a ResultTokens: tokens and valid [samples_per_slot, 1], lengths
    [samples_per_slot] (tokens generated so far)."""

    tokens: jax.Array | np.ndarray
    valid: jax.Array | np.ndarray
    lengths: jax.Array | np.ndarray


class ResultTokens(NamedTuple):
    """A step's output for every slot in one int32 array ``data`` [slots * samples_per_slot, 3]: column
    ``tokens_idx`` the token, ``valid_idx`` 1 where the slot produced one this step, ``length_idx`` the
    tokens the slot has generated so far. One array, so one device-to-host copy serves a whole step."""

    data: jax.Array | np.ndarray
    tokens_idx: tuple[int, int]
    valid_idx: tuple[int, int]
    length_idx: tuple[int, int]
    samples_per_slot: int

    @classmethod
    def from_columns(cls, tokens: Any, valid: Any, lengths: Any, samples_per_slot: int = 1) -> ResultTokens:
        """Rows of (token, valid, length); on the device when any column is a device array."""
        xp = np if all(isinstance(c, np.ndarray) for c in (tokens, valid, lengths)) else jnp
        data = xp.stack(
            [xp.asarray(c).astype(xp.int32).reshape(-1) for c in (tokens, valid, lengths)], axis=1
        )
        return cls(data, (0, 1), (1, 2), (2, 3), samples_per_slot)

    def copy_to_host_async(self) -> None:
        """Start copying ``data`` to the host (nothing to do when it is there already)."""
        if not isinstance(self.data, np.ndarray):
            self.data.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        """The same result with ``data`` as a host array (waits for the device)."""
        return self._replace(data=np.asarray(self.data))

    def get_result_at_slot(self, slot: int) -> SlotData:
        """The rows of ``slot``: tokens, valid, lengths."""
        lo, hi = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
        rows = self.data[lo:hi]
        return SlotData(
            tokens=rows[:, self.tokens_idx[0] : self.tokens_idx[1]],
            valid=rows[:, self.valid_idx[0] : self.valid_idx[1]],
            lengths=rows[:, self.length_idx[0] : self.length_idx[1]][:, 0],
        )


class SeedPrefix(NamedTuple):
    """What vEngine's seed `prefill` returns for `insert` / `bulk_insert` to place: the engine's own Prefix
    (entry 0), the sampling key, the first token already sampled (so the inserted slot continues from the
    token prefill reported) and the prompt's length."""

    prefix: Any  # vengine.Prefix
    key: np.ndarray  # u32[2]
    first: Any  # SampleResult[1]
    length: int


class NextIterationPlan(NamedTuple):
    """One mixed step of the paged engine: which leading slots decode (bool[S]) and the prefill chunks
    (mixed_step.ChunkWork, at most the engine's ``step_seqs``) it carries."""

    decode: np.ndarray
    chunks: tuple[Any, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.chunks and not bool(np.any(self.decode))


@dataclass
class ModelOutputBatch:
    """What one `oEngine.forward` produced: per slot the new token (``tokens`` i32[S]) where ``valid``
    (a decoding slot's next token, or the first token of a prompt whose final chunk ran), and the same as a
    ResultTokens (lengths: tokens generated so far)."""

    tokens: np.ndarray
    valid: np.ndarray
    result: ResultTokens
