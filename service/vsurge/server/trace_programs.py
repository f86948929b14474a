"""The XLA programs that ran in a `jax.profiler` trace, by device time: what POST /debug/profile answers
(profile_routes.py), and, for a trace taken any other way (``jax.profiler.trace``, TensorBoard's capture)::

    python -m vsurge.server.trace_programs DIR/plugins/profile/RUN/HOST.xplane.pb

A program is named as XLA names it, ``jit_<function>``: the engine's programs are the functions of its
program inventory (engines/program_inventory.py), e.g. ``jit__decode_impl`` for "decode slots=R".
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any


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


def main(argv: list[str]) -> int:
    """Print the programs of a trace file, most device time first."""
    if len(argv) != 1:
        print("usage: python -m vsurge.server.trace_programs TRACE.xplane.pb", file=sys.stderr)
        return 2
    rows = programs(argv[0])
    print(f"{'seconds':>10} {'runs':>6}  program")
    for row in rows:
        print(f"{row['seconds']:10.4f} {row['executions']:6d}  {row['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
