"""S3 and S3-compatible stores through boto3, AWS's own SDK.

boto3 reads every standard setting itself: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_REGION``, ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for
MinIO, Ceph, R2 or moto, and IRSA / EKS Pod Identity web-identity tokens on a pod's service account.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading

from .errors import ModelSourceError
from .store import Cancelled, RemoteFile, Store, Writer
from .uri import SourceURI

_MD5 = re.compile(r"^[0-9a-f]{32}$")
_MULTI = re.compile(r"^[0-9a-f]{32}-\d+$")
_PIECE = 1 << 20


def _classify(source: str, e: Exception, what: str) -> ModelSourceError:
    import botocore.exceptions as bx

    if isinstance(e, ModelSourceError):
        return e
    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return ModelSourceError(
            source,
            "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (spec.model.credentialsSecret) "
            "or give the pod an IAM role (spec.serviceAccountName with IRSA)",
            "no_credentials",
        )
    if isinstance(e, bx.EndpointConnectionError | bx.ConnectTimeoutError):
        return ModelSourceError(source, f"cannot reach the S3 endpoint: {e}", "unreachable")
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        msg = err.get("Message") or ""
        if code == "NoSuchBucket":
            return ModelSourceError(source, f"bucket does not exist (404 NoSuchBucket, {what})", "not_found")
        if code in ("NoSuchKey", "404") or status == 404:
            return ModelSourceError(source, f"no such object (404, {what})", "not_found")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
            return ModelSourceError(
                source, f"credentials rejected ({status} {code}: {msg}, {what})", "access_denied"
            )
        if code in ("AccessDenied", "403", "AllAccessDisabled") or status == 403:
            return ModelSourceError(
                source, f"access denied ({status} {code}: {msg}, {what})", "access_denied"
            )
        if code in ("PreconditionFailed", "412"):
            return ModelSourceError(
                source, f"the object changed during the download ({what}); retry", "transfer"
            )
        kind = "transfer" if (status or 0) >= 500 or code in ("SlowDown", "RequestTimeout") else "error"
        return ModelSourceError(source, f"S3 error {status} {code}: {msg} ({what})", kind)
    if isinstance(e, bx.BotoCoreError | OSError):
        return ModelSourceError(source, f"transfer failed ({what}): {type(e).__name__}: {e}", "transfer")
    return ModelSourceError(source, f"{type(e).__name__}: {e} ({what})", "error")


class S3Store(Store):
    def __init__(self, uri: SourceURI, workers: int = 8):
        import boto3
        from botocore.config import Config

        self.uri = uri
        self._config = Config(
            max_pool_connections=workers + 4,
            retries={"max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or 5), "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
        )
        self._session = boto3.session.Session()
        self._client = self._session.client("s3", config=self._config)
        self._lock = threading.Lock()
        self._sse: dict[str, bool] = {}

    def _err(self, e: Exception, what: str) -> ModelSourceError:
        return _classify(self.uri.raw, e, what)

    def list_files(self) -> tuple[list[RemoteFile], bool]:
        b, prefix = self.uri.bucket, self.uri.prefix
        try:
            if prefix.endswith(".gguf"):
                head = self._client.head_object(Bucket=b, Key=prefix)
                name = prefix.rsplit("/", 1)[-1]
                return [self._file(name, prefix, head["ContentLength"], head["ETag"])], True
            files = []
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=b, Prefix=f"{prefix}/" if prefix else ""
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(prefix) + 1 :] if prefix else obj["Key"]
                    if rel and not rel.endswith("/"):
                        files.append(self._file(rel, obj["Key"], obj["Size"], obj["ETag"]))
            return files, False
        except Exception as e:
            raise self._err(e, f"listing s3://{b}/{prefix}") from None

    @staticmethod
    def _file(name: str, key: str, size: int, etag: str) -> RemoteFile:
        etag = etag.strip('"')
        sums = {"md5": etag} if _MD5.match(etag) else {"s3etag": etag} if _MULTI.match(etag) else {}
        return RemoteFile(name=name, key=key, size=int(size), version=etag, checksums=sums)

    def revision(self, files: list[RemoteFile]) -> str:
        h = hashlib.sha256()
        for f in sorted(files, key=lambda f: f.name):
            h.update(f"{f.name}\0{f.size}\0{f.version}\n".encode())
        return h.hexdigest()[:16]

    def read_range(self, f: RemoteFile, start: int, end: int, write: Writer) -> None:
        if end <= start:
            return
        try:
            resp = self._client.get_object(
                Bucket=self.uri.bucket, Key=f.key, Range=f"bytes={start}-{end - 1}", IfMatch=f'"{f.version}"'
            )
            offset = start
            for piece in resp["Body"].iter_chunks(_PIECE):
                write(offset, piece)
                offset += len(piece)
        except (ModelSourceError, Cancelled):
            raise
        except Exception as e:
            raise self._err(e, f"reading {f.name} bytes {start}-{end - 1}") from None

    def part_size_for_etag(self, f: RemoteFile) -> int | None:
        try:
            return int(
                self._client.head_object(Bucket=self.uri.bucket, Key=f.key, PartNumber=1)["ContentLength"]
            )
        except Exception:
            return None

    def md5_is_etag(self, f: RemoteFile) -> bool:
        """False for SSE-KMS / SSE-C objects, whose ETag is not the MD5 of their bytes."""
        try:
            head = self._client.head_object(Bucket=self.uri.bucket, Key=f.key)
        except Exception:
            return True
        return not (
            str(head.get("ServerSideEncryption", "")).startswith("aws:kms")
            or head.get("SSECustomerAlgorithm")
        )
