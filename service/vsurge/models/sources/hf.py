"""The Hugging Face Hub through huggingface_hub, the Hub's own client (transformers already depends on it).

``HfApi.model_info`` resolves the revision to a commit and lists every file with its size and checksum (sha256
of LFS files, git blob sha1 of the others); the bytes come from the library's ``resolve`` URLs through its own
shared HTTP session, in byte ranges, so that a file is fetched by several streams at once and a killed
download resumes (``hf_hub_download`` writes each attempt to a fresh temp file). ``HF_TOKEN`` and
``HF_ENDPOINT`` are read at call time.
"""

from __future__ import annotations

import os

from .errors import ModelSourceError
from .store import Cancelled, RemoteFile, Store, Writer
from .uri import SourceURI

_PIECE = 1 << 20


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def _classify(source: str, e: Exception, what: str) -> ModelSourceError:
    if isinstance(e, ModelSourceError):
        return e
    from huggingface_hub import errors as he

    name = type(e).__name__
    if isinstance(e, he.GatedRepoError):
        return ModelSourceError(
            source, f"gated repository: accept its terms and set HF_TOKEN ({what})", "access_denied"
        )
    if isinstance(e, he.RepositoryNotFoundError):
        hint = "" if _token() else "; if it is private, set HF_TOKEN"
        return ModelSourceError(source, f"repository not found (404, {what}){hint}", "not_found")
    if isinstance(e, he.RevisionNotFoundError):
        return ModelSourceError(source, f"revision not found (404, {what})", "not_found")
    if isinstance(e, getattr(he, "RemoteEntryNotFoundError", he.EntryNotFoundError)):
        return ModelSourceError(source, f"file not found (404, {what})", "not_found")
    if isinstance(e, he.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            return ModelSourceError(
                source, f"access denied ({status}, {what}): check HF_TOKEN", "access_denied"
            )
        kind = "transfer" if (status or 0) >= 500 or status == 429 else "error"
        return ModelSourceError(source, f"Hub error {status} ({what}): {str(e).splitlines()[0]}", kind)
    if "Connect" in name or "Timeout" in name or isinstance(e, OSError | he.OfflineModeIsEnabled):
        return ModelSourceError(source, f"cannot reach {_endpoint()} ({what}): {e}", "unreachable")
    if "Protocol" in name or "Read" in name or "Stream" in name:
        return ModelSourceError(source, f"transfer failed ({what}): {name}: {e}", "transfer")
    return ModelSourceError(source, f"{name}: {e} ({what})", "error")


class HFStore(Store):
    def __init__(self, uri: SourceURI, workers: int = 8):
        from huggingface_hub import HfApi

        self.uri = uri
        self._api = HfApi(endpoint=_endpoint(), token=_token())
        self._commit: str | None = None

    def list_files(self) -> tuple[list[RemoteFile], bool]:
        repo, prefix = self.uri.bucket, self.uri.prefix
        try:
            info = self._api.model_info(repo, revision=self.uri.revision, files_metadata=True)
        except Exception as e:
            raise _classify(self.uri.raw, e, f"model_info {repo}@{self.uri.revision or 'main'}") from None
        self._commit = info.sha
        files = []
        for s in info.siblings or []:
            path = s.rfilename
            if prefix.endswith(".gguf"):
                if path != prefix:
                    continue
                rel = path.rsplit("/", 1)[-1]
            elif prefix:
                if not path.startswith(prefix + "/"):
                    continue
                rel = path[len(prefix) + 1 :]
            else:
                rel = path
            if s.lfs is not None:
                sums, version, size = {"sha256": s.lfs.sha256}, s.lfs.sha256, s.lfs.size
            else:
                sums = {"gitsha1": s.blob_id} if s.blob_id else {}
                version, size = s.blob_id or "", s.size
            if size is None:
                raise ModelSourceError(self.uri.raw, f"the Hub gave no size for {path}", "error")
            files.append(RemoteFile(name=rel, key=path, size=int(size), version=version, checksums=sums))
        if prefix.endswith(".gguf") and not files:
            raise ModelSourceError(self.uri.raw, f"file not found in {repo}: {prefix}", "not_found")
        return files, prefix.endswith(".gguf")

    def revision(self, files: list[RemoteFile]) -> str:
        assert self._commit is not None
        return self._commit

    def read_range(self, f: RemoteFile, start: int, end: int, write: Writer) -> None:
        if end <= start:
            return
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.uri.bucket, f.key, revision=self._commit, endpoint=_endpoint())
        headers = build_hf_headers(token=_token())
        headers["Range"] = f"bytes={start}-{end - 1}"
        headers["Accept-Encoding"] = "identity"
        what = f"reading {f.name} bytes {start}-{end - 1}"
        try:
            with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=60) as r:
                hf_raise_for_status(r)
                if r.status_code != 206 and not (r.status_code == 200 and start == 0 and end == f.size):
                    raise ModelSourceError(
                        self.uri.raw, f"the Hub ignored a byte range ({r.status_code}, {what})", "transfer"
                    )
                offset = start
                for piece in r.iter_bytes(_PIECE):
                    write(offset, piece)
                    offset += len(piece)
        except (ModelSourceError, Cancelled):
            raise
        except Exception as e:
            raise _classify(self.uri.raw, e, what) from None
