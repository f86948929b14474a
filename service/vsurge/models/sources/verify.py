"""Check a downloaded file against the store's size and checksum, and a checkpoint's structure."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

from ..errors import CheckpointError
from .errors import ModelSourceError
from .store import RemoteFile, Store

_BLOCK = 1 << 22


def _digest(path: str, h, start: int = 0, length: int | None = None):
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while True:
            n = _BLOCK if left is None else min(_BLOCK, left)
            if n == 0:
                break
            b = f.read(n)
            if not b:
                break
            h.update(b)
            if left is not None:
                left -= len(b)
    return h


def _s3_multipart_etag(path: str, size: int, part_size: int) -> str:
    digests = []
    for start in range(0, size, part_size):
        digests.append(_digest(path, hashlib.md5(), start, min(part_size, size - start)).digest())
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def verify_file(source: str, path: str, f: RemoteFile, store: Store) -> str:
    """Raise ModelSourceError(kind="corrupt") on a mismatch; return what was checked ("md5", "size", ...)."""
    size = os.path.getsize(path)
    if size != f.size:
        raise ModelSourceError(
            source, f"{f.name}: truncated transfer: got {size} bytes, the store says {f.size}", "corrupt"
        )
    c = f.checksums
    if "sha256" in c:
        got, want, how = _digest(path, hashlib.sha256()).hexdigest(), c["sha256"].lower(), "sha256"
    elif "md5" in c:
        got, want, how = _digest(path, hashlib.md5()).hexdigest(), c["md5"].lower(), "md5"
    elif "crc32c" in c:
        try:
            import google_crc32c
        except ImportError:
            return "size"
        h = google_crc32c.Checksum()
        with open(path, "rb") as fh:
            while b := fh.read(_BLOCK):
                h.update(b)
        got, want, how = base64.b64encode(h.digest()).decode(), c["crc32c"], "crc32c"
    elif "s3etag" in c:
        part = store.part_size_for_etag(f)
        if not part:
            return "size"
        got, want, how = _s3_multipart_etag(path, size, part), c["s3etag"], "multipart ETag"
    elif "gitsha1" in c:
        h = hashlib.sha1(f"blob {size}\0".encode())
        got, want, how = _digest(path, h).hexdigest(), c["gitsha1"], "git sha1"
    else:
        return "size"
    if got != want and how == "md5" and not getattr(store, "md5_is_etag", lambda f: True)(f):
        return "size"  # an SSE-KMS object: its ETag is no MD5
    if got != want:
        raise ModelSourceError(
            source, f"{f.name}: {how} {got} does not match the store's {want} (corrupt transfer)", "corrupt"
        )
    return how


def check_structure(source: str, directory: Path, names: list[str]) -> None:
    """Parse what the loader will parse, so that a broken checkpoint never enters the cache as complete."""
    from ..safetensors_io import SafetensorsFile

    for name in names:
        path = directory / name
        try:
            if name.endswith(".json"):
                with open(path) as fh:
                    json.load(fh)
            elif name.endswith(".safetensors"):
                SafetensorsFile(path)
            elif name.endswith(".gguf"):
                with open(path, "rb") as fh:
                    if fh.read(4) != b"GGUF":
                        raise CheckpointError(f"{path}: not a GGUF file (bad magic)")
        except (CheckpointError, ValueError) as e:
            path.unlink(missing_ok=True)  # fetched again next time
            msg = str(e).replace(str(path), name)
            raise ModelSourceError(source, f"{name}: {msg.removeprefix(name + ': ')}", "invalid") from None
