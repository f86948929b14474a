"""The model cache: ``$VSURGE_CACHE_DIR/models/<source slug>/<revision>/``.

A revision directory only appears by renaming a complete, verified staging directory (``<revision>.partial``)
into place, so its presence means the model is whole. The staging directory survives a crash and the next
attempt resumes it; an exclusive ``flock`` on ``<revision>.lock`` keeps two processes from filling it at once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..default_model import cache_dir
from .errors import ModelSourceError
from .progress import mb, say
from .store import RemoteFile
from .uri import SourceURI

MANIFEST = ".vsurge-complete.json"
LATEST = "latest"


def models_root() -> Path:
    return cache_dir() / "models"


def entry_dir(uri: SourceURI) -> Path:
    """One directory per source (without the revision): a readable slug plus a hash of the exact source."""
    ident = f"{uri.scheme}://{uri.bucket}/{uri.prefix}"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{uri.scheme}_{uri.bucket}_{uri.prefix}").strip("_")[:80]
    return models_root() / f"{slug}-{hashlib.sha256(ident.encode()).hexdigest()[:10]}"


def complete(final: Path) -> bool:
    """The revision directory holds every file of its manifest at the recorded size."""
    try:
        manifest = json.loads((final / MANIFEST).read_text())
        return all((final / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def commit(source: str, staging: Path, final: Path, files: Iterable[RemoteFile], revision: str) -> None:
    """Write the manifest and rename the staging directory into place (atomic on one filesystem)."""
    manifest = {"source": source, "revision": revision, "files": {f.name: f.size for f in files}}
    tmp = staging / (MANIFEST + ".tmp")
    with open(tmp, "w") as out:
        json.dump(manifest, out, indent=1, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, staging / MANIFEST)
    if final.exists():  # damaged (a file removed or resized by hand): replace it
        shutil.rmtree(final)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    latest_tmp = final.parent / f".{LATEST}.tmp"
    latest_tmp.write_text(revision)
    os.replace(latest_tmp, final.parent / LATEST)


def latest(base: Path) -> Path | None:
    """The last revision committed for this source, if it is still complete (used when the store is unreachable)."""
    try:
        rev = (base / LATEST).read_text().strip()
    except OSError:
        return None
    final = base / rev
    return final if rev and complete(final) else None


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_dirs(source: str, path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelSourceError(
            source, f"cannot create the cache directory {path}: {e.strerror or e}", "disk"
        ) from e


def check_space(source: str, directory: Path, need: int) -> None:
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return
    if need > free:
        raise ModelSourceError(
            source,
            f"disk full: the download needs {mb(need)} more in {directory} and {mb(free)} are free "
            "(give the cache volume more space: spec.cache.sizeLimit or a larger PVC)",
            "disk_full",
        )


def disk_full(source: str, path: Path | str, e: OSError) -> ModelSourceError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ModelSourceError(source, f"disk full while writing {path}: {e.strerror}", "disk_full")
    return ModelSourceError(source, f"cannot write {path}: {e.strerror or e}", "disk")


@contextlib.contextmanager
def locked(source: str, path: Path) -> Iterator[None]:
    """An exclusive lock between processes filling the same revision; says so while it waits."""
    import fcntl

    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"{source}: another process is downloading it (lock {path}); waiting")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
