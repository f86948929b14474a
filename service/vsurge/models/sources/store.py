"""What a store (S3, GCS, the Hub) gives the cache: a listing with sizes and checksums, and byte ranges."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .uri import SourceURI

# write(offset, data): store bytes of a ranged read at this offset of the target file.
Writer = Callable[[int, bytes], None]


class Cancelled(Exception):
    """Raised by a writer when another transfer failed: the adapters let it through untouched."""


@dataclass(frozen=True)
class RemoteFile:
    name: str  # path relative to the source's prefix; also the name in the cache directory
    key: str  # the store's object key / repo path
    size: int
    version: str  # ETag / generation / blob id: a partial download is resumed only for the same version
    checksums: dict[str, str] = field(
        default_factory=dict
    )  # md5, sha256, crc32c, s3etag, gitsha1 (hex / b64)


class Store:
    """Base class of the store adapters."""

    uri: SourceURI
    #: True when the store's client can read byte ranges (then files are fetched in parallel ranges).
    ranged = True

    def list_files(self) -> tuple[list[RemoteFile], bool]:
        """Objects under the source: (files with names relative to the prefix, whether the prefix is one object)."""
        raise NotImplementedError

    def revision(self, files: list[RemoteFile]) -> str:
        """A name for this version of the source in the cache."""
        raise NotImplementedError

    def read_range(self, f: RemoteFile, start: int, end: int, write: Writer) -> None:
        """Stream bytes [start, end) of ``f`` into ``write``; raise on a short read."""
        raise NotImplementedError

    def fetch_whole(self, f: RemoteFile, dest_dir: str) -> str:
        """For stores that are not ranged: download ``f`` into ``dest_dir`` (resumably); return the path."""
        raise NotImplementedError

    def part_size_for_etag(self, f: RemoteFile) -> int | None:
        """S3 only: the part size of a multipart upload, to recompute its ETag."""
        return None

    def cleanup_staging(self, staging: str) -> None:
        """Remove what the client library left in the staging directory before it is committed."""
