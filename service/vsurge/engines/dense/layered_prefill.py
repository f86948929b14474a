"""vEngine's prefill as a chain of small programs: the embedding, one decoder layer, the prompts' last states.

A prefill shape (a bucket, or a pack of rows) used to be one program holding every decoder layer: XLA
compiles each layer's copy anew, so a start compiled the model once per prefill shape, and on a TPU those
were the slowest programs of a start (the 1B shape's 1,024-token prefill: 17 s alone, 64 s in the
parallel pool, of a 73 s cold start on a v5e). Every layer has the same structure and shapes, so here a
shape compiles three programs: ``embed`` (token rows to hidden states), ``layer`` (one decoder layer,
called once per layer with that layer's weights: one executable for all of them) and ``finish`` (the
final norm of each prompt's last state; the prompts' token masks, which the host packs:
`sampling/state.prompt_mask_words`). A prefill dispatches them one after another, asynchronously: the
host returns before the device is done, as with one program. It holds the engine's dispatch lock
meanwhile (the decode steps take it too), so its programs stay together on the device's queue.

The chain's intermediate arrays stay where the next program expects them: replicated hidden states, and
each layer's K/V where a prefix must live to be inserted (`get_prefix_destination_sharding`), so each
program has one signature for every call and nothing compiles while serving. What a layer's program
loses against the fused one (fusion and prefetch across layer boundaries) is small next to a prefill's
matmuls: prefill is compute-bound, where the decode step, which reads every weight for a few tokens, stays
one program (dense/programs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ...models.attention import PrefillAttention
from ...models.lora import has_bank, token_slots
from ..aot_program import program
from ..dispatch_window import DispatchWindow
from ..example_args import abstract
from ..layered_chunk import placed as _placed
from ..sampling.penalties import unpack_token_mask
from .programs import Prefix

__all__ = ["LayeredPrefill"]

# On XLA:CPU a prefill's layers run in this many turns under the dispatch lock (LayeredPrefill._windowed)
CPU_TURNS = 3


def _prefill_embed_impl(graphdef, state, tokens, positions, segments, totals, slots, *, rep):
    """The prompts' rows as hidden states; the rows' host arrays come back as device arrays (the layers
    read them), and with a LoRA bank each token's adapter slot (``slots``: each prompt's)."""
    x = nnx.merge(graphdef, state)(tokens)
    lora = None if slots is None else token_slots(slots, segments)
    return _placed((x, positions, segments, totals, lora), rep)


def _prefill_layer_impl(graphdef, state, x, positions, segments, totals, lora, *, window, shardings):
    """One decoder layer over the packed rows: (hidden states, the layer's K, V [R, L, KVH, D])."""
    layer = nnx.merge(graphdef, state)
    x, (k, v) = layer(
        x, positions, PrefillAttention(window=window), None, (positions, totals, segments), lora
    )
    return _placed((x, k, v), shardings)


def _prefill_finish_impl(graphdef, state, x, starts, lengths, words, sampling, *, vocab: int, rep):
    """Each prompt's final hidden state (the model's last norm, at its last token) and its prompt mask,
    unpacked from the words the host packed (`sampling/state.prompt_mask_words`)."""
    r, t = x.shape[:2]
    last = nnx.merge(graphdef, state)(x.reshape(r * t, -1)[jnp.maximum(starts + lengths - 1, 0)])
    return _placed((last, starts, lengths, unpack_token_mask(words, vocab), sampling), rep)


class LayeredPrefill:
    """The three programs of vEngine's prefill and the chain that runs them; called like the one program
    it replaces: ``prefill(params, tokens, positions, segments, totals, starts, lengths, words, sampling)``
    (vEngine._pack's arrays; ``words``: the prompt masks packed on the host)."""

    def __init__(self, engine: Any):
        model = engine.model
        inner = model.model
        self.num_layers = len(inner.layers)
        self.bank = has_bank(model)
        rep = engine._replicated() if engine.mesh is not None else None
        kv = engine.get_prefix_destination_sharding().kv[0][0] if engine.mesh is not None else None
        self._embed = program(partial(_prefill_embed_impl, nnx.graphdef(inner.embed_tokens), rep=rep))
        self._layer = program(
            partial(
                _prefill_layer_impl,
                nnx.graphdef(inner.layers[0]),
                window=model.config.sliding_window,
                shardings=None if rep is None else (rep, kv, kv),
            )
        )
        self._finish = program(
            partial(_prefill_finish_impl, nnx.graphdef(inner.norm), vocab=model.config.vocab_size, rep=rep)
        )
        self._rep = engine._replicated
        # held while the chain is dispatched, and by the decode steps while they dispatch: the device runs
        # programs in the order they were enqueued, and a decode block enqueued between two layers of a
        # prefill would hold its first token back by a block (~20 ms on a v5e) each time
        self.lock = engine.dispatch_lock
        self.window = DispatchWindow.for_backend()  # XLA:CPU: a few programs queued at a time

    def _slots(self, sampling: Any) -> Any:
        return sampling.lora if self.bank else None

    def __call__(
        self, params, tokens, positions, segments, totals, starts, lengths, words, sampling
    ) -> Prefix:
        inner = params["model"]
        layers = [inner["layers"][i] for i in range(self.num_layers)]
        if self.window.active:  # XLA:CPU: a few programs queued at a time (dispatch_window.py)
            return self._windowed(
                inner, layers, tokens, positions, segments, totals, starts, lengths, words, sampling
            )
        with self.lock:
            x, positions, segments, totals, lora = self._embed(
                inner["embed_tokens"], tokens, positions, segments, totals, self._slots(sampling)
            )
            kv = []
            for layer in layers:
                x, k, v = self._layer(layer, x, positions, segments, totals, lora)
                kv.append((k, v))
            last, starts, lengths, mask, sampling = self._finish(
                inner["norm"], x, starts, lengths, words, sampling
            )
        return Prefix(tuple(kv), last, starts, lengths, mask, sampling)

    def _windowed(
        self, inner, layers, tokens, positions, segments, totals, starts, lengths, words, sampling
    ) -> Prefix:
        """The chain on XLA:CPU: each program added to the window, and the layers run in turns of
        ``CPU_TURNS`` under the dispatch lock. The CPU runs a decode step and a prefill layer side by side,
        each at about half speed, so a burst of prompts waited for its first tokens as long again; a
        decode step waits for at most one turn (a third of one prompt's layers, never a whole prompt)
        and the prompts get the cores between two steps (serve's defaults under random-24, one sitting:
        TTFT p50 6.0 s -> 3.5 s, p99 22.7 s -> 13.3 s, output tok/s 81.8 -> 83.6, ITL p99 0.21 -> 1.5 s)."""
        x, positions, segments, totals, lora = self._embed(
            inner["embed_tokens"], tokens, positions, segments, totals, self._slots(sampling)
        )
        self.window.add(x)
        kv = []
        turn = -(-len(layers) // CPU_TURNS)
        for start in range(0, len(layers), turn):
            with self.lock:  # the decode step's turn comes between two of these
                for layer in layers[start : start + turn]:
                    x, k, v = self._layer(layer, x, positions, segments, totals, lora)
                    kv.append((k, v))
                    self.window.add(x)
                self.window.wait(x)
        last, starts, lengths, mask, sampling = self._finish(
            inner["norm"], x, starts, lengths, words, sampling
        )
        self.window.add(last)
        return Prefix(tuple(kv), last, starts, lengths, mask, sampling)

    def eval_shape(self, *args: Any) -> Prefix:
        """The Prefix a call returns, as shapes (for the programs a prefix feeds)."""
        return jax.eval_shape(self, *args)

    def jobs(self, name: str, make_args: Callable[[], tuple]) -> list[tuple[str, Any, Callable[[], tuple]]]:
        """(name, program, a callable making its abstract arguments) of the chain's three programs for the
        prefill whose arguments ``make_args`` makes, each on what the program before it returns, placed
        where a call leaves it."""

        def embed() -> tuple:
            params, tokens, positions, segments, totals, *_, sampling = make_args()
            return (
                params["model"]["embed_tokens"],
                tokens,
                positions,
                segments,
                totals,
                self._slots(sampling),
            )

        def embedded() -> tuple:
            return abstract(jax.eval_shape(self._embed, *embed()), self._rep())

        def layer() -> tuple:
            x, positions, segments, totals, lora = embedded()
            return (make_args()[0]["model"]["layers"][0], x, positions, segments, totals, lora)

        def finish() -> tuple:
            params, *_, starts, lengths, words, sampling = make_args()
            x = abstract(jax.eval_shape(self._layer, *layer())[0], self._rep())
            return (params["model"]["norm"], x, starts, lengths, words, sampling)

        return [
            (f"{name}: embed", self._embed, embed),
            (f"{name}: layer", self._layer, layer),
            (f"{name}: finish", self._finish, finish),
        ]
