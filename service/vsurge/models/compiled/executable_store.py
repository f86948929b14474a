"""Executables kept on disk whole: a second start reads each program's executable instead of tracing and
lowering it to find its entry in JAX's compilation cache, and reads them while the weights load.

JAX's persistent cache is keyed by the lowered program, so a warm start still traces and lowers every
program (a v5e, the 1B shape: 12.9 s of a 18.3 s start, mostly Python under one GIL) to learn the key of an
executable it then reads. This store keys an executable by what decides the program instead: the engine
(its source code, model and engine configs, weights' shapes, dtypes and shardings, devices, library
versions, JAX's settings, the XLA flags in the environment) and the program's name and bound arguments.
Any change to those is another key, so a stale executable is never found; at worst a start compiles.

Reading back is itself seconds on a TPU (the 1B shape's 48 executables: 35 s of work, 5.6 s on 13
threads, the three decode blocks ~5 s each), and needs no weights: `load_model` calls `prefetch` once it
knows the model's config, which starts reading, on background threads, the executables the last engine
on that model kept (``index.json``: model -> engine key and the files its start used); the engine's compile then takes what was read
for its own key and reads the rest itself. A prefetch for another engine key is simply dropped.

Where: ``<JAX's compilation cache dir>/vsurge-executables/<engine key>/<program key>.pkl`` (`vsurge serve`
sets that dir to ``$VSURGE_CACHE_DIR/jax``). On by default where JAX's cache is on and the backend is not
the CPU (XLA:CPU has crashed reading executables back, cache_reads.py: there, reads take turns);
``VSURGE_EXECUTABLE_STORE=1`` turns it on for the CPU too, ``0`` off. Single-process engines only: a
multi-host group's executable spans processes that must agree on it, which JAX's own cache handles.
A file that cannot be read (truncated, another JAX) is compiled over, never fatal.

Every file is signed (cache_signing.py: an HMAC-SHA256 with ``VSURGE_CACHE_HMAC_KEY`` or a per-host
key kept outside the cache dir) and its tag is checked on the raw bytes before anything is unpickled: the
directory may be a volume other pods write to, and a pickle runs code when it loads. A tampered, foreign
(another key) or unsigned file is refused with a warning, compiled over and rewritten.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import threading
import time
from pathlib import Path
from typing import Any

import jax

from . import cache_signing

__all__ = ["ExecutableStore", "store_for", "describe", "prefetch", "model_key", "release_prefetched"]

log = logging.getLogger(__name__)

ENV = "VSURGE_EXECUTABLE_STORE"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_ENV_PREFIXES = ("XLA_", "LIBTPU", "TPU_", "JAX_", "NEURON", "CUDA_VISIBLE")
_prefetched: dict[Path, concurrent.futures.Future] = {}  # file -> its executable, being read
_prefetch_lock = threading.Lock()


def enabled(backend: str) -> bool:
    """Whether engines on ``backend`` keep executables (`VSURGE_EXECUTABLE_STORE`: auto, 1 or 0)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    if value != "auto":
        raise ValueError(f"{ENV}={value!r}: expected auto, 1 or 0")
    return backend != "cpu"


def root() -> Path | None:
    """The store's directory, or None where it is off (no JAX cache dir, the backend, many processes)."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory or not enabled(jax.default_backend()) or jax.process_count() > 1:
        return None
    return Path(directory) / "vsurge-executables"


def describe(value: Any) -> str:
    """A stable text of a program's function and bound arguments: names for functions, a kind for the
    model's graph (its content is the model config's), the repr of anything else, no memory addresses."""
    if isinstance(value, functools.partial):
        args = [describe(a) for a in value.args]
        kw = [f"{k}={describe(v)}" for k, v in sorted(value.keywords.items())]
        return f"partial({describe(value.func)}, {', '.join(args + kw)})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if type(value).__name__ == "GraphDef":
        return "GraphDef"
    return _ADDRESS.sub("", repr(value))


@functools.cache
def _source_digest() -> str:
    """Every Python file of the vsurge package: a program's code is any of them."""
    package = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _versions() -> str:
    import importlib.metadata as md

    out = []
    for dist in ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "libtpu", "jax-cuda12-plugin"):
        try:
            out.append(f"{dist}={md.version(dist)}")
        except md.PackageNotFoundError:
            pass
    return ",".join(out)


def _signature(tree: Any) -> str:
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        parts.append(f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{sharding}")
    return _ADDRESS.sub("", "|".join(parts))


def engine_key(engine: Any) -> str:
    """What decides every program of ``engine`` besides its name and bound arguments."""
    devices = engine.mesh.devices.flat if engine.mesh is not None else jax.devices()[:1]
    client = jax.devices()[0].client
    config = {k: repr(v) for k, v in sorted(jax.config.values.items()) if "cache" not in k}
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and "CACHE" not in k)
    parts = [
        _source_digest(),
        _versions(),
        f"{client.platform} {client.platform_version}",
        repr([(d.id, d.device_kind, d.process_index) for d in devices]),
        _ADDRESS.sub("", repr(engine.mesh)),
        type(engine).__name__,
        repr(engine.model_config),
        repr(getattr(engine, "engine_config", None)),
        repr(engine.model.dtype),
        _signature(engine.params),
        _ADDRESS.sub("", repr(config)),
        repr(env),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def model_key(config: Any, dtype: Any, quantization: str) -> str:
    """The model an engine runs, as `load_model` knows it before any weight is read: ``index.json``'s key."""
    text = f"{config!r}\n{jax.numpy.dtype(dtype).name}\n{quantization}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _quantization_of(params: Any) -> str:
    leaves = jax.tree.leaves(params)
    return "int8" if any(getattr(x, "dtype", None) == jax.numpy.int8 for x in leaves) else "none"


def _deserialize(data: bytes) -> Any:
    from jax.experimental.serialize_executable import deserialize_and_load

    from .cache_reads import one_read_at_a_time

    payload, in_tree, out_tree, device_ids = pickle.loads(data)
    by_id = {d.id: d for d in jax.devices()}
    devices = [by_id[i] for i in device_ids]  # the executable's own, in order (not every device)
    # XLA:CPU: one deserialization at a time in the process, JAX's cache reads included (cache_reads.py)
    turns = one_read_at_a_time() if jax.default_backend() == "cpu" else contextlib.nullcontext()
    with turns:
        return deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)


def _signed_name(path: Path) -> str:
    """What a file's tag covers besides its bytes: ``<engine key>/<program key>.pkl``, so that a signed
    file copied over another program's (or engine's) file is refused."""
    return f"{path.parent.name}/{path.name}"


def _key(path: Path) -> bytes:
    # the store is <JAX's cache dir>/vsurge-executables/<engine key>/: the key must live outside the
    # JAX cache dir, which is what a shared claim is mounted on
    return cache_signing.cache_key(shared_dir=path.parent.parent.parent)


def _read(path: Path) -> Any:
    """The executable in ``path`` loaded on the devices, None if it cannot be (said, never raised).
    Its signature is checked first: an unverified file is never unpickled."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    payload = cache_signing.verified(_key(path), _signed_name(path), data)
    if payload is None:
        log.warning(
            "%s: kept executable refused: its signature does not match this store's key (tampered, "
            "truncated, written with another %s or unsigned); not loaded, compiling it",
            path,
            cache_signing.ENV,
        )
        return None
    try:
        return _deserialize(payload)
    except Exception as e:  # noqa: BLE001 - an unreadable file is compiled over
        log.warning("%s: kept executable unreadable (%s: %s); compiling it", path.name, type(e).__name__, e)
        return None


def prefetch(config: Any, dtype: Any, quantization: str, top: Path | None = None) -> int:
    """Start reading, on background threads, the executables the last engine on this model read or wrote
    at its start (largest first: the decode blocks take longest); returns how many. Called by `load_model`
    before the weights; ``top``: the store's directory (default `root`)."""
    top = root() if top is None else top
    if top is None:
        return 0
    try:
        entry = json.loads((top / "index.json").read_text()).get(model_key(config, dtype, quantization))
        directory = top / entry["key"]
        files = [directory / name for name in entry["files"]]
        files = sorted((p for p in files if p.exists()), key=lambda p: -p.stat().st_size)
    except (OSError, ValueError, TypeError, KeyError):
        return 0
    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=os.cpu_count() or 1, thread_name_prefix="prefetch"
    )
    with _prefetch_lock:
        _prefetched.clear()  # an earlier load's, never taken: its engine was not built
        for path in files:
            _prefetched[path] = pool.submit(_read, path)
    pool.shutdown(wait=False)
    return len(files)


def release_prefetched(keep: Path | None = None) -> None:
    """Drop what a prefetch read for any directory but ``keep``: an engine other than the one the index
    named is compiling, and those executables would hold device memory for nothing."""
    with _prefetch_lock:
        for path in [p for p in _prefetched if p.parent != keep]:
            _prefetched.pop(path).cancel()


def _take_prefetched(path: Path) -> concurrent.futures.Future | None:
    with _prefetch_lock:
        return _prefetched.pop(path, None)


class ExecutableStore:
    """One engine's directory of executables, a file per program (see the module docstring)."""

    def __init__(self, top: Path, key: str, model: str):
        self.top, self.directory, self.model = top, top / key, model
        self.read = self.prefetched = self.queued = self.written = 0
        self.used: list[str] = []  # files read or written, for the index
        # one writer thread (not a daemon: the interpreter finishes its writes before exiting)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="executable-writer")
        self._done: concurrent.futures.Future | None = None
        self._queue: list[tuple[str, Path, Any]] = []  # (job name, file, executable) until `finish`
        self.read_s = self.write_s = 0.0  # summed over threads (a prefetched read: the wait for it)

    def _path(self, name: str, program: Any) -> Path:
        text = f"{name}\n{describe(program.fun)}"
        return self.directory / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".pkl")

    def has(self, name: str, program: Any) -> bool:
        """Whether an executable of ``program`` for the job ``name`` is kept (or being prefetched)."""
        path = self._path(name, program)
        with _prefetch_lock:
            if path in _prefetched:
                return True
        return path.exists()

    def load(self, name: str, program: Any) -> Any:
        """``program``'s executable for the job ``name``, loaded on the devices; None if none is kept or
        it cannot be read back."""
        tic = time.perf_counter()
        path = self._path(name, program)
        early = _take_prefetched(path)
        compiled = early.result() if early is not None else _read(path)  # a failed read: said once
        if compiled is None:
            return None
        self.prefetched += early is not None
        self.used.append(path.name)
        self.read += 1
        self.read_s += time.perf_counter() - tic
        return compiled

    def save(self, name: str, program: Any, compiled: Any) -> None:
        """Keep ``compiled`` for the next start: written by `finish`, on the store's writer thread, once
        every program is compiled (serializing the 1B shape's 345 MB is ~10 s of work, some of it under
        the GIL the compile pool's lowering needs)."""
        path = self._path(name, program)
        self.used.append(path.name)
        self._queue.append((name, path, compiled))

    def _write(self, name: str, path: Path, compiled: Any) -> None:
        from jax.experimental.serialize_executable import serialize

        tic = time.perf_counter()
        try:
            devices = compiled._executable._unloaded_executable.device_list  # what it runs on
            data = pickle.dumps((*serialize(compiled), [d.id for d in devices]))
            data = cache_signing.sign(_key(path), _signed_name(path), data)
        except Exception as e:  # noqa: BLE001 - a program that cannot be kept is compiled each start
            log.info("%s: executable not kept (%s: %s)", name, type(e).__name__, e)
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # whole, then renamed
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("%s: executable not kept (%s)", name, e)
            return
        self.written += 1
        self.write_s += time.perf_counter() - tic

    def finish(self, index: bool = True) -> concurrent.futures.Future:
        """After every queued write, record (``index``) this engine's key and the files its start used as
        what to prefetch when its model next loads (`prefetch`); returns that future (`wait` waits)."""
        queue, self._queue = self._queue, []
        self.queued += len(queue)
        for job in queue:
            self._writer.submit(self._write, *job)
        self._done = self._writer.submit(self._remember if index else lambda: None)
        self._writer.shutdown(wait=False)
        return self._done

    def wait(self, timeout: float | None = None) -> None:
        """Until `finish`'s writes and index are on disk."""
        if self._done is not None:
            self._done.result(timeout)

    def _remember(self) -> None:
        path = self.top / "index.json"
        try:
            index = json.loads(path.read_text())
        except (OSError, ValueError):
            index = {}
        entry = dict(key=self.directory.name, files=sorted(set(self.used)))
        if index.get(self.model) == entry:
            return
        index[self.model] = entry
        try:
            self.top.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("executable store index not written (%s)", e)

    def report(self) -> dict[str, Any]:
        return dict(
            read=self.read,
            prefetched=self.prefetched,
            read_s=round(self.read_s, 2),
            queued=self.queued,
            written=self.written,
            write_s=round(self.write_s, 2),
        )


def store_for(engine: Any) -> ExecutableStore | None:
    """The store of ``engine``'s executables, or None where it is off (see `root`)."""
    top = root()
    if top is None:
        return None
    model = model_key(engine.model_config, engine.model.dtype, _quantization_of(engine.params))
    return ExecutableStore(top, engine_key(engine), model)
