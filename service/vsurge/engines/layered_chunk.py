"""chunked_prefill.py's chunk program as a chain of small programs: the embedding, one decoder layer (one
program for every layer), the final norm; why a chain, see layered_prefill.py (and, for XLA:CPU's window,
dispatch_window.py)."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..models.attention import ChunkAttention
from .aot_program import program
from .dispatch_window import DispatchWindow
from .example_args import abstract

__all__ = ["LayeredChunk", "placed"]


def placed(out: Any, shardings: Any) -> Any:
    """``out`` constrained to ``shardings`` inside a program (None: left where it is)."""
    return out if shardings is None else jax.lax.with_sharding_constraint(out, shardings)


def _chunk_embed_impl(graphdef, state, tokens, start, adapter, *, whole):
    """One chunk's tokens as hidden states [1, C, hidden], their positions from ``start`` on, ``start``
    on the device, and with a LoRA bank (``adapter``: the prompt's slot) each token's slot."""
    positions = (start + jnp.arange(tokens.shape[0], dtype=jnp.int32))[None]
    x = nnx.merge(graphdef, state)(tokens[None])
    lora = None if adapter is None else jnp.full(positions.shape, adapter, jnp.int32)
    return placed((x, positions, jnp.asarray(start, jnp.int32), lora), whole)


def _chunk_layer_impl(graphdef, state, row, x, positions, start, lora, *, window, whole):
    """One decoder layer over the chunk, writing its K/V into the layer's row: (row, hidden states)."""
    layer = nnx.merge(graphdef, state)
    x, row = layer(x, positions, ChunkAttention(window=window), row, (positions, start), lora)
    return placed((tuple(row), x), whole)


def _chunk_finish_impl(graphdef, state, x):
    """The chunk's final hidden states [C, hidden] (the model's last norm)."""
    return nnx.merge(graphdef, state)(x[0])


class LayeredChunk:
    """chunked_prefill.py's chunk program as a chain of the same three parts: ``chunk(params, rows, tokens,
    start[, adapter]) -> (rows, hidden [C, hidden])``, each layer's row donated to its layer's program.
    ``whole``: where rows and hidden states stay between programs (whole on the weights' devices)."""

    def __init__(self, graphdef: Any, params: Any, whole: Any):
        model = nnx.merge(graphdef, params)
        inner = model.model
        window = model.config.sliding_window
        self.place = whole
        # constrained inside the programs on a mesh; on one device every array is where it must be
        whole = whole if isinstance(whole, jax.sharding.NamedSharding) else None
        self._embed = program(partial(_chunk_embed_impl, nnx.graphdef(inner.embed_tokens), whole=whole))
        self._layer = program(
            partial(_chunk_layer_impl, nnx.graphdef(inner.layers[0]), window=window, whole=whole),
            donate_argnums=(1,),
        )
        self._finish = program(partial(_chunk_finish_impl, nnx.graphdef(inner.norm)))
        self.window = DispatchWindow.for_backend()  # XLA:CPU: a few programs queued at a time

    def __call__(self, params, rows, tokens, start, adapter=None) -> tuple[Any, jax.Array]:
        inner = params["model"]
        x, positions, start, lora = self._embed(inner["embed_tokens"], tokens, start, adapter)
        self.window.add(x)
        out = []
        for i, row in enumerate(rows):
            row, x = self._layer(inner["layers"][i], row, x, positions, start, lora)
            out.append(row)
            self.window.add(x)
        hidden = self._finish(inner["norm"], x)
        self.window.add(hidden)
        return tuple(out), hidden

    def jobs(self, name: str, params, row, tokens, start, adapter=None) -> list[tuple[str, Any, tuple]]:
        """(name, program, abstract arguments) of the chain's programs for a chunk of ``tokens``' shape on a
        layer's ``row`` (abstract, where rows are kept)."""
        inner = params["model"]
        embed = (inner["embed_tokens"], tokens, start, adapter)
        x, positions, start, lora = abstract(jax.eval_shape(self._embed, *embed), self.place)
        layer = (inner["layers"][0], row, x, positions, start, lora)
        hidden = abstract(jax.eval_shape(self._layer, *layer)[1], self.place)
        return [
            (f"{name}: embed", self._embed, embed),
            (f"{name}: layer", self._layer, layer),
            (f"{name}: finish", self._finish, (inner["norm"], hidden)),
        ]
