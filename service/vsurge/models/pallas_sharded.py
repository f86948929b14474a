"""The Pallas TPU ragged paged attention kernel inside ``shard_map``, and which attention backend runs.

Mosaic kernels cannot be partitioned by XLA, so on a mesh every kernel call goes through `shard_map` with
explicit specs that match where the engine keeps its arrays (models/sharding.py, engines/paged/paging.py):

* KV pages ``[num_pages, page_size, 2 * kv_heads, head_dim]`` (the combined layout): heads over ``tp``,
  whole over ``dp``; queries ``[tokens, heads, head_dim]``: heads over ``tp``. Each ``tp`` shard holds
  whole kv heads (K and V side by side) and exactly the query heads that read them, so the kernel runs
  unchanged on its shard. kv heads fewer than tp are stored replicated, and head_dims that are not a
  multiple of 128 padded (models/kv_layout.py): queries are padded to the pages' width here, the output
  sliced back, and the softmax scale is always the model's head_dim's.
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
``VSURGE_PALLAS_KERNEL`` (mosaic, interpret, reference) forces the implementation on the kernel path: e.g.
the reference on a TPU, to compare the chip's kernel with it, or mosaic off TPU, where it cannot compile
(the engine's compile-failure fallback is tested that way). If the kernel's programs fail to lower or
compile at start, the engine calls `demote` and serves on the pure-JAX path (engines/paged/kernel_fallback.py).

The kernel's block sizes and VMEM limit are always passed (JAX's own lookup reads the local device and
raises off TPU), from models/kernel_tables.py for the target chip: the TPU being lowered for
(models/tpu_lowering.py), else the configured device's kind.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..contracts.engine_config import ATTENTION_BACKENDS
from . import kernel_tables
from .kv_layout import KVLayout, kv_heads_error, kv_layout
from .target import target_backend, target_device_kind  # noqa: F401 - target_device_kind: also ours

log = logging.getLogger(__name__)

KERNELS = ("mosaic", "interpret", "reference")
KERNEL_ENV = "VSURGE_PALLAS_KERNEL"
_NEG = -1e30
_LANES = 128  # the kernel keeps its softmax statistics in 128-lane rows (kv_layout pads head_dim to it)


@dataclasses.dataclass(frozen=True)
class AttentionSetup:
    """What `configure` decided: whether paged attention takes the kernel path, and with which kernel."""

    backend: str = "auto"
    mesh: Mesh | None = None
    pallas: bool = False
    kernel: str = "reference"
    reason: str = ""  # why this kernel (logged; tests print it)
    device_kind: str | None = None  # the TPU the kernel is built for (its block-size table)
    layout: KVLayout | None = None  # the paged cache's layout for the configured model (None: no model)


_SETUP: AttentionSetup | None = None  # None: not configured


def current() -> AttentionSetup:
    """The configured setup; unconfigured (a backend used without an engine): the kernel on TPU only."""
    if _SETUP is not None:
        return _SETUP
    kind = target_device_kind()
    if kind is not None and kernel_available():
        return AttentionSetup("auto", None, True, "mosaic", "unconfigured, on TPU", kind)
    return AttentionSetup("auto", None, False, "reference", "unconfigured")


def kernel_available() -> bool:
    """Whether this jax ships the ragged paged attention kernel."""
    try:
        from jax.experimental.pallas.ops.tpu import ragged_paged_attention  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the jax build
        return False
    return True


def kernel_shape_error(
    num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype, tp: int = 1
) -> str | None:
    """Why the TPU kernel cannot take these shapes on each tp shard (None: it can), from its own limits.

    Any head_dim is taken (the pages are padded to 128 lanes, kv_layout.py); the kv heads of a shard
    (replicated ones counted) must tile for the cache's dtype."""
    del head_dim  # padded by the layout
    replicas = tp // num_kv_heads if num_kv_heads < tp else 1
    combined = 2 * num_kv_heads * replicas // tp
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
        kw = dict(sm_scale=0.1, window=None, shape_class=kernel_tables.DECODE)
        got = _rows_call(*args, kernel="interpret", **kw)
        want = _rows_call(*args, kernel="reference", **kw)
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
    *,
    device_kind: str | None = None,
) -> AttentionSetup:
    """Decide the attention path for the engine being built (``cfg``: its ModelConfig) and remember it.

    ``device_kind``: the TPU to decide for (default: `target_device_kind`, the TPU being lowered for or
    this process's). Raises ValueError when no paged layout gives every tp shard whole kv heads, or when
    ``pallas`` is asked for on TPU with shapes the kernel does not take.
    """
    global _SETUP
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    forced = os.environ.get(KERNEL_ENV) or None
    if forced is not None and forced not in KERNELS:
        raise ValueError(f"{KERNEL_ENV} must be one of {', '.join(KERNELS)}, got {forced!r}")
    tp = mesh.shape.get("tp", 1) if mesh is not None else 1
    shape_error = None
    if cfg is not None:
        kv_layout(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp)  # raises where no layout fits
        shape_error = kernel_shape_error(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_dtype, tp)
    kind = device_kind or target_device_kind()
    on_tpu = kind is not None and kind.startswith("TPU")
    if backend == "jax":
        setup = AttentionSetup(backend, mesh, False, "reference", "attention=jax")
    elif on_tpu and kernel_available():
        if shape_error:
            if backend == "pallas":
                raise ValueError(f"attention=pallas: the TPU kernel cannot run this model: {shape_error}")
            setup = AttentionSetup(backend, mesh, False, "reference", f"pure JAX: {shape_error}")
        else:
            setup = AttentionSetup(backend, mesh, True, "mosaic", f"the TPU kernel ({kind})", kind)
    elif backend == "auto":
        setup = AttentionSetup(backend, mesh, False, "reference", f"pure JAX on {target_backend()}")
    else:  # pallas off TPU: the kernel interpreted, else its reference, at the same call and shardings
        why = shape_error or interpret_failure()
        if why is None:
            setup = AttentionSetup(backend, mesh, True, "interpret", "the TPU kernel, interpreted")
        else:
            setup = AttentionSetup(backend, mesh, True, "reference", f"kernel reference ({why})")
            log.warning("attention=pallas on %s runs the kernel's reference: %s", target_backend(), why)
    if setup.pallas and forced is not None and forced != setup.kernel:
        setup = dataclasses.replace(setup, kernel=forced, reason=f"{setup.reason}; {KERNEL_ENV}={forced}")
    if cfg is not None:
        layout = kv_layout(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp, kernel=setup.pallas)
        setup = dataclasses.replace(setup, layout=layout)
    _SETUP = setup
    log.info("paged attention: %s (%s)", "ragged kernel path" if setup.pallas else "pure JAX", setup.reason)
    return setup


def demote(reason: str) -> AttentionSetup:
    """Take the pure-JAX path instead of the kernel's (its programs failed to lower or compile), keeping
    the mesh and the kv-head replication; logged with the reason."""
    global _SETUP
    old = current()
    layout = old.layout and dataclasses.replace(old.layout, stored_head_dim=0)
    _SETUP = dataclasses.replace(
        old,
        pallas=False,
        kernel="reference",
        reason=f"pure JAX: the TPU kernel failed ({reason})",
        layout=layout,
    )
    log.warning("paged attention falls back to pure JAX: the %s kernel failed: %s", old.kernel, reason)
    return _SETUP


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
        # small blocks, so that the tiny inputs of CPU tests still walk several of them
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


def kernel_block_sizes(q, pages, table, shape_class: str, device_kind: str | None = None):
    """The block sizes and VMEM limit of one shard's kernel call (models/kernel_tables.py), for the
    target TPU (default: `target_device_kind`, else the configured one)."""
    kind = device_kind or target_device_kind() or current().device_kind
    return kernel_tables.block_sizes(
        kind,
        shape_class=shape_class,
        q_dtype=q.dtype,
        kv_dtype=pages.dtype,
        num_q_heads=q.shape[1],
        num_combined_kv_heads=pages.shape[2],
        head_dim=pages.shape[3],
        page_size=pages.shape[1],
        num_tokens=q.shape[0],
        pages_per_seq=table.shape[1],
    )


def _local_call(
    q, pages, kv_lens, table, cu_q_lens, num_seqs, *, kernel: str, sm_scale: float, window, shape_class: str
):
    """One shard's kernel call, with the kernel's own signature. Rows past cu_q_lens[num_seqs] come out
    zero: they are never read, but the kernel leaves them uninitialized, and a NaN there would reach
    the scratch page through the next layer's K/V."""
    extra = {}
    if kernel == "mosaic":  # never JAX's lookup: it reads the local device (and raises off TPU)
        extra = kernel_block_sizes(q, pages, table, shape_class).kernel_kwargs()
    out = _kernel(kernel)(
        q,
        pages,
        kv_lens.astype(jnp.int32),
        table.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        sm_scale=sm_scale,
        sliding_window=window,
        **extra,
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


def _shard_mesh(mesh: Mesh):
    """The mesh to `shard_map` over: the abstract TPU mesh a program is being lowered for, when one of
    the same axes is in context (jax requires the two to match), else the engine's."""
    ctx = jax.sharding.get_abstract_mesh()
    if (
        ctx.abstract_device is not None
        and ctx.axis_names == mesh.axis_names
        and tuple(ctx.axis_sizes) == tuple(mesh.devices.shape)
    ):
        return ctx
    return mesh


def _to_pages_width(q, pages):
    """q [..., H, d] zero-padded to the pages' head width (kv_layout.py); the softmax scale of d."""
    d, width = q.shape[-1], pages.shape[-1]
    if width < d:
        raise ValueError(f"pages {width} lanes wide cannot hold head_dim {d}")
    if width > d:
        q = jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, width - d)])
    return q, 1.0 / float(d) ** 0.5


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
    num_decode: int = 0,
) -> jax.Array:
    """The kernel's call (q [T, H, D], the combined ``pages``, kv_lens [S], page_indices [S, W],
    cu_q_lens [S + 1], num_seqs [1]: prefill chunks and decode rows mixed) in `shard_map` over tp.

    Tokens of several sequences share one flat batch, so nothing is split over dp here. ``mesh`` and
    ``kernel`` default to the configured ones; ``num_decode`` (static): how many of the T tokens are
    decode rows (a step of mostly decode rows takes the kernel's decode block sizes).
    """
    t, h, d = q.shape
    mesh, kernel = _resolve(mesh, kernel, h, pages.shape[2] // 2)
    q, scale = _to_pages_width(q, pages)
    cls = kernel_tables.DECODE if 2 * num_decode >= t else kernel_tables.PREFILL
    call = functools.partial(_local_call, kernel=kernel, sm_scale=scale, window=window, shape_class=cls)
    cap = page_indices.shape[1] * pages.shape[1]
    kv_lens = jnp.clip(kv_lens, 1, cap)  # sequences past num_seqs: one scratch key, never read
    args = (q, pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if mesh is None:
        return call(*args)[..., :d]
    qs = P(None, "tp", None)
    specs = (qs, _PAGES, P(), P(), P(), P())
    out = jax.shard_map(call, mesh=_shard_mesh(mesh), in_specs=specs, out_specs=qs, check_vma=False)(*args)
    return out[..., :d]


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
    flat, scale = _to_pages_width(flat, pages)
    cls = kernel_tables.DECODE if t == 1 else kernel_tables.PREFILL
    call = functools.partial(_rows_call, kernel=kernel, sm_scale=scale, window=window, shape_class=cls)
    kv_lens = jnp.clip(kv_lens, 1, table.shape[1] * pages.shape[1])  # idle slots: one scratch key
    if mesh is None:
        return call(flat, pages, kv_lens, table)[..., :d].reshape(s, t, h, d)
    dp = mesh.shape.get("dp", 1)
    rows = "dp" if dp > 1 and s % dp == 0 else None  # each dp group attends for its own rows
    qs = P(rows, "tp", None)
    specs = (qs, _PAGES, P(rows), P(rows, None))
    out = jax.shard_map(call, mesh=_shard_mesh(mesh), in_specs=specs, out_specs=qs, check_vma=False)(
        flat, pages, kv_lens, table
    )
    return out[..., :d].reshape(s, t, h, d)
