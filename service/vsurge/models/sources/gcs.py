"""Google Cloud Storage through google-cloud-storage, Google's own client.

Credentials are Application Default Credentials: Workload Identity on GKE (spec.serviceAccountName),
``GOOGLE_APPLICATION_CREDENTIALS``, or a key file ``key.json`` in ``$VSURGE_CREDENTIALS_DIR`` (where the operator
mounts spec.model.credentialsSecret). ``STORAGE_EMULATOR_HOST`` points the client at an emulator.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading

from .errors import ModelSourceError
from .store import Cancelled, RemoteFile, Store, Writer
from .uri import SourceURI

KEY_FILES = ("key.json", "google-application-credentials.json", "credentials.json")


def _classify(source: str, e: Exception, what: str) -> ModelSourceError:
    if isinstance(e, ModelSourceError):
        return e
    from google.api_core import exceptions as gx
    from google.auth import exceptions as ax

    if isinstance(e, ax.DefaultCredentialsError):
        return ModelSourceError(
            source,
            "no Google credentials: use Workload Identity (spec.serviceAccountName), set "
            "GOOGLE_APPLICATION_CREDENTIALS, or put key.json in spec.model.credentialsSecret "
            f"({str(e).splitlines()[0]})",
            "no_credentials",
        )
    if isinstance(e, ax.RefreshError | gx.Unauthorized):
        return ModelSourceError(source, f"credentials rejected ({what}): {e}", "access_denied")
    if isinstance(e, gx.Forbidden):
        return ModelSourceError(source, f"access denied (403, {what}): {e.message}", "access_denied")
    if isinstance(e, gx.NotFound):
        message = getattr(e, "message", str(e))
        return ModelSourceError(source, f"not found (404, {what}): {message}", "not_found")
    if isinstance(e, gx.PreconditionFailed):
        return ModelSourceError(source, f"the object changed during the download ({what}); retry", "transfer")
    if isinstance(e, gx.GoogleAPICallError):
        kind = "transfer" if (e.code or 0) >= 500 or e.code in (408, 429) else "error"
        return ModelSourceError(source, f"GCS error {e.code} ({what}): {e.message}", kind)
    import requests

    if isinstance(e, requests.ConnectionError):
        return ModelSourceError(source, f"cannot reach Cloud Storage ({what}): {e}", "unreachable")
    return ModelSourceError(source, f"transfer failed ({what}): {type(e).__name__}: {e}", "transfer")


class _OffsetWriter:
    def __init__(self, write: Writer, offset: int):
        self._write, self.offset = write, offset

    def write(self, data: bytes) -> int:
        self._write(self.offset, bytes(data))
        self.offset += len(data)
        return len(data)

    def flush(self) -> None:
        pass


class GCSStore(Store):
    def __init__(self, uri: SourceURI, workers: int = 8):
        self.uri = uri
        self._local = threading.local()
        self._client()  # credentials problems show before any listing

    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            from google.cloud import storage

            try:
                key = self._key_file()
                client = storage.Client.from_service_account_json(key) if key else storage.Client()
            except Exception as e:
                raise _classify(self.uri.raw, e, "creating the client") from None
            self._local.client = client
        return client

    @staticmethod
    def _key_file() -> str | None:
        if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") or os.environ.get("STORAGE_EMULATOR_HOST"):
            return None
        directory = os.environ.get("VSURGE_CREDENTIALS_DIR")
        for name in KEY_FILES if directory else ():
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                return path
        return None

    def _file(self, blob, name: str) -> RemoteFile:
        sums = {}
        if blob.md5_hash:
            sums["md5"] = base64.b64decode(blob.md5_hash).hex()
        elif blob.crc32c:
            sums["crc32c"] = blob.crc32c
        return RemoteFile(
            name=name, key=blob.name, size=int(blob.size or 0), version=str(blob.generation), checksums=sums
        )

    def list_files(self) -> tuple[list[RemoteFile], bool]:
        b, prefix = self.uri.bucket, self.uri.prefix
        client = self._client()
        try:
            bucket = client.bucket(b)
            if prefix.endswith(".gguf"):
                blob = bucket.get_blob(prefix)
                if blob is None:
                    if not bucket.exists():
                        raise ModelSourceError(self.uri.raw, f"bucket {b} does not exist (404)", "not_found")
                    raise ModelSourceError(self.uri.raw, f"no such object {prefix} (404)", "not_found")
                return [self._file(blob, prefix.rsplit("/", 1)[-1])], True
            files = []
            for blob in client.list_blobs(b, prefix=f"{prefix}/" if prefix else None):
                rel = blob.name[len(prefix) + 1 :] if prefix else blob.name
                if rel and not rel.endswith("/"):
                    files.append(self._file(blob, rel))
            return files, False
        except Exception as e:
            raise _classify(self.uri.raw, e, f"listing gs://{b}/{prefix}") from None

    def revision(self, files: list[RemoteFile]) -> str:
        h = hashlib.sha256()
        for f in sorted(files, key=lambda f: f.name):
            h.update(f"{f.name}\0{f.size}\0{f.version}\n".encode())
        return h.hexdigest()[:16]

    def read_range(self, f: RemoteFile, start: int, end: int, write: Writer) -> None:
        if end <= start:
            return
        client = self._client()
        try:
            blob = client.bucket(self.uri.bucket).blob(
                f.key, generation=int(f.version) if f.version.isdigit() else None
            )
            blob.download_to_file(
                _OffsetWriter(write, start), start=start, end=end - 1, raw_download=True, checksum=None
            )
        except (ModelSourceError, Cancelled):
            raise
        except Exception as e:
            raise _classify(self.uri.raw, e, f"reading {f.name} bytes {start}-{end - 1}") from None
