"""No compiled program of either engine copies a whole KV cache (issue 51).

A step's cost must follow the rows and positions it reads. On XLA:CPU a 4-d per-head view of vEngine's
flat cache [S, M, KVH * D] taken outside the read loop was materialized: 8 copies of every layer's whole
cache per decode step (240 for the 135M model), so one stream over 16 slots x 2048 positions decoded at
0.4 tok/s against the raw loop's 25. Timings vary with the machine; the compiled program does not: this
reads every program's optimized HLO (compile()'s, the run-once and the structured ones, as
`program_inventory.programs` lists them) and fails on any copy, transpose or concatenate as large as one
layer's cache (or its pages).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import vsurge
from vsurge.engines.program_inventory import programs
from vsurge.seed_api.engines import oEngine, vEngine

# slots x positions large enough that one layer's cache outweighs every weight of the tiny model
DENSE = dict(max_concurrent_decodes=8, max_length=512, prefill_lengths=[16, 64])
PAGED = dict(max_concurrent_decodes=8, max_length=512, prefill_lengths=[16, 64], page_size=16)
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* (copy|transpose|concatenate)\(", re.M)


def whole_cache_copies(hlo: str, cache: tuple[int, ...], kv_heads: int) -> list[str]:
    """The copy / transpose / concatenate ops of ``hlo`` that hold one layer's cache of shape ``cache``
    ([S, M, KVH * D] rows or [P, page, KVH, D] pages), in any layout: at least its elements, over its
    position axis and its heads' lanes (KVH * D, or KVH and D). A prefill's or a chunk's activations
    can be as large (scores over every position of a row) but never carry the lanes."""
    positions, d = cache[1], cache[-1] if len(cache) == 4 else cache[-1] // kv_heads
    elements = int(np.prod(cache))
    found = []
    for m in _OP.finditer(hlo):
        dims = [int(x) for x in m.group(1).split(",") if x]
        lanes = kv_heads * d in dims or (kv_heads in dims and d in dims)
        if int(np.prod(dims or [0])) >= elements and positions in dims and lanes:
            found.append(m.group(0).strip()[:160])
    return found


def test_the_check_sees_a_copy_not_activations():
    hlo = """
  %copy.1 = f32[8,512,32]{2,1,0} copy(%p), metadata={}
  %copy.2 = f32[8,32]{1,0} copy(%q)
  %transpose.4 = f32[4,512,2,64]{1,3,2,0} transpose(%s), dimensions={0,2,1,3}
  ROOT %transpose.3 = f32[8,512,4,8]{3,1,2,0} transpose(%r), dimensions={0,2,1,3}
"""
    assert [c.split()[0] for c in whole_cache_copies(hlo, (8, 512, 32), 4)] == ["%copy.1", "ROOT"]


def _layer_cache(engine) -> tuple[int, ...]:
    return engine.storage.page_shape if isinstance(engine, oEngine) else engine._cache_shape()


@pytest.mark.parametrize("cls", [vEngine, oEngine])
def test_no_program_copies_a_whole_cache(tiny_checkpoint, cls):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    model, tok = vsurge.load_model(path)
    engine = cls(model, tok, **(PAGED if cls is oEngine else DENSE))
    cache = _layer_cache(engine)
    seen, bad = 0, {}
    for p in programs(engine):
        hlo = p.fn.lower(*p.args).compile().as_text()
        seen += 1
        if copies := whole_cache_copies(hlo, cache, engine.model_config.num_kv_heads):
            bad[p.name] = copies
    assert seen > 10  # the inventory was walked
    assert bad == {}, f"programs copying a whole layer's cache {cache}: {bad}"
