"""The executable store: a program compiled once is read back whole (no trace, no lowering, no compile),
by a key that changes with anything that decides the program; unreadable files are compiled over; a
second `vsurge` process reads its engine's programs while the weights load and decodes the same tokens."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from vsurge.engines.aot_program import AotProgram
from vsurge.engines.compile_watch import compiled_during
from vsurge.engines.engine_base import compile_jobs
from vsurge.models.compiled import cache_signing
from vsurge.models.compiled import executable_store as es


def _affine(x, w, *, scale):
    return (x @ w) * scale


def _program(scale: float = 2.0) -> AotProgram:
    return AotProgram(partial(_affine, scale=scale))


ARGS = (np.ones((4, 8), np.float32), np.ones((8, 3), np.float32))
KEY = "the test store's key, 48 bytes of it, not random"


@pytest.fixture(autouse=True)
def _signing_key(monkeypatch):
    """Every test signs with one known key (the operator's Secret in a pod); the key-file tests unset it."""
    monkeypatch.setenv(cache_signing.ENV, KEY)


class _Planted:
    """What an attacker with write access to the cache volume would leave: unpickling it writes a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code ran while unpickling"))


def _store(tmp_path: Path, key: str = "engine") -> es.ExecutableStore:
    return es.ExecutableStore(tmp_path, key, "model")


def _compile(store, program, say=lambda _: None):
    with compiled_during() as compiled:
        compile_jobs([("affine", program, ARGS)], say, store)
    return compiled


def _kept(tmp_path: Path, model: str = "model", scale: float = 2.0) -> es.ExecutableStore:
    """A store of engine key "engine" that compiled and wrote the affine program (and its index)."""
    store = es.ExecutableStore(tmp_path, "engine", model)
    assert _compile(store, _program(scale))  # compiled
    store.finish()
    store.wait()
    return store


def test_enabled_follows_the_variable(monkeypatch):
    monkeypatch.delenv(es.ENV, raising=False)
    assert es.enabled("tpu") and not es.enabled("cpu")
    monkeypatch.setenv(es.ENV, "1")
    assert es.enabled("cpu")
    monkeypatch.setenv(es.ENV, "0")
    assert not es.enabled("tpu")
    monkeypatch.setenv(es.ENV, "sometimes")
    with pytest.raises(ValueError, match="VSURGE_EXECUTABLE_STORE"):
        es.enabled("tpu")


def test_describe_names_functions_and_bound_values_without_addresses():
    text = es.describe(partial(_affine, scale=2.0))
    assert text == f"partial({__name__}._affine, scale=2.0)"
    assert es.describe(partial(_affine, scale=3.0)) != text
    assert " at 0x" not in es.describe(partial(_affine, object(), scale=2.0))


def test_a_kept_program_is_read_back_not_compiled(tmp_path):
    first = _kept(tmp_path)
    assert first.report()["written"] == 1
    index = json.loads((tmp_path / "index.json").read_text())
    assert index == {"model": {"key": "engine", "files": first.used}}

    again, program = _store(tmp_path), _program()
    assert _compile(again, program) == []  # nothing traced to XLA: read whole
    assert again.report()["read"] == 1 and program.executables == 1
    np.testing.assert_allclose(np.asarray(program(*ARGS)), np.full((4, 3), 16.0))


def test_another_bound_value_or_engine_key_is_another_program(tmp_path):
    _kept(tmp_path, scale=2.0)
    other = _store(tmp_path)
    assert _compile(other, _program(3.0))  # scale=3 is not scale=2's executable
    assert other.report()["read"] == 0
    elsewhere = _store(tmp_path, key="another engine")
    assert _compile(elsewhere, _program(2.0))
    assert elsewhere.report()["read"] == 0


def test_an_unreadable_file_is_compiled_over(tmp_path, caplog):
    _kept(tmp_path)
    (kept,) = (tmp_path / "engine").glob("*.pkl")
    good = kept.read_bytes()
    kept.write_bytes(good[:100])  # truncated: its signature no longer matches
    again, program = _store(tmp_path), _program()
    with caplog.at_level(logging.WARNING, logger="vsurge.models.compiled.executable_store"):
        assert _compile(again, program)
    assert "refused" in caplog.text
    np.testing.assert_allclose(np.asarray(program(*ARGS)), np.full((4, 3), 16.0))
    # signed with the right key but not an executable (another JAX's layout, say): unreadable, compiled
    name = f"engine/{kept.name}"
    kept.write_bytes(cache_signing.sign(KEY.encode(), name, pickle.dumps(("not", "an", "executable"))))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vsurge.models.compiled.executable_store"):
        assert _compile(_store(tmp_path), _program())
    assert "unreadable" in caplog.text


def _refused_and_compiled(tmp_path, caplog) -> es.ExecutableStore:
    store, program = _store(tmp_path), _program()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vsurge.models.compiled.executable_store"):
        assert _compile(store, program)  # compiled: the file was not used
    assert "refused" in caplog.text and "signature does not match" in caplog.text, caplog.text
    assert store.report()["read"] == 0
    np.testing.assert_allclose(np.asarray(program(*ARGS)), np.full((4, 3), 16.0))
    return store


def test_a_planted_pickle_is_refused_and_never_unpickled(tmp_path, caplog):
    """A file that would write a marker when unpickled, put in the store unsigned, signed with another key,
    or signed with the right key for another program's file: refused, compiled over, the marker never
    written; the rewritten file is read back."""
    store_dir, marker = tmp_path / "store", tmp_path / "marker"
    _kept(store_dir)
    (kept,) = (store_dir / "engine").glob("*.pkl")
    planted = pickle.dumps(_Planted(marker))
    name = f"engine/{kept.name}"
    for data in (
        planted,  # unsigned (the store's own format before signing, too)
        cache_signing.sign(b"another model's key, also 48 bytes long, random", name, planted),
        cache_signing.sign(KEY.encode(), "engine/another-program.pkl", planted),  # copied from elsewhere
    ):
        kept.write_bytes(data)
        store = _refused_and_compiled(store_dir, caplog)
        assert not marker.exists(), "the planted pickle ran"
        store.finish()
        store.wait()
        assert kept.read_bytes() != data  # compiled over and rewritten, signed
        again = _store(store_dir)
        assert _compile(again, _program()) == [] and again.report()["read"] == 1
    # the control: the planted bytes do run code when unpickled, so the refusals above are what kept it out
    pickle.loads(planted)
    assert marker.read_text() == "code ran while unpickling"


def test_a_file_signed_with_another_key_is_refused(tmp_path, caplog, monkeypatch):
    _kept(tmp_path)  # signed with KEY
    monkeypatch.setenv(cache_signing.ENV, "a foreign key: another model's Secret, 48 bytes")
    _refused_and_compiled(tmp_path, caplog)
    monkeypatch.setenv(cache_signing.ENV, KEY)
    again = _store(tmp_path)
    assert _compile(again, _program()) == [] and again.report()["read"] == 1


def test_without_the_variable_a_private_key_file_outside_the_cache_dir(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(cache_signing.ENV)
    monkeypatch.setenv("VSURGE_CACHE_DIR", str(tmp_path / "pod-cache"))
    cache_signing._file_key.cache_clear()
    shared = tmp_path / "pod-cache" / "jax"  # where a shared claim is mounted
    key = cache_signing.cache_key(shared_dir=shared)
    path = cache_signing.key_file()
    assert path == tmp_path / "pod-cache" / "keys" / "cache-hmac.key"
    assert path.read_bytes() == key and len(key) == 32
    assert path.stat().st_mode & 0o777 == 0o600
    cache_signing._file_key.cache_clear()
    assert cache_signing.cache_key(shared_dir=shared) == key  # the next start reads it back
    # a key file others can read is not used; nor one inside the shared dir
    path.chmod(0o644)
    cache_signing._file_key.cache_clear()
    with caplog.at_level(logging.WARNING, logger="vsurge.models.compiled.cache_signing"):
        assert cache_signing.cache_key(shared_dir=shared) != key
    assert "open to other users" in caplog.text
    cache_signing._file_key.cache_clear()
    monkeypatch.setenv("VSURGE_CACHE_DIR", str(shared))
    with caplog.at_level(logging.WARNING, logger="vsurge.models.compiled.cache_signing"):
        first = cache_signing.cache_key(shared_dir=shared)
    assert "inside the compilation cache dir" in caplog.text
    assert not (shared / "keys").exists() and len(first) == 32
    cache_signing._file_key.cache_clear()


def test_prefetch_reads_what_the_index_names_before_the_engine_asks(tmp_path):
    cfg, dtype = "a model config", jnp.float32
    first = _kept(tmp_path, es.model_key(cfg, dtype, "none"))
    assert es.prefetch(cfg, dtype, "int8", top=tmp_path) == 0  # another model: nothing
    assert es.prefetch(cfg, dtype, "none", top=tmp_path) == 1
    again, program = es.ExecutableStore(tmp_path, "engine", first.model), _program()
    assert again.has("affine", program)
    assert _compile(again, program) == []
    assert again.report()["prefetched"] == again.report()["read"] == 1


START = textwrap.dedent(
    """
    import json, sys
    import vsurge
    from vsurge.models.compiled.compilation_cache import enable_compilation_cache
    from vsurge.engines.aot_program import missed
    from vsurge.seed_api.request import vSurgeRequest

    def greedy(prompt):
        request = vSurgeRequest(prompt=prompt, max_tokens=6, temperature=0.0, ignore_eos=True,
                                is_client_side_tokenization=True)
        return [t for items in surge.submit(request).channel for x in items for t in x.token_ids]

    enable_compilation_cache()
    model, tok = vsurge.load_model(sys.argv[1])
    surge = vsurge.vSurge.create(
        model, tok, vsurge.EngineConfig(max_concurrent_decodes=1, max_length=48, prefill_lengths=[32])
    )
    surge.compile()
    engine = surge.driver.engines[0]
    surge.start()
    try:
        tokens = [greedy([5, 6, 7, 8]), greedy(list(range(3, 30)))]
    finally:
        surge.stop()
    engine.executable_store.wait()
    report = engine.compile_report
    print(json.dumps(dict(tokens=tokens, executables=engine.executable_store.report(),
                          pool=report["pool"], missed=missed())))
    """
)


@pytest.mark.slow
def test_a_second_process_reads_its_programs_and_decodes_the_same(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    env = dict(os.environ, VSURGE_CACHE_DIR=str(tmp_path), VSURGE_EXECUTABLE_STORE="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", START, path], env=env, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["tokens"] == warm["tokens"] and all(len(t) == 6 for t in cold["tokens"])
    assert cold["missed"] == warm["missed"] == {}
    kept = cold["executables"]["written"]
    assert kept >= 10 and cold["executables"]["read"] == 0
    # the second start read every kept program, each prefetched while the weights loaded; it compiled
    # only what XLA:CPU cannot serialize (its sort comparator: the prompt-logprobs programs)
    assert warm["executables"]["read"] == warm["executables"]["prefetched"] == kept
    unkept = cold["executables"]["queued"] - kept
    assert warm["executables"]["queued"] == unkept
    assert all("logprobs" in name for name in warm["pool"]), warm["pool"]
    # JAX's own cache holds no second copy of a kept program (on CPU the inserts and first-token
    # samplers compile on their first run, outside the pool: dense/warmup.compile_engine)
    jax_entries = [p.name for p in (tmp_path / "jax").iterdir()]
    assert any(n.startswith("jit__insert_impl-") for n in jax_entries)
    for kept_program in ("_decode_impl", "_prefill_layer_impl", "_prefill_embed_impl", "_chunk_layer_impl"):
        assert not any(n.startswith(f"jit_{kept_program}-") for n in jax_entries), kept_program


def test_a_prefetch_for_another_engine_is_dropped_when_an_engine_compiles(tmp_path):
    cfg, dtype = "another model config", jnp.float32
    first = _kept(tmp_path, es.model_key(cfg, dtype, "none"))
    assert es.prefetch(cfg, dtype, "none", top=tmp_path) == 1
    other, program = es.ExecutableStore(tmp_path, "another engine", first.model), _program()
    assert es._prefetched  # read for "engine"
    assert _compile(other, program)  # its own key: compiled, and the prefetch let go
    assert not es._prefetched
