"""JAX's persistent cache with VSURGE_CACHE_HMAC_KEY set (vsurge/models/compiled/compilation_cache.py): entries are written
signed; a second process with the key reads them (no compile); one with another key, or an entry stripped
of its signature (JAX's own format, which JAX would load), is refused with a warning and compiled over.
Each run is its own process: JAX's cache object is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from vsurge.models.compiled import cache_signing

RUN = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import jax, jax.numpy as jnp
    from jax._src import monitoring
    from vsurge.models.compiled.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    events = []
    monitoring.register_event_listener(lambda name, **kw: events.append(name))
    def kept_program(x):
        return jnp.sin(x) * 3.0 + 1.0

    out = jax.jit(kept_program)(jnp.ones(8) * 0.5)
    print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                      "misses": events.count("/jax/compilation_cache/cache_misses"),
                      "sum": float(out.sum())}))
    """
)


def _run(cache: Path, key: str | None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != cache_signing.ENV}
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), VSURGE_CACHE_DIR=str(cache.parent / "home"))
    env.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)
    if key is not None:
        env[cache_signing.ENV] = key
    p = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _entries(cache: Path) -> list[Path]:
    """The cache's entries, the test's program first (the others: the helpers making its input)."""
    entries = [p for p in cache.glob("*-cache") if p.is_file()]
    return sorted(entries, key=lambda p: not p.name.startswith("jit_kept_program-"))


def test_jax_cache_entries_are_signed_and_checked(tmp_path):
    cache, key = tmp_path / "jax", "the model's Secret: 48 bytes of it, not random!"
    first, _ = _run(cache, key)
    entries = _entries(cache)
    assert first["misses"] >= 1 and first["hits"] == 0
    entry = entries[0]
    assert entry.name.startswith("jit_kept_program-"), entries
    assert all(e.read_bytes().startswith(cache_signing.MAGIC) for e in entries)
    signed = entry.read_bytes()
    assert signed.startswith(cache_signing.MAGIC)
    jax_bytes = cache_signing.verified(key.encode(), f"jax/{entry.name.removesuffix('-cache')}", signed)
    assert jax_bytes is not None

    again, _ = _run(cache, key)  # read back: no compile
    assert again["hits"] >= 1 and again["misses"] == 0 and again["sum"] == first["sum"]

    foreign, log = _run(cache, "another model's key, as long, also not random!!")
    assert foreign["hits"] == 0 and "JAX cache entry" in log and "refused" in log, log
    assert foreign["sum"] == first["sum"]

    entry.write_bytes(jax_bytes)  # JAX's own format, unsigned: what a planted entry would be
    stripped, log = _run(cache, key)
    assert stripped["misses"] >= 1 and "refused" in log and entry.name.removesuffix("-cache") in log, log
    assert entry.read_bytes().startswith(cache_signing.MAGIC)  # compiled over, signed again
    assert _run(cache, key)[0]["misses"] == 0


def test_without_the_key_the_cache_is_jax_own(tmp_path):
    cache = tmp_path / "jax"
    first, _ = _run(cache, None)
    entries = _entries(cache)
    assert entries and not any(e.read_bytes().startswith(cache_signing.MAGIC) for e in entries)
    assert _run(cache, None)[0]["misses"] == 0 and first["misses"] >= 1
