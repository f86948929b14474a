"""Token usage read from a relayed answer, for the tenants' tokens-per-minute limits and metrics.

A non-streamed answer is one JSON object with `usage`; a stream carries it in its last event (the one with
empty `choices`) when the request asked for `stream_options.include_usage`. When a tenant has a token
limit and its stream did not ask, the router asks on its behalf and takes that last event out of the relay
again (`strip_usage_frame`), so the client gets the events it asked for; the other events then carry
`"usage": null`, which OpenAI's own streams also carry and clients ignore.

Events are relayed as they arrive; only when a usage frame must be taken out are they relayed whole
(`\\n\\n`-terminated), which is how the server writes them anyway.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_JSON_BYTES = 8 * 1024 * 1024  # a non-streamed answer larger than this is not scanned
MAX_EVENT_BYTES = 1024 * 1024  # nor a stream event larger than this
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage_of(obj: Any) -> Usage | None:
    """The `usage` of one decoded answer or event, when it has a real one."""
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    for inner in (
        "response",
        "message",
    ):  # a Responses event's response, an Anthropic message_start's message
        if not isinstance(u, dict) and isinstance(obj.get(inner), dict):
            u = obj[inner].get("usage")
    if not isinstance(u, dict):
        return None
    # OpenAI's chat / completions / embeddings names, or the Responses and Anthropic Messages ones
    p = u.get("prompt_tokens", u.get("input_tokens"))
    c = u.get("completion_tokens", u.get("output_tokens"))
    if isinstance(p, int) and isinstance(u.get("cache_read_input_tokens"), int):
        p += u["cache_read_input_tokens"]  # Anthropic counts cached prompt tokens apart
    if not isinstance(p, int) or isinstance(p, bool):
        return None
    return Usage(max(0, p), c if isinstance(c, int) and not isinstance(c, bool) and c > 0 else 0)


def _event_json(event: bytes) -> Any:
    data = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    if not data:
        return None
    try:
        return json.loads(b"\n".join(data))
    except ValueError:
        return None


def is_usage_frame(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("choices") == [] and usage_of(obj) is not None


class UsageScanner:
    """Watches the bytes of one answer go by; `usage` holds what it found (None: nothing)."""

    def __init__(self, *, stream: bool, strip_usage_frame: bool = False) -> None:
        self.stream = stream
        self.strip = stream and strip_usage_frame
        self.usage: Usage | None = None
        self._buf = bytearray()
        self._overflow = False

    def feed(self, chunk: bytes) -> bytes:
        """Take one chunk of the answer; return the bytes to relay."""
        if not self.stream:
            if not self._overflow:
                self._buf += chunk
                if len(self._buf) > MAX_JSON_BYTES:
                    self._overflow = True
                    self._buf.clear()
            return chunk
        self._buf += chunk
        out = bytearray()
        while True:
            m = _EVENT_END.search(self._buf)
            if m is None:
                break
            event = bytes(self._buf[: m.end()])
            del self._buf[: m.end()]
            if self._scan_event(event) and self.strip:
                continue
            out += event
        if len(self._buf) > MAX_EVENT_BYTES:  # not an SSE stream after all: relay, stop scanning
            out += self._buf
            self._buf.clear()
        return chunk if not self.strip else bytes(out)

    def finish(self) -> bytes:
        """The end of the answer: parse a JSON body; return what is left to relay."""
        if not self.stream:
            if not self._overflow and b'"usage"' in self._buf:
                try:
                    self.usage = usage_of(json.loads(bytes(self._buf))) or self.usage
                except ValueError:
                    pass
            self._buf.clear()
            return b""
        rest = bytes(self._buf)
        self._buf.clear()
        if rest and self._scan_event(rest) and self.strip:
            return b""
        return rest if self.strip else b""

    def _scan_event(self, event: bytes) -> bool:
        """Record the usage of one event; True when it is the usage-only frame."""
        if b'"usage"' not in event:
            return False
        obj = _event_json(event)
        found = usage_of(obj)
        if found is not None:
            self.usage = found
        return is_usage_frame(obj)
