"""The Pallas TPU ragged paged attention kernel inside ``shard_map``, and which attention backend runs.

Mosaic kernels cannot be partitioned by XLA, so on a mesh every kernel call goes through `shard_map` with
explicit specs that match where the engine keeps its arrays (models/sharding.py, engines/paging.py):

* KV pages ``[num_pages, page_size, 2 * kv_heads, head_dim]`` (the combined layout): heads over ``tp``,
  whole over ``dp``; queries ``[tokens, heads, head_dim]``: heads over ``tp``. Each ``tp`` shard holds
  whole kv heads (K and V side by side) and exactly the query heads that read them, so the kernel runs
  unchanged on its shard.
* Decode rows (one query each) are split over ``dp`` when the row count divides; each ``dp`` group then
  runs the kernel on its own rows with its own ``cu_q_lens``. A prefill chunk (one sequence) is not split.

Which implementation runs inside the ``shard_map`` (``kernel``):

* ``mosaic``: the compiled kernel (TPU);
* ``interpret``: the same kernel in Pallas' TPU interpret mode (any backend; used for CI when this jax can
  interpret it, see `interpret_failure`);
* ``reference``: `reference_ragged_attention`, pure JAX with the kernel's signature and semantics.

The backend (EngineConfig ``attention``, ``--attention`` / ``VSURGE_ATTENTION``): ``jax`` keeps the pure-JAX
paths of paged_attention.py; ``pallas`` takes this module's path on every backend (off TPU with the
interpreted kernel, or the reference where the kernel cannot be interpreted, logged once with the reason);
``auto`` takes it on TPU when the kernel supports the model's shapes. The engine calls `configure` when it
is built; the traced programs read the setting (one attention setting per process: the last engine built).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..engine_config import ATTENTION_BACKENDS

log = logging.getLogger(__name__)

KERNELS = ("mosaic", "interpret", "reference")
_NEG = -1e30
_LANES = 128  # the kernel keeps its softmax statistics in 128-lane rows: head_dim must be a multiple


@dataclasses.dataclass(frozen=True)
class AttentionSetup:
    """What `configure` decided: whether paged attention takes the kernel path, and with which kernel."""

    backend: str = "auto"
    mesh: Mesh | None = None
    pallas: bool = False
    kernel: str = "reference"
    reason: str = ""  # why this kernel (logged; tests print it)


_SETUP: AttentionSetup | None = None  # None: not configured


def current() -> AttentionSetup:
    """The configured setup; unconfigured (a backend used without an engine): the kernel on TPU only."""
    if _SETUP is not None:
        return _SETUP
    if jax.default_backend() == "tpu" and kernel_available():
        return AttentionSetup("auto", None, True, "mosaic", "unconfigured, on TPU")
    return AttentionSetup("auto", None, False, "reference", "unconfigured")


def kernel_available() -> bool:
    """Whether this jax ships the ragged paged attention kernel."""
    try:
        from jax.experimental.pallas.ops.tpu import ragged_paged_attention  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the jax build
        return False
    return True


def kv_heads_error(num_q_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why the paged cache cannot split ``num_kv_heads`` over ``tp`` (None: it can).

    Each tp shard must hold whole kv heads with the query heads that read them; replicating the whole
    cache on every chip instead would silently multiply its memory by tp, so the engine refuses.
    """
    if num_kv_heads % tp == 0 and num_q_heads % tp == 0:
        return None
    ok = [n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0 and num_q_heads % n == 0]
    return (
        f"the paged KV cache splits kv heads over the mesh's tp axis, but the model has {num_kv_heads} kv "
        f"heads ({num_q_heads} query heads), which tp={tp} does not divide; use tp in {ok} "
        "(the rest of the chips can go to dp)"
    )


def kernel_shape_error(
    num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype, tp: int = 1
) -> str | None:
    """Why the TPU kernel cannot take these shapes on each tp shard (None: it can), from its own limits."""
    if head_dim % _LANES:
        return f"head_dim {head_dim} is not a multiple of {_LANES} (the kernel's softmax tiles)"
    combined = 2 * num_kv_heads // tp
    packing = 4 // jnp.dtype(kv_dtype).itemsize
    per = combined // packing if combined % packing == 0 else 0
    if not (per in (1, 2, 4, 8) or (per and per % 8 == 0)):
        return (
            f"{combined} combined kv heads per tp shard cannot be tiled for {jnp.dtype(kv_dtype).name} "
            "(the kernel needs 2*kv_heads/tp/packing in 1, 2, 4, 8 or a multiple of 8)"
        )
    return None


@functools.cache
def interpret_failure() -> str | None:
    """Why this jax cannot run the kernel in Pallas' TPU interpret mode (None: it ran and matched the
    reference), found by running it once on a tiny input."""
    if not kernel_available():
        return f"jax {jax.__version__} ships no jax.experimental.pallas.ops.tpu.ragged_paged_attention"
    from jax.experimental.pallas import tpu as pltpu

    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(2, 2, _LANES), jnp.float32)
    pages = jnp.asarray(rng.randn(3, 8, 2, _LANES), jnp.float32)
    args = (q, pages, jnp.array([3, 9], jnp.int32), jnp.array([[1, 2], [2, 1]], jnp.int32))
    callback_log = logging.getLogger("jax._src.callback")  # it logs the failure's traceback as an error
    level = callback_log.level
    callback_log.setLevel(logging.CRITICAL)
    try:
        got = _rows_call(*args, kernel="interpret", sm_scale=0.1, window=None)
        want = _rows_call(*args, kernel="reference", sm_scale=0.1, window=None)
        err = float(jnp.max(jnp.abs(got - want)))
    except Exception as e:  # noqa: BLE001 - any failure is the answer
        pltpu.reset_tpu_interpret_mode_state()  # a failed interpretation leaves its simulated memory behind
        msg = str(e).strip().splitlines()
        return f"jax {jax.__version__}: {type(e).__name__}: {msg[-1] if msg else ''}"
    finally:
        callback_log.setLevel(level)
    return None if err < 1e-4 else f"jax {jax.__version__}: interpreted kernel differs by {err:g}"


def configure(
    backend: str = "auto",
    mesh: Mesh | None = None,
    cfg=None,
    kv_dtype=jnp.float32,
) -> AttentionSetup:
    """Decide the attention path for the engine being built (``cfg``: its ModelConfig) and remember it.

    Raises ValueError when kv heads do not split over tp, or when ``pallas`` is asked for on TPU with
    shapes the kernel does not take.
    """
    global _SETUP
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    tp = mesh.shape.get("tp", 1) if mesh is not None else 1
    shape_error = None
    if cfg is not None:
        heads_error = kv_heads_error(cfg.num_heads, cfg.num_kv_heads, tp)
        if heads_error:
            raise ValueError(heads_error)
        shape_error = kernel_shape_error(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_dtype, tp)
    on_tpu = jax.default_backend() == "tpu"
    if backend == "jax":
        setup = AttentionSetup(backend, mesh, False, "reference", "attention=jax")
    elif on_tpu and kernel_available():
        if shape_error:
            if backend == "pallas":
                raise ValueError(f"attention=pallas: the TPU kernel cannot run this model: {shape_error}")
            setup = AttentionSetup(backend, mesh, False, "reference", f"pure JAX: {shape_error}")
        else:
            setup = AttentionSetup(backend, mesh, True, "mosaic", "the TPU kernel")
    elif backend == "auto":
        setup = AttentionSetup(backend, mesh, False, "reference", f"pure JAX on {jax.default_backend()}")
    else:  # pallas off TPU: the kernel interpreted, else its reference, at the same call and shardings
        why = shape_error or interpret_failure()
        if why is None:
            setup = AttentionSetup(backend, mesh, True, "interpret", "the TPU kernel, interpreted")
        else:
            setup = AttentionSetup(backend, mesh, True, "reference", f"kernel reference ({why})")
            log.warning("attention=pallas on %s runs the kernel's reference: %s", jax.default_backend(), why)
    _SETUP = setup
    log.info("paged attention: %s (%s)", "ragged kernel path" if setup.pallas else "pure JAX", setup.reason)
    return setup


def reset() -> None:
    """Back to the unconfigured default (auto, no mesh)."""
    global _SETUP
    _SETUP = None


# ------------------------------------------------------------------------------------------ the kernels


def reference_ragged_attention(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float, sliding_window=None
):
    """Pure JAX with the kernel's signature and rule: sequence i's queries q[cu_q_lens[i]:cu_q_lens[i+1]]
    are the last q_len of its kv_lens[i] keys. Rows past cu_q_lens[num_seqs] come out zero. Jittable
    (unlike jax's own reference, which loops over num_seqs in Python)."""
    t, h, d = q.shape
    s, w = page_indices.shape
    ps, kvh = kv_pages.shape[1], kv_pages.shape[2] // 2
    g = h // kvh
    tok = jnp.arange(t)
    seq = jnp.searchsorted(cu_q_lens[1:], tok, side="right")  # the sequence each row belongs to
    live = tok < cu_q_lens[num_seqs[0]]
    seq = jnp.minimum(seq, s - 1)
    q_pos = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + (tok - cu_q_lens[seq])
    qg = q.reshape(t, kvh, g, d).astype(jnp.float32) * sm_scale
    k_pos = jnp.arange(w * ps)

    def one(i, out):
        kv = kv_pages[page_indices[i]].reshape(w * ps, 2 * kvh, d).astype(jnp.float32)
        scores = jnp.einsum("tkgd,nkd->tkgn", qg, kv[:, 0::2])
        ok = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            ok &= q_pos[:, None] - k_pos[None, :] < sliding_window
        probs = jax.nn.softmax(jnp.where(ok[:, None, None], scores, _NEG), axis=-1)
        o = jnp.einsum("tkgn,nkd->tkgd", probs, kv[:, 1::2])
        mine = (seq == i) & live & (i < num_seqs[0])
        return jnp.where(mine[:, None, None, None], o, out)

    out = jax.lax.fori_loop(0, s, one, jnp.zeros((t, kvh, g, d), jnp.float32))
    return out.reshape(t, h, d).astype(q.dtype)


def _kernel(kernel: str):
    if kernel == "reference":
        return reference_ragged_attention
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    if kernel == "mosaic":
        return ragged_paged_attention
    if kernel != "interpret":
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    from jax.experimental.pallas import tpu as pltpu

    def interpreted(q, kv_pages, kv_lens, page_indices, *meta, **kw):
        # the block sizes are given: the tuned table is looked up by TPU generation, and there is none here
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            return ragged_paged_attention(
                q,
                kv_pages,
                kv_lens,
                page_indices,
                *meta,
                num_kv_pages_per_block=min(2, page_indices.shape[1]),
                num_queries_per_block=min(8, q.shape[0]),
                **kw,
            )

    return interpreted


def _local_call(q, pages, kv_lens, table, cu_q_lens, num_seqs, *, kernel: str, sm_scale: float, window):
    """One shard's kernel call, with the kernel's own signature. Rows past cu_q_lens[num_seqs] come out
    zero: they are never read, but the kernel leaves them uninitialized, and a NaN there would reach
    the scratch page through the next layer's K/V."""
    out = _kernel(kernel)(
        q,
        pages,
        kv_lens.astype(jnp.int32),
        table.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        sm_scale=sm_scale,
        sliding_window=window,
    )
    live = jnp.arange(q.shape[0]) < cu_q_lens[num_seqs[0]]
    return jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))


def _rows_call(q, pages, kv_lens, table, **kw):
    """Rows of R / S queries each (decode: one), every row a sequence: cu_q_lens built for this shard."""
    s = table.shape[0]
    cu = jnp.arange(s + 1, dtype=jnp.int32) * (q.shape[0] // s)
    return _local_call(q, pages, kv_lens, table, cu, jnp.array([s], jnp.int32), **kw)


def _resolve(mesh: Mesh | None, kernel: str | None, h: int, kvh: int) -> tuple[Mesh | None, str]:
    setup = current()
    mesh = setup.mesh if mesh is None else mesh
    if mesh is not None:
        tp = mesh.shape.get("tp", 1)
        if kvh % tp or h % tp:
            raise ValueError(kv_heads_error(h, kvh, tp))
    return mesh, kernel or setup.kernel


_PAGES = P(None, None, "tp", None)  # KV_PAGES_SPEC on the combined layout: whole kv heads per tp shard


def ragged_attention(
    q,
    pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    window: int | None = None,
    mesh: Mesh | None = None,
    kernel: str | None = None,
) -> jax.Array:
    """The kernel's call (q [T, H, D], the combined ``pages``, kv_lens [S], page_indices [S, W],
    cu_q_lens [S + 1], num_seqs [1]: prefill chunks and decode rows mixed) in `shard_map` over tp.

    Tokens of several sequences share one flat batch, so nothing is split over dp here. ``mesh`` and
    ``kernel`` default to the configured ones.
    """
    t, h, d = q.shape
    mesh, kernel = _resolve(mesh, kernel, h, pages.shape[2] // 2)
    call = functools.partial(_local_call, kernel=kernel, sm_scale=1.0 / float(d) ** 0.5, window=window)
    cap = page_indices.shape[1] * pages.shape[1]
    kv_lens = jnp.clip(kv_lens, 1, cap)  # sequences past num_seqs: one scratch key, never read
    args = (q, pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if mesh is None:
        return call(*args)
    qs = P(None, "tp", None)
    specs = (qs, _PAGES, P(), P(), P(), P())
    return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=qs, check_vma=False)(*args)


def paged_attention(
    q,
    pages,
    kv_lens,
    table,
    *,
    window: int | None = None,
    q_lens=None,
    mesh: Mesh | None = None,
    kernel: str | None = None,
) -> jax.Array:
    """Attention of q [S, T, H, D] over the combined-layout ``pages`` through the ragged kernel.

    Row i's queries are the last T of its kv_lens[i] keys (decode: T = 1); or, with ``q_lens`` (one
    sequence, S = 1: a right-padded prefill chunk), its first q_lens[0] queries are the last q_lens[0]
    keys and the rest is padding (zeros out). On a mesh the call runs in `shard_map`: heads over tp,
    decode rows over dp when they divide. ``mesh`` and ``kernel`` default to the configured ones.
    """
    s, t, h, d = q.shape
    flat = q.reshape(s * t, h, d)
    if q_lens is not None:
        if s != 1:
            raise ValueError(f"q_lens is for one sequence's chunk, got {s} rows")
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.reshape(q_lens, (1,)).astype(jnp.int32)])
        out = ragged_attention(
            flat, pages, kv_lens, table, cu, jnp.ones(1, jnp.int32), window=window, mesh=mesh, kernel=kernel
        )
        return out.reshape(s, t, h, d)
    mesh, kernel = _resolve(mesh, kernel, h, pages.shape[2] // 2)
    call = functools.partial(_rows_call, kernel=kernel, sm_scale=1.0 / float(d) ** 0.5, window=window)
    kv_lens = jnp.clip(kv_lens, 1, table.shape[1] * pages.shape[1])  # idle slots: one scratch key
    if mesh is None:
        return call(flat, pages, kv_lens, table).reshape(s, t, h, d)
    dp = mesh.shape.get("dp", 1)
    rows = "dp" if dp > 1 and s % dp == 0 else None  # each dp group attends for its own rows
    qs = P(rows, "tp", None)
    specs = (qs, _PAGES, P(rows), P(rows, None))
    out = jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=qs, check_vma=False)(
        flat, pages, kv_lens, table
    )
    return out.reshape(s, t, h, d)
