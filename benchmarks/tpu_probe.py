# ruff: noqa: B023 - the probe's closures run inside the loop iteration that made them
"""Where a TPU decode step's time goes: attention forms, the ragged kernel's block sizes, the sampler, int8
matmuls and the engines' own decode programs, each timed alone on the chip (one process, a time budget).

    python benchmarks/tpu_probe.py --out results.json          # on the TPU machine (<= ~8 min)
    python benchmarks/tpu_probe.py --reduced                   # tiny shapes on CPU (a smoke test)

It answers the questions a TPU engine's design turns on, with numbers from the chip rather than guesses:
which dense-cache attention form reads the KV cache at HBM speed for head_dim 64 and 128; how fast JAX's
ragged paged attention kernel is per block size (head_dim 64 padded to the 128 lanes); what the sampler
adds to a 64-row step over a 128k vocabulary; whether int8 weights are read as int8 (per channel against
per group of 64); and how far the engines' decode programs are from the model's bare step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
from device_check import peak_gbps  # noqa: E402
from tpu_probe_attention import attention_forms, memory_layout  # noqa: E402
from tpu_probe_harness import DEADLINE, RESULTS  # noqa: E402
from tpu_probe_kernels import int8_matmuls, sampler  # noqa: E402
from tpu_probe_models import decode_steps  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reduced", action="store_true")
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", default="1b64,1b128")
    p.add_argument("--skip", default="", help="comma list of sections: attention,sampler,int8,decode,memory")
    a = p.parse_args(argv)
    DEADLINE[0] = time.perf_counter() + a.budget_s
    dev = jax.devices()[0]
    peak = peak_gbps(dev.device_kind)
    RESULTS.update(device=dev.device_kind, jax=jax.__version__, peak_gbps=peak)
    print(f"device {dev.device_kind} jax {jax.__version__} peak {peak}", flush=True)
    skip = set(a.skip.split(","))
    s, m, layers = (8, 64, 2) if a.reduced else (64, 1024, 16)
    shapes = ["tiny"] if a.reduced else a.shapes.split(",")
    if "memory" not in skip:
        memory_layout()
    if "int8" not in skip:
        int8_matmuls(8 if a.reduced else 64, a.reduced, peak)
    if "sampler" not in skip:
        sampler(s, 512 if a.reduced else 128256)
    for shape in shapes:
        if "attention" not in skip:
            rows = attention_forms(shape, s, m, 2 if a.reduced else layers, a.reduced, peak) or []
            rp = [r for r in rows if r["form"].startswith("rpa") and r["case"] == "fixed400" and r.get("kvb")]
            if rp:
                b = min(rp, key=lambda r: r["ms"])
                RESULTS.setdefault("best_rpa", {})[shape] = (b["kvb"], b["qb"], b["page_size"])
        if "decode" not in skip:
            decode_steps(shape, s, 32 if a.reduced else 400, m, a.reduced, peak)
        if a.out:
            Path(a.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    if a.out:
        Path(a.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    print("errors:", RESULTS["errors"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
