"""Fetch a remote source into the cache: parallel byte ranges of several files at once, resumable after a
crash, verified, renamed atomically into place; repeated only when the cache is not complete."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

from . import cache
from .errors import ModelSourceError
from .progress import Progress, mb, say
from .select import select_files
from .store import Cancelled as _Cancelled
from .store import RemoteFile, Store
from .verify import check_structure, verify_file

DEFAULT_WORKERS = 8
DEFAULT_CHUNK = 16 << 20
RETRIES = 3


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ModelSourceError(f"${name}", f"{raw!r}: expected an integer", "config") from None
    if value <= 0:
        raise ModelSourceError(f"${name}", f"{raw!r}: must be positive", "config")
    return value


class _PartialFile:
    """One file being downloaded in ranges: ``NAME.part`` plus ``NAME.part.json`` listing finished chunks.

    The first line of the state file identifies the object (version, size, chunk size); a partial file is
    only resumed for the very same object. A chunk's index is appended after its bytes are written.
    """

    def __init__(self, source: str, staging: Path, f: RemoteFile, chunk: int):
        self.source, self.f, self.chunk = source, f, chunk
        self.target = staging / f.name
        self.part = staging / (f.name + ".part")
        self.state = staging / (f.name + ".part.json")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.done: set[int] = set()
        try:
            lines = self.state.read_text().splitlines()
            head = json.loads(lines[0]) if lines else {}
            if (head.get("version"), head.get("size")) == (f.version, f.size) and self.part.exists():
                self.chunk = int(head["chunk"])  # resume with the chunk size the partial file was begun with
                self.done = {int(x) for x in lines[1:] if x.strip().isdigit()}
        except (OSError, ValueError, KeyError, TypeError):
            self.done = set()
        self.n_chunks = max(1, -(-f.size // self.chunk))
        if not self.done:
            self.part.unlink(missing_ok=True)
            header = {"version": f.version, "size": f.size, "chunk": self.chunk}
            self.state.write_text(json.dumps(header) + "\n")
        self._state_lock = threading.Lock()
        try:
            self.fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o644)
            if f.size:
                try:
                    os.posix_fallocate(self.fd, 0, f.size)  # disk full shows here, before any transfer
                except OSError as e:
                    if e.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: no fallocate on this filesystem
                        raise
                    os.ftruncate(self.fd, f.size)
        except OSError as e:
            raise cache.disk_full(source, self.part, e) from e
        self.left = self.n_chunks - len(self.done)

    @property
    def resumed_bytes(self) -> int:
        return sum(self.range(i)[1] - self.range(i)[0] for i in self.done)

    def range(self, i: int) -> tuple[int, int]:
        return i * self.chunk, min(self.f.size, (i + 1) * self.chunk)

    def pending(self) -> list[int]:
        return [i for i in range(self.n_chunks) if i not in self.done]

    def write(self, offset: int, data: bytes) -> None:
        try:
            os.pwrite(self.fd, data, offset)
        except OSError as e:
            raise cache.disk_full(self.source, self.part, e) from e

    def chunk_done(self, i: int) -> bool:
        """Record chunk i; True when it was the last one."""
        with self._state_lock:
            with open(self.state, "a") as st:
                st.write(f"{i}\n")
            self.left -= 1
            return self.left == 0

    def finish(self, store: Store) -> str:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        try:
            how = verify_file(self.source, str(self.part), self.f, store)
        except ModelSourceError:
            self.discard()
            raise
        os.replace(self.part, self.target)
        self.state.unlink(missing_ok=True)
        return how

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        self.close()
        self.part.unlink(missing_ok=True)
        self.state.unlink(missing_ok=True)


def _transient(e: BaseException) -> bool:
    return not isinstance(e, ModelSourceError) or e.kind in ("transfer", "unreachable")


def materialize(store: Store) -> str:
    """Path of the source in the local cache, downloading what is missing. Raises ModelSourceError."""
    uri = store.uri
    source = uri.raw
    base = cache.entry_dir(uri)
    try:
        files, prefix_is_file = store.list_files()
    except ModelSourceError as e:
        previous = cache.latest(base) if e.kind == "unreachable" else None
        if previous is None:
            raise
        say(f"{source}: the store is unreachable ({e.cause}); using the cached revision {previous.name}")
        return _result(previous, prefix_is_file=_single_file(previous))
    wanted = select_files(source, files, prefix_is_file)
    revision = store.revision(wanted)
    final = base / revision
    if cache.complete(final):
        say(f"{source}: cached in {final}")
        return _result(final, prefix_is_file)
    cache.make_dirs(source, base)
    with cache.locked(source, base / f"{revision}.lock"):
        if cache.complete(final):  # another process finished it while we waited
            say(f"{source}: cached in {final} (by another process)")
            return _result(final, prefix_is_file)
        staging = base / f"{revision}.partial"
        cache.make_dirs(source, staging)
        wanted = _only_indexed(store, wanted)
        _download(store, staging, wanted)
        check_structure(source, staging, [f.name for f in wanted])
        store.cleanup_staging(str(staging))
        for leftover in staging.iterdir():
            if leftover.name not in {f.name.split("/")[0] for f in wanted}:
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        cache.commit(source, staging, final, wanted, revision)
    return _result(final, prefix_is_file)


def _only_indexed(store: Store, wanted: list[RemoteFile]) -> list[RemoteFile]:
    """With model.safetensors.index.json, only the shards its weight_map names (not a stray model.safetensors)."""
    index = next((f for f in wanted if f.name == "model.safetensors.index.json"), None)
    if index is None:
        return wanted
    buf = bytearray(index.size)

    def put(offset: int, data: bytes) -> None:
        buf[offset : offset + len(data)] = data

    store.read_range(index, 0, index.size, put)
    try:
        shards = set(json.loads(bytes(buf))["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelSourceError(
            store.uri.raw, f"model.safetensors.index.json: invalid index ({e})", "invalid"
        ) from None
    present = {f.name for f in wanted}
    missing = sorted(shards - present)
    if missing:
        raise ModelSourceError(
            store.uri.raw,
            f"model.safetensors.index.json names {', '.join(missing)}, not in the store",
            "invalid",
        )
    return [f for f in wanted if not f.name.endswith(".safetensors") or f.name in shards]


def _single_file(final: Path) -> bool:
    names = [p for p in final.iterdir() if not p.name.startswith(".")]
    return len(names) == 1 and names[0].name.endswith(".gguf")


def _result(final: Path, prefix_is_file: bool) -> str:
    if prefix_is_file:
        (gguf,) = [p for p in final.iterdir() if p.name.endswith(".gguf")]
        return str(gguf)
    return str(final)


def _download(store: Store, staging: Path, wanted: list[RemoteFile]) -> None:
    source = store.uri.raw
    workers = _env_int("VSURGE_DOWNLOAD_WORKERS", DEFAULT_WORKERS)
    chunk = _env_int("VSURGE_DOWNLOAD_CHUNK_BYTES", DEFAULT_CHUNK)
    todo = [
        f for f in wanted if not ((staging / f.name).exists() and (staging / f.name).stat().st_size == f.size)
    ]
    total = sum(f.size for f in wanted)
    if not todo:
        return
    # Space still to be taken: what is neither finished nor already allocated for a partial file.
    allocated = 0
    for f in todo:
        part = staging / (f.name + ".part")
        if part.exists():
            allocated += min(part.stat().st_blocks * 512, f.size)
    cache.check_space(source, staging, sum(f.size for f in todo) - allocated)

    partials: list[_PartialFile] = []
    abort = threading.Event()
    t0 = time.perf_counter()
    starts: dict[str, float] = {}

    if store.ranged:
        partials = [_PartialFile(source, staging, f, chunk) for f in todo]
        resumed = sum(p.resumed_bytes for p in partials)
        already = total - sum(f.size for f in todo) + resumed
    else:
        resumed, already = 0, total - sum(f.size for f in todo)
    say(
        f"{source}: downloading {len(todo)} of {len(wanted)} files, {mb(total - already)} "
        f"({workers} streams{', resuming ' + mb(resumed) if resumed else ''}) into {staging}"
    )
    progress = Progress(source, store.uri.scheme, total, already)

    def run_chunk(p: _PartialFile, i: int) -> None:
        if abort.is_set():
            raise _Cancelled
        starts.setdefault(p.f.name, time.perf_counter())
        start, end = p.range(i)
        for attempt in range(RETRIES):
            got = 0

            def write(offset: int, data: bytes) -> None:
                nonlocal got
                if abort.is_set():
                    raise _Cancelled
                p.write(offset, data)
                got += len(data)
                progress.add(len(data))

            try:
                store.read_range(p.f, start, end, write)
                if got != end - start:
                    raise ModelSourceError(
                        source, f"{p.f.name}: short read: {got} of {end - start} bytes at {start}", "transfer"
                    )
                break
            except _Cancelled:
                raise
            except Exception as e:
                if not _transient(e) or attempt == RETRIES - 1:
                    raise
                progress.rollback(got)
                time.sleep(0.2 * 2**attempt)
        if p.chunk_done(i):
            how = p.finish(store)
            progress.file_done(p.f.name, p.f.size, time.perf_counter() - starts[p.f.name], f"{how} verified")

    def run_file(f: RemoteFile) -> None:
        if abort.is_set():
            raise _Cancelled
        t = time.perf_counter()
        path = store.fetch_whole(f, str(staging / ".download"))
        progress.add(f.size)
        how = verify_file(source, path, f, store)
        (staging / f.name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, staging / f.name)
        progress.file_done(f.name, f.size, time.perf_counter() - t, f"{how} verified")

    with progress, ThreadPoolExecutor(workers, thread_name_prefix="vsurge-download") as pool:
        futures: list[Future] = []
        if store.ranged:
            # Interleave files so that several files and several ranges of each are in flight at once.
            queues = [[(p, i) for i in p.pending()] for p in partials]
            while any(queues):
                for q in queues:
                    if q:
                        futures.append(pool.submit(run_chunk, *q.pop(0)))
        else:
            futures = [pool.submit(run_file, f) for f in todo]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        error = next((fu.exception() for fu in done if fu.exception() is not None), None)
        if error is not None:
            abort.set()
            for fu in futures:
                fu.cancel()
            wait(futures)
            errors = [fu.exception() for fu in futures if fu.done() and not fu.cancelled() and fu.exception()]
            real = [e for e in errors if not isinstance(e, _Cancelled)]
            error = real[0] if real else error
    for p in partials:
        p.close()
    if error is not None:
        if isinstance(error, ModelSourceError):
            raise error
        raise ModelSourceError(
            source, f"download failed: {type(error).__name__}: {error}", "transfer"
        ) from error
    dt = time.perf_counter() - t0
    say(
        f"{source}: downloaded {mb(progress.received)} in {dt:.1f}s ({progress.received / max(dt, 1e-9) / 1e6:.1f} MB/s)"
    )
