"""KV pages on the device (PagedAttentionCache) and their bookkeeping on the host (HBMPageManager).

PagedAttentionCache sizes and allocates the pages, per layer ``(K, V)`` of
``[num_pages + 1, page_size, kv_heads, head_dim]`` (on TPU one combined array; see
models/paged_attention.py), sharded over kv heads. Physical page 0 is scratch, so the manager hands out
pages 1..num_pages.

HBMPageManager is plain Python: a free list, one page table per sequence, a reference count per page and
a prefix cache. Full pages are keyed by a chained hash of their tokens (``hash(parent, tokens of page)``),
so a key names the whole prefix up to that page. A page is in exactly one of three places:

* the free list (no owner, no key);
* owned: ``refs[p]`` sequences list it in their tables (more than one only for a cached, shared page);
* cached and unowned: it keeps its key and waits in an LRU; it is taken back on a prefix hit, or evicted
  (key dropped, page reused) only when the free list is empty.

Free pages in the figures below count both the free list and the unowned cached pages: both can be handed
out at once, so "free == total" means nothing is owned and nothing leaked.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ...models.kv_layout import KVLayout, kv_heads_error, kv_layout
from ...models.paged_attention import use_pallas
from ...models.sharding import kv_cache_sharding

log = logging.getLogger(__name__)

# Where JAX reports no device memory (CPU), the cache gets this many bytes unless told otherwise: enough
# for a few thousand tokens of a small model, never a guess that could exhaust host memory.
DEFAULT_HOST_KV_BYTES = 512 * 1024 * 1024
_ROOT = b"vsurge-prefix-v1"


def page_hashes(tokens: Sequence[int] | np.ndarray, page_size: int, seed: bytes = b"") -> list[bytes]:
    """Chained keys of the full pages of ``tokens``: key i names tokens[: (i + 1) * page_size] exactly;
    ``seed`` (a LoRA adapter's identity) starts another chain, so its pages never match the base's.

    blake2b (128 bits) so a collision, which would silently serve another prompt's KV, is not a concern.
    """
    arr = np.asarray(tokens, dtype=np.int32)
    out, parent = [], _ROOT if not seed else hashlib.blake2b(_ROOT + seed, digest_size=16).digest()
    for i in range(len(arr) // page_size):
        parent = hashlib.blake2b(
            parent + arr[i * page_size : (i + 1) * page_size].tobytes(), digest_size=16
        ).digest()
        out.append(parent)
    return out


def bytes_per_page(cfg, page_size: int, dtype, kv: KVLayout | None = None) -> int:
    """Device bytes of one page over all layers (K and V), over every shard: as the layout ``kv`` stores
    them (replicated kv heads and padded lanes cost what they occupy), else the model's own."""
    if kv is None:
        kv = KVLayout(cfg.num_kv_heads, cfg.head_dim)
    return cfg.num_layers * page_size * kv.bytes_per_token(dtype)


def cache_layout(cfg, tp: int, kernel: bool) -> KVLayout:
    """The paged layout for ``cfg`` on ``tp`` shards (``kernel``: read by the TPU kernel, so padded). A
    model whose kv heads no layout can split (refused by the engine at configure) gets the model's
    layout here, and the cache stays whole on every device (`PagedAttentionCache.sharding`)."""
    heads = getattr(cfg, "num_heads", None)
    if heads is not None and kv_heads_error(heads, cfg.num_kv_heads, tp) is None:
        return kv_layout(heads, cfg.num_kv_heads, cfg.head_dim, tp, kernel=kernel)
    return dataclasses.replace(kv_layout(1, 1, cfg.head_dim, 1, kernel=kernel), kv_heads=cfg.num_kv_heads)


def kv_budget_bytes(
    devices: Sequence[jax.Device], hbm_utilization: float, kv_cache_bytes: int | None
) -> tuple[int, str]:
    """Bytes for KV pages per device and where the figure came from.

    An explicit ``kv_cache_bytes`` wins. Otherwise ``hbm_utilization`` of the free memory JAX reports
    (``bytes_limit - bytes_in_use``: the weights are already there) on the tightest device; where JAX
    reports none (CPU), the small fixed default.
    """
    if kv_cache_bytes is not None:
        if kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {kv_cache_bytes}")
        return int(kv_cache_bytes), "kv_cache_bytes"
    if not 0.0 < hbm_utilization <= 1.0:
        raise ValueError(f"hbm_utilization must be in (0, 1], got {hbm_utilization}")
    free = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if not stats or "bytes_limit" not in stats:
            return DEFAULT_HOST_KV_BYTES, "default (device reports no memory)"
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return int(hbm_utilization * max(0, min(free))), f"hbm_utilization={hbm_utilization}"


@dataclass
class PagedAttentionCache:
    """The KV pages of every layer; ``num_pages`` usable pages plus the scratch page 0."""

    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int  # as stored: the model's, or replicated for tp (kv_layout.py)
    head_dim: int  # as stored: the model's, or padded to 128 lanes for the TPU kernel
    dtype: object = jnp.float32
    mesh: jax.sharding.Mesh | None = None
    device: jax.Device | None = None
    layout: str = "split"  # "split": (K, V) per layer; "combined": K/V interleaved (the TPU kernel's layout)
    kv: KVLayout | None = None  # the model's heads -> the stored ones (None: stored as the model has them)

    @classmethod
    def create(
        cls,
        cfg,
        page_size: int = 128,
        hbm_utilization: float = 0.6,
        kv_cache_bytes: int | None = None,
        dtype=jnp.float32,
        mesh: jax.sharding.Mesh | None = None,
        device: jax.Device | None = None,
        layout: str | None = None,
    ) -> PagedAttentionCache:
        """Size the cache from the memory budget (see `kv_budget_bytes`)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        devices = list(mesh.devices.flat) if mesh is not None else [device or jax.devices()[0]]
        budget, source = kv_budget_bytes(devices, hbm_utilization, kv_cache_bytes)
        layout = layout or ("combined" if use_pallas() else "split")
        if layout not in ("split", "combined"):
            raise ValueError(f"layout must be 'split' or 'combined', got {layout!r}")
        tp = mesh.shape.get("tp", 1) if mesh is not None else 1
        kv = cache_layout(cfg, tp, kernel=layout == "combined" and use_pallas())
        per_page = bytes_per_page(cfg, page_size, dtype, kv)  # what the pages occupy, padding included
        # a page's heads are split over the tp axis when they divide: each device holds 1/shards of it
        shards = tp if kv_cache_bytes is None and kv.stored_kv_heads % tp == 0 else 1
        num_pages = int(budget * shards // per_page) - 1  # one page of the budget is the scratch page
        if num_pages < 1:
            raise ValueError(
                f"a KV budget of {budget} bytes ({source}) holds no page of {per_page} bytes; "
                "raise kv_cache_bytes / hbm_utilization or lower page_size"
            )
        log.info(
            "KV cache: %d pages of %d tokens (%d bytes each, %s); %s",
            num_pages,
            page_size,
            per_page,
            source,
            kv.describe(dtype, cfg.num_layers),
        )
        return cls(
            num_pages,
            page_size,
            cfg.num_layers,
            kv.stored_kv_heads,
            kv.padded_head_dim,
            dtype,
            mesh,
            device,
            layout,
            kv,
        )

    def for_jax_path(self) -> PagedAttentionCache:
        """The same number of pages in the pure-JAX layout (split, the model's head_dim; replicated kv
        heads kept): what the engine falls back to when the kernel cannot compile. Never larger."""
        kv = dataclasses.replace(self.kv or KVLayout(self.num_kv_heads, self.head_dim), stored_head_dim=0)
        return dataclasses.replace(self, head_dim=kv.head_dim, layout="split", kv=kv)

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page array (K or V; K and V together in the combined layout)."""
        heads = self.num_kv_heads * (2 if self.layout == "combined" else 1)
        return (self.num_pages + 1, self.page_size, heads, self.head_dim)

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """Of one page array: split over kv heads on the mesh's tp axis when they divide."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(self.device or jax.devices()[0])
        if self.num_kv_heads % self.mesh.shape.get("tp", 1):
            # a head does not split; in the combined layout splitting anyway would part a head's K from its V
            from jax.sharding import NamedSharding, PartitionSpec

            return NamedSharding(self.mesh, PartitionSpec())
        return kv_cache_sharding(self.mesh, self.page_shape, paged=True)

    def layer_shardings(self) -> tuple:
        """The sharding tree of the per-layer caches `allocate` returns."""
        one = self.sharding if self.layout == "combined" else (self.sharding, self.sharding)
        return tuple(one for _ in range(self.num_layers))

    @property
    def nbytes(self) -> int:
        arrays = self.num_layers * (1 if self.layout == "combined" else 2)
        return arrays * int(np.prod(self.page_shape)) * jnp.dtype(self.dtype).itemsize

    def allocate(self) -> tuple:
        """Zeroed pages, per layer (K, V) or one combined array, created where they live (no host copy)."""
        zeros = jax.jit(lambda: jnp.zeros(self.page_shape, self.dtype), out_shardings=self.sharding)
        if self.layout == "combined":
            return tuple(zeros() for _ in range(self.num_layers))
        return tuple((zeros(), zeros()) for _ in range(self.num_layers))


class HBMPageManager:
    """Free list, page tables, reference counts and the prefix cache (see the module docstring)."""

    def __init__(self, num_pages: int, page_size: int, first_page: int = 1, prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.first_page = first_page
        self.prefix_caching = prefix_caching  # off: no page is ever published or reused (benchmarks)
        # a stack: recently freed pages are reused first (their memory is warm)
        self._free: list[int] = list(range(first_page + num_pages - 1, first_page - 1, -1))
        self._refs = np.zeros(first_page + num_pages, np.int32)
        self._tables: dict[Hashable, list[int]] = {}
        self._cache: dict[bytes, int] = {}  # key -> page
        self._key: dict[int, bytes] = {}  # page -> key
        self._lru: collections.OrderedDict[int, None] = (
            collections.OrderedDict()
        )  # cached, unowned; oldest first
        self.hits = 0  # sequences that reused at least one cached page
        self.hit_pages = 0
        self.evictions = 0

    @classmethod
    def for_cache(cls, storage: PagedAttentionCache, prefix_caching: bool = True) -> HBMPageManager:
        return cls(storage.num_pages, storage.page_size, prefix_caching=prefix_caching)

    # ------------------------------------------------------------------ figures
    @property
    def num_free(self) -> int:
        """Pages that can be handed out now: the free list plus unowned cached pages."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages that carry a prefix key (owned or not)."""
        return len(self._key)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def table(self, seq_id: Hashable) -> list[int]:
        return self._tables[seq_id]

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached prefix among ``keys`` (nothing is taken)."""
        pages = []
        for k in keys:
            p = self._cache.get(k)
            if p is None:
                break
            pages.append(p)
        return pages

    def register(self, seq_id: Hashable, keys: Sequence[bytes], start: int = 0) -> None:
        """Publish the sequence's pages start..len(keys)-1 (now written, full) under their prefix keys.

        A key already cached on another page (two sequences prefilled the same prefix at once) keeps its
        page; this sequence's copy stays private and returns to the free list when it ends.
        """
        if not self.prefix_caching:
            return
        table = self._tables[seq_id]
        for i in range(start, min(len(keys), len(table))):
            k, p = keys[i], table[i]
            if k in self._cache or p in self._key:
                continue
            self._cache[k] = p
            self._key[p] = k

    # ------------------------------------------------------------------ pages of a sequence
    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        page, _ = self._lru.popitem(last=False)  # least recently used cached page
        del self._cache[self._key.pop(page)]
        self.evictions += 1
        return page

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free

    def allocate(self, seq_id: Hashable, num_tokens: int, keys: Sequence[bytes] = ()) -> int | None:
        """Give a new sequence the pages for ``num_tokens``, reusing the cached prefix named by ``keys``.

        Returns how many leading tokens are already in the cache (a multiple of page_size), or None if the
        pages do not fit (nothing changes then). Pass only the keys that may be reused: at least one token
        must be left to compute the first output from.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has pages")
        hit = self.lookup(keys)
        need = self.pages_for(num_tokens) - len(hit)
        if need < 0:
            raise ValueError("cached prefix longer than the sequence")
        waiting_hits = sum(1 for p in hit if p in self._lru)  # taking these shrinks what can be evicted
        if need > self.num_free - waiting_hits:
            return None
        for p in hit:
            if self._refs[p] == 0:
                del self._lru[p]
            self._refs[p] += 1
        table = list(hit)
        for _ in range(need):
            p = self._take()
            self._refs[p] += 1
            table.append(p)
        self._tables[seq_id] = table
        if hit:
            self.hits += 1
            self.hit_pages += len(hit)
        return len(hit) * self.page_size

    def grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Make the sequence's table cover ``num_tokens``; False (and no change) if pages ran out."""
        table = self._tables[seq_id]
        need = self.pages_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            p = self._take()
            self._refs[p] += 1
            table.append(p)
        return True

    def free(self, seq_id: Hashable) -> None:
        """Return a finished, cancelled or preempted sequence's pages.

        Cached pages stay cached; the tail goes in first so a prefix's head is evicted last.
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        for p in reversed(table):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._key:
                    self._lru[p] = None
                else:
                    self._free.append(p)

    def drop_cache(self) -> None:
        """Forget every prefix key (the page contents are gone, e.g. after a failed device step)."""
        for p in list(self._lru):
            self._free.append(p)
        self._lru.clear()
        self._cache.clear()
        self._key.clear()

    def reset(self) -> None:
        """Free every sequence and forget the prefix cache."""
        for seq_id in list(self._tables):
            self.free(seq_id)
        self.drop_cache()

    # ------------------------------------------------------------------ invariants (tests)
    def check(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent (see the module docstring)."""
        pages = range(self.first_page, self.first_page + self.num_pages)
        refs = collections.Counter(p for t in self._tables.values() for p in t)
        for seq_id, t in self._tables.items():
            assert len(set(t)) == len(t), f"sequence {seq_id!r} lists a page twice"
        free = collections.Counter(self._free)
        assert all(n == 1 for n in free.values()), "a page is in the free list twice"
        for p in pages:
            assert self._refs[p] == refs.get(p, 0), (
                f"page {p}: refcount {self._refs[p]} != {refs.get(p, 0)} tables"
            )
            places = (p in free) + (p in self._lru) + (self._refs[p] > 0)
            assert places == 1, f"page {p} is in {places} places (free / cached LRU / owned)"
            if p in free:
                assert p not in self._key, f"free page {p} still has a prefix key"
            if p in self._lru:
                assert p in self._key, f"page {p} waits in the LRU without a key"
            if self._refs[p] > 1:
                assert p in self._key, (
                    f"page {p} is owned {self._refs[p]} times but is not a shared cached page"
                )
        assert all(self._cache[k] == p for p, k in self._key.items()), "prefix cache maps disagree"
        assert len(self._cache) == len(self._key)
        assert self.num_free + sum(1 for p in pages if self._refs[p] > 0) == self.num_pages
