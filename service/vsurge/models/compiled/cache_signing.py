"""Signed files for caches that other writers can reach: an HMAC-SHA256 checked before anything is parsed.

The executable store (executable_store.py) keeps pickles under JAX's compilation cache dir, which in
Kubernetes is a claim shared by every pod of a model: whoever can write there could plant a pickle that
runs code in the next pod that starts. So every stored file is ``MAGIC + tag + payload``, the tag an
HMAC-SHA256 over the magic, the file's name in the store and the payload; a reader checks it
(`hmac.compare_digest`) on the raw bytes and hands the payload on only if it matches. A file that fails is
never deserialized. The name is in the tag so that a valid file copied over another program's file is
refused too (it would run the wrong program).

The key:

- ``VSURGE_CACHE_HMAC_KEY`` (the operator sets it from a per-model Secret): every pod of the model shares
  it, so one pod reads what another wrote.
- otherwise a random 32-byte key kept in ``$VSURGE_CACHE_DIR/keys/cache-hmac.key`` (mode 0600, made on
  first use): outside ``$VSURGE_CACHE_DIR/jax``, the part a shared claim is mounted on, so a writer of the
  shared volume cannot read it. It is per host (per pod, where the pod's cache dir is its own volume):
  files written with another host's key are refused and compiled over. A key file inside the compilation
  cache dir, or readable by others than its owner, is not used; the process then signs with a key of its
  own that dies with it (a warning says so), which is safe but reads nothing back at the next start.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

__all__ = ["ENV", "MAGIC", "KEY_FILE", "cache_key", "sign", "verified", "key_file"]

log = logging.getLogger(__name__)

ENV = "VSURGE_CACHE_HMAC_KEY"
MAGIC = b"vsurge-signed-1\n"  # a format version too: files of another layout are refused, then rewritten
KEY_FILE = Path("keys") / "cache-hmac.key"  # under $VSURGE_CACHE_DIR
_TAG = hashlib.sha256().digest_size
_MIN_KEY = 16  # bytes of an env key below which a warning is given (the operator's are 48 random bytes)


def key_file() -> Path:
    """Where the per-host key lives when ``VSURGE_CACHE_HMAC_KEY`` is unset."""
    from vsurge.models.default_model import cache_dir

    return cache_dir() / KEY_FILE


def _inside(path: Path, directory: str | os.PathLike | None) -> bool:
    if not directory:
        return False
    return path.resolve().is_relative_to(Path(directory).expanduser().resolve())


@functools.cache
def _file_key(path: Path, shared_dir: str | None) -> bytes:
    """The key in ``path``, made there (0600, whole or not at all) if there is none. Cached per process."""
    if _inside(path, shared_dir):
        log.warning(
            "%s is inside the compilation cache dir %s, which other pods may share: not used; this process "
            "signs with a key of its own (nothing it stores is read back by a later start). Set %s or a "
            "VSURGE_CACHE_DIR outside the shared volume",
            path,
            shared_dir,
            ENV,
        )
        return secrets.token_bytes(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not path.exists():
            # written whole to a private temp file, then linked: a racing process sees a whole key or none
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process made it first: use theirs
            finally:
                tmp.unlink(missing_ok=True)
        st = path.stat()
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            log.warning(
                "%s is open to other users (mode %o) or not ours: not used; this process signs with a key "
                "of its own",
                path,
                st.st_mode & 0o777,
            )
            return secrets.token_bytes(32)
        key = path.read_bytes()
        if len(key) < _MIN_KEY:
            raise OSError(f"{len(key)} bytes, expected 32")
        return key
    except OSError as e:  # a read-only home, a full disk: the cache still works within this process
        log.warning("cache signing key %s unusable (%s); this process signs with a key of its own", path, e)
        return secrets.token_bytes(32)


def cache_key(shared_dir: str | os.PathLike | None = None) -> bytes:
    """The signing key: ``VSURGE_CACHE_HMAC_KEY``, else the per-host key file (see the module docstring).
    ``shared_dir``: the directory other writers may reach (the key file must not be inside it)."""
    env = os.environ.get(ENV, "")
    if env:
        key = env.encode()
        if len(key) < _MIN_KEY:
            log.warning("%s is %d bytes: use at least 32 random bytes", ENV, len(key))
        return key
    return _file_key(key_file(), str(shared_dir) if shared_dir else None)


def _tag(key: bytes, name: str, payload: bytes) -> bytes:
    mac = hmac.new(key, MAGIC, hashlib.sha256)
    mac.update(name.encode() + b"\0")
    mac.update(payload)
    return mac.digest()


def sign(key: bytes, name: str, payload: bytes) -> bytes:
    """The file's bytes for ``payload`` stored under ``name``."""
    return MAGIC + _tag(key, name, payload) + payload


def verified(key: bytes, name: str, data: bytes) -> bytes | None:
    """The payload of ``data`` if its tag is this key's for ``name``; None otherwise (nothing parsed)."""
    head = len(MAGIC)
    if len(data) < head + _TAG or not data.startswith(MAGIC):
        return None
    tag, payload = data[head : head + _TAG], data[head + _TAG :]
    return payload if hmac.compare_digest(tag, _tag(key, name, payload)) else None
