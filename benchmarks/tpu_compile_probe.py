"""What each of the engine's programs costs to compile, one at a time on an otherwise idle host: the start
a pod pays, program by program, without the contention of the parallel pool.

    python benchmarks/tpu_compile_probe.py --shape 1b64 --out $OUT/compile.json          # on the TPU
    python benchmarks/tpu_compile_probe.py --shape tinyvocab --out /tmp/c.json --kinds 3   # CPU smoke test

The engine is the one `vsurge serve` builds on this backend with no engine flags (batch and max_length as
the TPU benchmark's), on abstract weights of the shape (`loader.abstract_model`: nothing loaded, nothing
allocated), so the probe needs no checkpoint. Its programs are `program_inventory.programs`: every program
a live request can hit. By default one program of each kind (a kind: the name less its sizes, the largest
size first); ``--all`` compiles every one. The persistent compilation cache is off: every compile is cold.
Per program: trace + lower seconds, XLA compile seconds, the compiled module's size in bytes of HLO text.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def kind(name: str) -> str:
    return re.sub(r"(?<!\d)[1-9]\d*", "N", name)


def sizes(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"(?<!\d)[1-9]\d*", name))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1b64")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--all", action="store_true", help="every program, not one per kind")
    p.add_argument("--kinds", type=int, default=0, help="at most this many programs (0: no limit)")
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import jax
    from tpu_checkpoint import hf_config

    from vsurge.engines.program_inventory import programs
    from vsurge.engines.vengine import vEngine
    from vsurge.models.config import ModelConfig
    from vsurge.models.loader import abstract_model

    t_start = time.perf_counter()
    cfg = ModelConfig.from_hf(hf_config(args.shape), source=args.shape)
    engine = vEngine(
        abstract_model(cfg, mesh=None), None, max_concurrent_decodes=args.batch, max_length=args.max_length
    )
    progs = programs(engine)
    if not args.all:
        # per kind, the program of the largest sizes (the slowest to compile of its kind)
        best: dict[str, object] = {}
        for prog in progs:
            k = kind(prog.name)
            if k not in best or sizes(prog.name) > sizes(best[k].name):
                best[k] = prog
        progs = list(best.values())
    if args.kinds:
        progs = progs[: args.kinds]
    out = dict(shape=args.shape, backend=jax.default_backend(), programs=[], skipped=[])
    for prog in progs:
        if time.perf_counter() - t_start > args.budget_s:
            out["skipped"].append(prog.name)
            continue
        row = dict(name=prog.name)
        try:
            t0 = time.perf_counter()
            lowered = prog.fn.lower(*prog.args)
            row["lower_s"] = round(time.perf_counter() - t0, 3)
            row["hlo_chars"] = len(lowered.as_text())
            t1 = time.perf_counter()
            lowered.compile()
            row["compile_s"] = round(time.perf_counter() - t1, 3)
        except Exception as e:  # noqa: BLE001 - a program that fails is reported, the probe goes on
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        out["programs"].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    total = sum(r.get("compile_s", 0) for r in out["programs"])
    out["compile_sum_s"] = round(total, 2)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{len(out['programs'])} programs, compile sum {total:.1f}s, skipped {len(out['skipped'])}")


if __name__ == "__main__":
    main()
