"""The Responses API's conversation state: stored responses, in memory, bounded in count and in age.

`store: true` (OpenAI's default) keeps a response and the conversation it ends (its input items and its
output items), so `previous_response_id` can continue it and `GET /v1/responses/{id}` can read it back. The
state lives in this server process only: a restart forgets it, and behind the router a continuation must
reach the same pod (docs/api.md says so). The oldest entry goes first when the store is full, so a busy
server's memory stays bounded (in count and in bytes); an entry older than the TTL is gone when read.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Defaults: enough for a few hundred concurrent agent loops; an hour covers an interactive session; a
# byte bound too, since one conversation may hold a request body's worth (8 MiB) of text.
DEFAULT_MAX_ENTRIES = 1024
DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass
class StoredResponse:
    """A response object and the conversation a continuation of it starts from."""

    response: dict[str, Any]
    # the input items of the whole conversation, then this response's output items (as input items)
    items: list[dict[str, Any]] = field(default_factory=list)
    # while the response runs: stops it (POST /v1/responses/{id}/cancel); None once it has finished
    cancel: Callable[[], None] | None = None
    expires_at: float = 0.0
    size: int = 0  # bytes of its JSON, counted against the store's byte bound


def _size(entry: StoredResponse) -> int:
    return len(json.dumps(entry.items, ensure_ascii=False)) + len(
        json.dumps(entry.response, ensure_ascii=False)
    )


class ResponseStore:
    """Thread-safe LRU of StoredResponse: at most `max_entries` and `max_bytes` (of JSON) in all, each kept
    `ttl_s` seconds."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if max_entries < 1 or ttl_s <= 0 or max_bytes < 1:
            raise ValueError(
                f"max_entries and max_bytes must be >= 1 and ttl_s > 0, got {max_entries}, {max_bytes}, {ttl_s}"
            )
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        size = _size(entry)  # outside the lock: a long conversation takes a while to measure
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self.bytes -= old.size
            entry.expires_at = self._clock() + self.ttl_s
            entry.size = size
            self._entries[response_id] = entry
            self.bytes += size
            # the oldest go first; the newest stays even alone over the byte bound (it was just answered)
            while len(self._entries) > 1 and (
                len(self._entries) > self.max_entries or self.bytes > self.max_bytes
            ):
                _, gone = self._entries.popitem(last=False)
                self.bytes -= gone.size

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            if entry.expires_at <= self._clock():
                del self._entries[response_id]
                self.bytes -= entry.size
                return None
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            gone = self._entries.pop(response_id, None)
            if gone is not None:
                self.bytes -= gone.size
            return gone is not None
