"""Greedy tokens through oEngine's mixed-step program, without the sampler (tests of the paged attention
paths: test_tpu_interpret.py, test_paged_layouts.py)."""

from __future__ import annotations

import jax
import numpy as np

import vsurge
from vsurge.contracts.engine_config import EngineConfig
from vsurge.engines.paged.mixed_step import ChunkWork, pack_meta
from vsurge.seed_api.engines import oEngine

PROMPTS = [list(range(3, 23)), [5, 6, 7]]  # 20 tokens: a chunk of 16, then one of 4 (after a prefix)
STEPS = 8


def sharp_checkpoint(directory, **model) -> str:
    """A tiny random Llama whose attention is sharp: weights this small attend almost uniformly, so an
    attention bug (scale, mask, a head read from the wrong shard) would barely move a token."""
    import torch
    from tiny_models import make_checkpoint

    m = make_checkpoint(directory, **model)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    m.save_pretrained(directory)
    return str(directory)


def greedy_steps(
    path: str, spec: str | None, attention: str, engine: dict
) -> tuple[list[list[int]], oEngine, tuple]:
    """`greedy_tokens` of a new engine over the checkpoint at ``path``."""
    model, tok = vsurge.load_model(path)
    eng = oEngine(model, tok, EngineConfig(mesh=spec, attention=attention, **engine), kv_cache_bytes=2 << 20)
    tokens, pages = greedy_tokens(eng)
    return tokens, eng, pages


def greedy_tokens(eng: oEngine) -> tuple[list[list[int]], tuple]:
    """Greedy tokens of PROMPTS through the mixed-step program oDriver runs (decode rows and prefill
    chunks in one forward; PROMPTS[0] in two chunks, its second while PROMPTS[1] decodes), the argmax
    taken here: sampling does not depend on the attention path, and its compile would cost more than
    the rest of a test. One (rows, tokens) program serves every step. Returns the tokens and the pages."""
    m, pages = eng.manager, eng.storage.allocate()
    r, p = eng.max_concurrent_decodes, eng.step_tokens[-1]
    fn, layout = eng._mixed[(r, p)], eng._layout(r, p)
    table = np.zeros((r, eng.table_width), np.int32)
    for slot, prompt in enumerate(PROMPTS):
        assert m.allocate(slot, len(prompt) + STEPS) is not None
        table[slot, : len(m.table(slot))] = m.table(slot)
    put = lambda x: jax.device_put(x, eng._replicated())  # noqa: E731
    dev_table = put(table)
    todo = {0: [(0, 16), (16, len(PROMPTS[0]) - 16)], 1: [(0, len(PROMPTS[1]))]}
    tokens, positions = np.zeros(r, np.int32), np.zeros(r, np.int32)
    out: list[list[int]] = [[] for _ in PROMPTS]
    decoding: set[int] = set()
    while any(len(row) < STEPS for row in out):
        chunks = [(slot, *todo[slot].pop(0)) for slot in todo if todo[slot]]
        active = np.array([s in decoding and len(out[s]) < STEPS for s in range(r)], np.int32)
        work = [ChunkWork(np.asarray(PROMPTS[s][a : a + n], np.int32), a, table[s], s) for s, a, n in chunks]
        meta = pack_meta(layout, work, active)
        pages, dec, pf = fn(eng.params, pages, put(tokens), put(positions), dev_table, meta)
        for s in np.flatnonzero(active):
            tokens[s] = int(np.argmax(dec[s]))
            positions[s] += 1
            out[s].append(int(tokens[s]))
        for k, (s, a, n) in enumerate(chunks):
            if a + n == len(PROMPTS[s]):  # the final chunk: its first token, then it decodes
                tokens[s], positions[s] = int(np.argmax(pf[k])), a + n
                out[s].append(int(tokens[s]))
                decoding.add(s)
    for slot in range(len(PROMPTS)):
        m.free(slot)
    return out, pages
