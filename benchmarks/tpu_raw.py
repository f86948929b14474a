"""The TPU benchmark's raw loops: the model's bare jitted decode step with a path's attention and cache
layout (no scheduling), and the bytes a step reads; what tpu_worker.py measures the engine against."""

from __future__ import annotations

import time

import numpy as np


def kv_bytes_per_token(cfg, itemsize: int = 2) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def weight_read_bytes(model) -> int:
    """Bytes a decode step reads from the weights (an untied embedding table is only gathered from)."""
    import jax
    from flax import nnx

    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if model.lm_head is not None:
        emb = model.model.embed_tokens
        total -= emb.embedding[...].nbytes + (0 if emb.scale is None else emb.scale[...].nbytes)
    return total


def param_count(model) -> int:
    import jax
    from flax import nnx

    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ------------------------------------------------------------------------------------------ raw loops


def raw_paged_cache(cfg, batch: int, max_length: int, page: int, dtype):
    """The raw loop's paged cache and page table: every row owns ``max_length`` positions of pages, the
    cache holds exactly those (sized by the layout the cache itself picks: a head_dim-64 model's pages
    are padded to 128 lanes on the kernel path and cost twice the model's bytes). A table naming a page
    the cache does not hold is refused here: the TPU kernel does not bound-check its page DMAs, and an
    index past the cache halts the chip's core (E0200 RuntimeUnexpectedCoreHalt, 2026-12-06, head_dim 64)."""
    from vsurge.engines.paged.paging import PagedAttentionCache, bytes_per_page, cache_layout
    from vsurge.models.paged_attention import use_pallas

    per = -(-max_length // page)
    kv = cache_layout(cfg, 1, kernel=use_pallas())
    storage = PagedAttentionCache.create(
        cfg, page, 0.9, (batch * per + 1) * bytes_per_page(cfg, page, dtype, kv), dtype=dtype
    )
    table = 1 + np.arange(batch * per, dtype=np.int32).reshape(batch, per)
    if int(table.max()) > storage.num_pages:
        raise ValueError(f"the page table names page {int(table.max())}, the cache holds {storage.num_pages}")
    return storage, table


def raw_loop(
    model,
    path: str,
    batch: int,
    context: int,
    max_length: int,
    steps: int = 20,
    walk: int = 0,
    chunk: int | None = None,
) -> dict:
    """Seconds per step of the bare jitted decode step (greedy argmax) over ``batch`` rows at ``context``
    positions, with the attention and cache layout the engine of ``path`` uses. ``walk`` > 0: the rows
    start at ``context`` and advance one position a step for ``walk`` steps, as a fixed batch decodes
    (the read grows with them); ``chunk``: the dense read's positions per step (default: the backend's)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from vsurge.models.attention import DenseDecodeAttention
    from vsurge.models.paged_attention import PagedDecodeAttention
    from vsurge.models.pallas_sharded import configure

    cfg = model.config
    graphdef, params = nnx.split(model)
    dt = model.dtype
    if path == "vdriver":
        backend = DenseDecodeAttention(window=cfg.sliding_window, chunk=chunk)
        shape = (batch, max_length, cfg.num_kv_heads * cfg.head_dim)
        caches = tuple((jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.num_layers))
        meta_of = lambda pos: (pos, pos + 1)  # noqa: E731
    else:
        setup = configure("pallas" if path == "odriver-pallas" else "jax", None, cfg, dt)
        page = 128
        storage, table = raw_paged_cache(cfg, batch, max_length, page, dt)
        caches = storage.allocate()
        table = jnp.asarray(table)
        backend = PagedDecodeAttention(page, -(-(context + walk) // page) + 1, window=cfg.sliding_window)
        meta_of = lambda pos: (pos, table)  # noqa: E731
        del setup

    @jax.jit
    def step(params, caches, tokens, pos):
        m = nnx.merge(graphdef, params)
        hidden, caches = m(tokens[:, None], pos[:, None], backend, caches, meta_of(pos))
        nxt = jnp.argmax(m.compute_logits(hidden[:, 0]), axis=-1).astype(jnp.int32)
        return tuple(caches), nxt, pos + (1 if walk else 0)

    step = jax.jit(step.__wrapped__, donate_argnums=(1,))
    tokens = jnp.ones((batch,), jnp.int32)
    pos = jnp.full((batch,), context - 1, jnp.int32)
    t0 = time.perf_counter()
    caches, tokens, pos = step(params, caches, tokens, pos)
    tokens.block_until_ready()
    compile_s = time.perf_counter() - t0
    best = float("inf")
    n = walk or steps
    for _ in range(2):
        pos = jnp.full((batch,), context - 1, jnp.int32)
        t0 = time.perf_counter()
        for _ in range(n):
            caches, tokens, pos = step(params, caches, tokens, pos)
        tokens.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / n)
    del caches
    out = dict(step_s=best, tok_s=batch / best, compile_s=compile_s, context=context)
    if walk:
        out.update(walk=walk, chunk=chunk)
    return out
