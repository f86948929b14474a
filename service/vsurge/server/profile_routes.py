"""POST /debug/profile?seconds=N: a `jax.profiler` trace of N seconds of serving, written under the
server's profile directory (`vsurge serve --profile-dir DIR`, VSURGE_PROFILE_DIR) as TensorBoard / XProf
read it: ``DIR/plugins/profile/<run>/<host>.xplane.pb`` (and a ``.trace.json.gz`` for Perfetto).

The route is off (404) unless a profile directory was given, and guarded as the other admin routes
(lora_routes.py): the admin key where one is set, else the API key. One trace at a time: a second request
while one runs gets 409. The answer names the trace file and lists the engine's programs that ran in it,
by device time (trace_programs.py: ``python -m vsurge.server.trace_programs TRACE.xplane.pb`` prints the
same list for a trace taken any other way; docs/performance.md, "Why is my step slow").
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

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


class ProfileRoutes:
    """POST /debug/profile. A mixin of vSurgeApiServer (needs `_check_admin`, lora_routes.py)."""

    profile_dir: str | None = None
    _profiling: threading.Lock  # one trace at a time (set in vSurgeApiServer.__init__)

    @answers_api_errors
    async def debug_profile(self, request: Request) -> Response:
        from .trace_programs import programs  # not at import: `python -m` runs that module alone

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
