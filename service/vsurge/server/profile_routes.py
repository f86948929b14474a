"""POST /debug/profile?seconds=N: a `jax.profiler` trace of N seconds of serving, written under the
server's profile directory (`vsurge serve --profile-dir DIR`, VSURGE_PROFILE_DIR) as TensorBoard / XProf
read it: ``DIR/plugins/profile/<run>/<host>.xplane.pb`` (and a ``.trace.json.gz`` for Perfetto).

The route is off (404) unless a profile directory was given, and guarded as the other admin routes
(lora_routes.py): the admin key where one is set, else the API key. One trace at a time: a second request
while one runs gets 409. The answer names the trace file and lists the engine's programs that ran in it,
by device time: ``python -m vsurge.server.profile_routes TRACE.xplane.pb`` prints the same list for a trace
taken any other way (docs/performance.md, "Why is my step slow").
"""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import errors
from .errors import APIError
from .route_helpers import answers_api_errors

MAX_SECONDS = 600.0  # a trace's events are held in memory until it stops


def parse_seconds(text: str | None) -> float:
    """The ``seconds`` query parameter: a number in (0, MAX_SECONDS]."""
    try:
        seconds = float(text) if text is not None else float("nan")
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= MAX_SECONDS:  # NaN fails too
        raise errors.invalid_request(
            f"seconds must be a number of seconds in (0, {MAX_SECONDS:g}], got {text!r}", param="seconds"
        )
    return seconds


class TraceRunning(RuntimeError):
    """Another trace of this process runs (jax.profiler allows one at a time)."""


def take_trace(directory: str, seconds: float) -> Path:
    """Trace ``seconds`` of this process into ``directory``; the .xplane.pb file written."""
    import jax

    runs = Path(directory) / "plugins" / "profile"
    before = set(runs.glob("*/*.xplane.pb"))
    try:
        jax.profiler.start_trace(directory)
    except RuntimeError as e:  # a trace started outside this route (the program embedding the server)
        raise TraceRunning(str(e)) from None
    try:
        time.sleep(seconds)
    finally:
        jax.profiler.stop_trace()
    written = sorted(set(runs.glob("*/*.xplane.pb")) - before, key=lambda p: p.stat().st_mtime)
    if not written:
        raise RuntimeError(f"jax.profiler wrote no trace under {runs}")
    return written[-1]


def programs(trace: str | Path) -> list[dict[str, Any]]:
    """The XLA programs that ran in ``trace`` (an .xplane.pb), most device time first: each one's name
    (``jit_<function>``), executions and seconds. An execution is a run id of the program's device events
    (XLA:CPU's thunks, a TPU's ops); its seconds run from its first event's start to its last one's end."""
    import jax

    spans: dict[tuple[str, int], list[float]] = {}
    for plane in jax.profiler.ProfileData.from_file(str(trace)).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                module, run = stats.get("hlo_module"), stats.get("run_id")
                if module is None or run is None:
                    continue
                span = spans.setdefault((str(module), int(run)), [event.start_ns, event.start_ns])
                span[0] = min(span[0], event.start_ns)
                span[1] = max(span[1], event.start_ns + event.duration_ns)
    runs: collections.Counter[str] = collections.Counter()
    took: collections.Counter[str] = collections.Counter()
    for (module, _), (start, end) in spans.items():
        runs[module] += 1
        took[module] += (end - start) / 1e9
    return [
        {"name": name, "executions": runs[name], "seconds": round(took[name], 6)}
        for name in sorted(runs, key=lambda n: -took[n])
    ]


class ProfileRoutes:
    """POST /debug/profile. A mixin of vSurgeApiServer (needs `_check_admin`, lora_routes.py)."""

    profile_dir: str | None = None
    _profiling: threading.Lock  # one trace at a time (set in vSurgeApiServer.__init__)

    @answers_api_errors
    async def debug_profile(self, request: Request) -> Response:
        self._check_admin(request)  # type: ignore[attr-defined]
        if self.profile_dir is None:
            raise APIError(
                404,
                "Profiling is off: start the server with --profile-dir DIR (VSURGE_PROFILE_DIR) to take "
                "traces with POST /debug/profile?seconds=N.",
                code="profiling_disabled",
            )
        seconds = parse_seconds(request.query_params.get("seconds"))
        busy = APIError(409, "A profile is being taken; one at a time.", code="profile_in_progress")
        if not self._profiling.acquire(blocking=False):
            raise busy
        try:
            trace = await asyncio.to_thread(take_trace, self.profile_dir, seconds)
            listed = await asyncio.to_thread(programs, trace)
        except TraceRunning:
            raise busy from None
        finally:
            self._profiling.release()
        return JSONResponse({"trace": str(trace), "seconds": seconds, "programs": listed})


def main(argv: list[str]) -> int:
    """Print the programs of a trace file, most device time first."""
    if len(argv) != 1:
        print("usage: python -m vsurge.server.profile_routes TRACE.xplane.pb", file=sys.stderr)
        return 2
    rows = programs(argv[0])
    print(f"{'seconds':>10} {'runs':>6}  program")
    for row in rows:
        print(f"{row['seconds']:10.4f} {row['executions']:6d}  {row['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
