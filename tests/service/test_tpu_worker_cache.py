"""The TPU benchmark's raw paged loop (benchmarks/tpu_raw.py) sizes its cache by the layout the cache
picks: on the kernel path a head_dim-64 model's pages are padded to 128 lanes and cost twice the model's
bytes. Sized by the model's bytes, its page table named pages past the cache, and the TPU kernel, which
does not bound-check its page DMAs, halted the chip's core (2026-12-06, 1b64 odriver-pallas)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from vsurge.models import pallas_sharded as ps

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tpu_raw  # noqa: E402


@pytest.fixture(autouse=True)
def _unconfigured():
    yield
    ps.reset()


@pytest.mark.parametrize(
    ("attention", "head_dim", "stored"), [("pallas", 64, 128), ("jax", 64, 64), ("pallas", 128, 128)]
)
def test_raw_cache_holds_every_page_its_table_names(attention, head_dim, stored):
    cfg = SimpleNamespace(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=head_dim)
    ps.configure(attention, None, cfg, jnp.bfloat16)
    storage, table = tpu_raw.raw_paged_cache(cfg, batch=4, max_length=300, page=128, dtype=jnp.bfloat16)
    assert storage.head_dim == stored
    assert table.shape == (4, 3) and int(table.min()) == 1  # page 0 is the scratch page
    assert int(table.max()) <= storage.num_pages
    # no more than the table needs (the raw loop's HBM figure assumes these pages, not a larger cache)
    assert storage.num_pages == table.size
