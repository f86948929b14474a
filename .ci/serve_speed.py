"""The serve stage's speed guard: `make serve`'s server decodes the README's example at >= --fail x the raw
jitted loop, both measured now on this machine (a ratio: it does not depend on the machine's speed).

    .venv-serve/bin/python .ci/serve_speed.py --port 11556     # after the README's curl example answered

1. The README's own request (its JSON body), streamed, 32 tokens with ignore_eos: the server's decode rate,
   tokens after the first over the time from the first to the last (its prefill left out).
2. The raw loop (benchmarks/engine.py's `raw_decode_loop`, batch 1, flat dense cache) on the same default
   model in this process, the server idle meanwhile.
Issue 51: this example answered at 0.65 tok/s (0.02x) while the serve stage only checked that it answered.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, ".ci"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

TOKENS = 32


def readme_body() -> dict:
    """The JSON body of the README's curl example (its -d argument)."""
    from readme_example import curl_example

    words = shlex.split(curl_example().replace("\\\n", " "))
    return json.loads(words[words.index("-d") + 1])


def serve_rate(port: int) -> tuple[float, int]:
    """(decode tokens/s, tokens) of the README's request streamed from the server."""
    body = dict(readme_body(), stream=True, max_tokens=TOKENS, ignore_eos=True)
    body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    times, tokens = [], 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    if tokens < 2 or len(times) < 2:
        raise SystemExit(f"the server streamed {tokens} tokens in {len(times)} chunks: nothing to time")
    # chunks after the first carry tokens - 1 tokens (a chunk may hold several)
    return (tokens - 1) / (times[-1] - times[0]), tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=11556)
    ap.add_argument("--fail", type=float, default=0.5)
    args = ap.parse_args(argv)
    served, tokens = max(serve_rate(args.port) for _ in range(2))

    from engine import raw_decode_loop

    import vsurge

    model, _ = vsurge.load_model("default")
    raw = raw_decode_loop(model, 1, 32, TOKENS)
    ratio = served / raw
    print(
        f"serve decodes the README example at {served:.1f} tok/s ({tokens} tokens), the raw loop at {raw:.1f}: "
        f"{ratio:.2f}x"
    )
    if ratio < args.fail:
        print(f"FAILED: below {args.fail}x the raw loop", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
