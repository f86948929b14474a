"""Model sources: ``hf://org/name[@revision][/path]``, ``gs://bucket/prefix``, ``s3://bucket/prefix``,
``pvc://claim/path`` and local paths.

``resolve(source)`` returns a local path: a remote source is fetched into ``$VSURGE_CACHE_DIR/models`` first
(parallel byte ranges, resumable, verified, atomically committed, under a lock; see ``fetch``). One module per
store (``s3``, ``gcs``, ``hf``), each on the store's own client library.
"""

from __future__ import annotations

import os
import time

from .errors import ModelSourceError
from .progress import download_bytes, load_phases, record_phase
from .uri import REMOTE_SCHEMES, SourceURI, is_remote, parse, pvc_path

__all__ = [
    "REMOTE_SCHEMES",
    "ModelSourceError",
    "SourceURI",
    "download_bytes",
    "is_remote",
    "load_phases",
    "make_store",
    "parse",
    "record_phase",
    "resolve",
]

_MODULES = {
    "s3": ("s3", "S3Store", "boto3"),
    "gs": ("gcs", "GCSStore", "google-cloud-storage"),
    "hf": ("hf", "HFStore", "huggingface_hub"),
}


def make_store(uri: SourceURI):
    import importlib

    module, cls, package = _MODULES[uri.scheme]
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
        return getattr(mod, cls)(uri)
    except ModuleNotFoundError as e:
        raise ModelSourceError(uri.raw, f"{package} is not installed ({e.name} missing)", "config") from None


def resolve(source: str | os.PathLike) -> str:
    """A local path for ``source``; remote sources are downloaded into the cache (or found there)."""
    source = os.fspath(source)
    if source.startswith("pvc://"):
        return pvc_path(source)
    if not is_remote(source):
        return source
    from .fetch import materialize

    t0 = time.perf_counter()
    path = materialize(make_store(parse(source)))
    record_phase(source, "download", time.perf_counter() - t0)
    return path
