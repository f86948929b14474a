"""Usage read from relayed answers (pure): a JSON body, a stream's usage frame (kept, or taken out when
the router asked for it), whatever the chunking."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from vsurge.router.usage import Usage, UsageScanner


def _event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


CHUNKS = [_event({"choices": [{"index": 0, "delta": {"content": t}}], "usage": None}) for t in ("a", "b")]
USAGE_FRAME = _event(
    {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}}
)
STREAM = b"".join(CHUNKS) + USAGE_FRAME + b"data: [DONE]\n\n"


def _relay(scanner: UsageScanner, pieces: list[bytes]) -> bytes:
    return b"".join(scanner.feed(p) for p in pieces) + scanner.finish()


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_a_stream_is_relayed_unchanged_or_without_the_usage_frame_however_it_is_cut(cuts: list[int]) -> None:
    pieces = _split(STREAM, cuts)
    keep = UsageScanner(stream=True)
    assert _relay(keep, pieces) == STREAM and keep.usage == Usage(11, 2)
    strip = UsageScanner(stream=True, strip_usage_frame=True)
    assert _relay(strip, pieces) == b"".join(CHUNKS) + b"data: [DONE]\n\n" and strip.usage == Usage(11, 2)


def test_a_json_answer_and_odd_inputs() -> None:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    s = UsageScanner(stream=False)
    assert _relay(s, [body[:5], body[5:]]) == body and s.usage == Usage(3, 4) and s.usage.total == 7
    for junk in (b"not json", b'{"usage": "x"}', b'{"usage": {"prompt_tokens": true}}', b""):
        s = UsageScanner(stream=False)
        assert _relay(s, [junk]) == junk and s.usage is None
    # CRLF-framed events and a stream without usage.
    crlf = STREAM.replace(b"\n\n", b"\r\n\r\n")
    s = UsageScanner(stream=True, strip_usage_frame=True)
    assert _relay(s, [crlf]) == crlf.replace(USAGE_FRAME.replace(b"\n\n", b"\r\n\r\n"), b"")
    s = UsageScanner(stream=True)
    assert _relay(s, CHUNKS) == b"".join(CHUNKS) and s.usage is None
    # Not SSE at all (no blank line for a megabyte): relayed as it came, scanning stops.
    blob = b"x" * (1024 * 1024 + 10)
    s = UsageScanner(stream=True, strip_usage_frame=True)
    assert _relay(s, [blob[:100], blob[100:]]) == blob
