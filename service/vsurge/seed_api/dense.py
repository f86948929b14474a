"""vEngine's seed-form steps, each a call of the engine's own method:

* `prefill(graphstate, graphothers, tokens, valids, true_length, temperature, top_p, rngs)` prefills the
  prompt (`vEngine.prefill`) and samples its first token with ``rngs`` (`sample_first`); returns a
  SeedPrefix and that token as ResultTokens;
* `insert(prefix, decode_state, slot)` / `bulk_insert(prefix, decode_state, slots)` place it
  (`vEngine.insert` with the token prefill reported) and return the decode state;
* `decode(graphstate, graphothers, state, rngs)` advances every active slot one token (`vEngine.decode`)
  and returns (state, ResultTokens of every slot).

Sampling keys are the engine's: a slot samples with the key its prompt was inserted with and its own step
counter, so ``rngs`` of `decode` is not used (the same tokens whatever runs beside a request).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..contracts.sampling_params import SamplingParams
from .engine_layer import SeedEngineLayer, host_key
from .types import ResultTokens, SeedPrefix

__all__ = ["DenseSeedLayer", "prompt_ids"]


def prompt_ids(tokens: Any, valids: Any, true_length: int) -> list[int]:
    """The prompt of a seed prefill: the valid positions of ``tokens`` ([L] or [1, L]; ``valids`` None:
    the first ``true_length``), which must be ``true_length`` tokens."""
    toks = np.asarray(tokens).reshape(-1)
    if valids is not None:
        mask = np.asarray(valids, bool).reshape(-1)
        if mask.shape != toks.shape:
            raise ValueError(f"valids has shape {np.shape(valids)}, tokens {np.shape(tokens)}")
        toks = toks[mask]
    else:
        toks = toks[: int(true_length)]
    if len(toks) != int(true_length) or not len(toks):
        raise ValueError(f"true_length {true_length} but {len(toks)} valid prompt tokens")
    return [int(t) for t in toks]


def _scalar(x: Any) -> float:
    return float(np.asarray(x).reshape(-1)[0])


def _is_seed_prefill(args: tuple, kw: dict) -> bool:
    return len(args) > 3 or bool({"graphstate", "valids", "true_length", "rngs"} & kw.keys())


def _is_seed_decode(args: tuple, kw: dict) -> bool:
    return len(args) + len(kw) > 1


def _is_seed_prefix(args: tuple, kw: dict) -> bool:
    return isinstance(args[0] if args else kw.get("prefix"), SeedPrefix)


class DenseSeedLayer(SeedEngineLayer):
    """vEngine's seed layer (see the module docstring); `seed_forms` wires the methods named here."""

    _seed_forms = {
        "prefill": (_is_seed_prefill, "seed_prefill"),
        "decode": (_is_seed_decode, "seed_decode"),
        "insert": (_is_seed_prefix, "seed_insert"),
        "bulk_insert": (_is_seed_prefix, "seed_bulk_insert"),
    }

    def seed_prefill(
        self,
        graphstate: Any,
        graphothers: Any,
        tokens: jax.Array,
        valids: jax.Array,
        true_length: int,
        temperature: jax.Array,
        top_p: jax.Array,
        rngs: jax.Array,
    ) -> tuple[SeedPrefix, ResultTokens]:
        """Prefill one prompt and sample its first token with ``rngs``: (prefix for `insert`, the token as
        ResultTokens [1 slot, length 1])."""
        self._check_weights(graphstate, graphothers)
        ids = prompt_ids(tokens, valids, true_length)
        params = SamplingParams(temperature=_scalar(temperature), top_p=_scalar(top_p), max_tokens=1)
        params.validate()
        key = host_key(rngs)
        prefix = self.prefill(ids, params, self.eos_token_ids)
        first = self.sample_first(prefix, key, 0)
        one = np.ones(1, np.int32)
        return SeedPrefix(prefix, key, first, len(ids)), ResultTokens.from_columns(first.tokens, one, one)

    def seed_insert(self, prefix: SeedPrefix, decode_state: Any, slot: int) -> Any:
        """Place a seed prefix into ``slot``; it continues from the first token its prefill returned."""
        state, _ = self.insert(
            prefix.prefix, decode_state, slot, prefix.key, 0, prefix.length, None, prefix.first
        )
        return state

    def seed_bulk_insert(self, prefix: SeedPrefix, decode_state: Any, slots: list[int]) -> Any:
        """Place one seed prefix into several slots (samples of one prompt): each starts from the prefill's
        first token and then samples with its own key (the prefill's, folded with the sample's index)."""
        keys = [prefix.key] + [host_key(jax.random.fold_in(prefix.key, i)) for i in range(1, len(slots))]
        firsts = [prefix.first] * len(slots)
        state, _ = self.bulk_insert(prefix.prefix, decode_state, slots, keys, 0, prefix.length, None, firsts)
        return state

    def seed_decode(
        self, graphstate: Any, graphothers: Any, state: Any, rngs: jax.Array
    ) -> tuple[Any, ResultTokens]:
        """One token for every active slot: (state, ResultTokens of all max_concurrent_decodes slots; valid
        where the slot was active, lengths the tokens it has generated)."""
        self._check_weights(graphstate, graphothers)
        host_key(rngs)  # checked, not used (see the module docstring)
        valid = self.read_lengths(self.max_concurrent_decodes) > 0
        state, out = self.decode(state)
        rows = out.tokens.shape[0]
        tokens = jnp.zeros(self.max_concurrent_decodes, jnp.int32).at[:rows].set(out.tokens)
        return state, ResultTokens.from_columns(tokens, valid.astype(np.int32), state.steps)
