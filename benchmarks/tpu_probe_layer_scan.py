# ruff: noqa: B023 - the probe's closures run inside the loop iteration that made them
"""Does running the decoder layers under one `jax.lax.scan` compile faster than the model's unrolled loop,
and run as fast? One process, a time budget, every program measured both ways on the chip.

    python benchmarks/tpu_probe_layer_scan.py --out results.json --budget-s 240 --shapes 1b64   # on the TPU
    python benchmarks/tpu_probe_layer_scan.py --out r.json --budget-s 540 --shapes 1b64,8b     # + 8B int8
    python benchmarks/tpu_probe_layer_scan.py --reduced --out /tmp/x.json                      # CPU smoke test

Expected on a v5e chip (estimates, most of it U's compiles): 1b64 ~2.5-3 min, 8b ~4-6 min more. Each
section starts only if the budget still holds its expected compile (and the S sections it pairs with), so
a short budget drops U's 1,024-token prefill first; --out is rewritten after every section.

The model (models/llama.py) runs its layers as a Python loop, so every program XLA compiles holds one copy
of the layer per layer (16 for the 1B shape, 32 for the 8B). For each shape and each program the probe
builds two variants of the same computation on the same random weights (device_check.random_model):

* U: the model's own forward as the engine calls it (dense_programs.py: `PrefillAttention` with meta
  (positions, totals, segments) and caches [None] * L for prefill; `DenseDecodeAttention` over the flat
  [S, M, KVH * D] cache with meta (positions, lengths) for decode, then the logits' argmax);
* S: the model's own `DecoderLayer` (its RMSNorm, rope, projections, int8 matmuls, MLP) merged per step
  of one `jax.lax.scan` over the layers' parameters stacked [L, ...] (jnp.stack, once, outside the timed
  programs). Prefill's per-layer K/V come out of the scan stacked [L, B, T, KVH, D]. Decode carries the
  stacked cache K, V [L, S, M, KVH * D] through the scan: layer l writes its new token's K/V into the
  carry at [l, row, position] (one scatter of a row per slot, in place, as U's: the rows' positions
  differ, so a single dynamic_update_slice cannot) and reads its layer through dynamic slices of the
  stacked carry inside its chunk loop (`StackedDecodeAttention`), never slicing a whole layer out.
  U and S use the same reader (attention.flat_read_rows' form, the one TPUs run; forced on CPU too).
  When U's layers and S's stacked copy do not fit together (8b), every U program runs first, then the
  stack replaces U's layers leaf by leaf.

Programs: prefill [16, 128] and [1, 1024] tokens, decode of 64 rows at context ~400 in a 1024-position
cache (8b: 512 positions, so an int8 model and its cache fit the 16 GiB chip). Per (shape, program,
variant): trace + lower seconds (`jit(f).lower`), XLA compile seconds (`.compile()`), lower again with a
fresh jit of a new function object ("relower": what a warm start pays per program before it reads the
persistent cache), run ms per call (median after two warm calls), the compiled program's temporary bytes
and its large copies (a copied cache or weight stack shows there), and for decode the HBM bytes read
(weights + KV) per second as a share of the chip's peak. S is checked against U: the max abs difference
of the last hidden states, the K/V, the logits, and the argmax agreement (a wrong S is worthless).

The persistent compilation cache is switched off, so every compile is a cold one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from device_check import peak_gbps  # noqa: E402
from tpu_probe_harness import DEADLINE, RESULTS, left, section  # noqa: E402
from tpu_probe_scan_parts import (  # noqa: E402
    PROGRAMS,
    Shape,
    _written_s,
    _written_u,
    program_label,
)

from vsurge.models.attention import (  # noqa: E402
    use_dense_reader,
)

# ------------------------------------------------------------------------------------------ measuring

_ITEM = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_COPY = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* copy\(")


def big_copies(hlo: str, threshold: int) -> tuple[int, float]:
    """Copy instructions of at least `threshold` bytes in the compiled HLO: (count, MB)."""
    n, total = 0, 0
    for dt, dims in _COPY.findall(hlo):
        size = _ITEM.get(dt, 4) * int(np.prod([int(x) for x in dims.split(",") if x] or [1]))
        if size >= threshold:
            n, total = n + 1, total + size
    return n, total / 2**20


def compile_program(sh: Shape, program: str, variant: str, args, copy_threshold: int):
    """Lower and compile a fresh jit; then lower again from another fresh one (the warm-start cost)."""
    f, donate = sh.make(program, variant)
    with use_dense_reader("flat"):  # U reads as on TPU everywhere, so S (the same reader) matches it
        t0 = time.perf_counter()
        lowered = jax.jit(f, donate_argnums=donate).lower(*args)
        lower_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        row: dict[str, Any] = dict(lower_s=lower_s, compile_s=compile_s)
        if left() > 2 * lower_s + 10:
            f2, _ = sh.make(program, variant)
            t0 = time.perf_counter()
            jax.jit(f2, donate_argnums=donate).lower(*args)
            row["relower_s"] = time.perf_counter() - t0
    try:
        ma = compiled.memory_analysis()
        row["temp_mb"] = ma.temp_size_in_bytes / 2**20
    except Exception:  # noqa: BLE001 - not every backend reports it
        pass
    try:
        row["copies"], row["copy_mb"] = big_copies(compiled.as_text(), copy_threshold)
    except Exception:  # noqa: BLE001
        pass
    print(
        f"  {sh.name} {program} {variant}: lower {lower_s:.2f}s compile {compile_s:.2f}s"
        + (f" relower {row['relower_s']:.2f}s" if "relower_s" in row else ""),
        flush=True,
    )
    return compiled, row


def median_ms(call, n: int, warm: int = 1) -> float:
    for _ in range(warm):
        jax.block_until_ready(call())
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x)).astype(np.float32)


def run_prefill(sh: Shape, program: str, variant: str) -> dict[str, Any]:
    r, t = sh.plan.prefill[program]
    inputs = sh.prefill_args(program)
    if variant == "U":
        if not sh.u_alive:
            raise RuntimeError("U's layers were freed for S's stack")
        args = (sh.state, *inputs)
    else:
        args = (sh.outer, sh.stacked, *inputs)
    compiled, row = compile_program(
        sh, program, variant, args, copy_threshold=max(2**20, sh.layer_bytes // (8 * sh.cfg.num_layers))
    )
    hidden, kv = compiled(*args)
    jax.block_until_ready(hidden)
    if variant == "U":
        ks = np.stack([host(k) for k, _ in kv])
        vs = np.stack([host(v) for _, v in kv])
    else:
        ks, vs = host(kv[0]), host(kv[1])
    logits = sh.logits(hidden)
    sh.outputs[(program, variant)] = dict(
        hidden=host(hidden), k=ks, v=vs, logits=logits, argmax=logits.argmax(-1)
    )
    del hidden, kv
    row["run_ms"] = median_ms(lambda: compiled(*args)[0], n=5)
    row["tok_s"] = r * t / row["run_ms"] * 1e3
    return row


def run_decode(sh: Shape, variant: str, peak: float | None) -> dict[str, Any]:
    p, cfg = sh.plan, sh.cfg
    tokens, positions = sh.decode_inputs()
    layer_kv = sh.kv_bytes // cfg.num_layers // 2
    if variant == "U":
        if not sh.u_alive:
            raise RuntimeError("U's layers were freed for S's stack")
        caches = sh.caches_u()
        compiled, row = compile_program(sh, "decode", "U", (sh.state, caches, tokens, positions), layer_kv)
        nxt, hidden, caches = compiled(sh.state, caches, tokens, positions)
        wk, wv = _written_u(caches, positions)
        box = [caches, nxt]

        def call():
            box[1], _, box[0] = compiled(sh.state, box[0], box[1], positions)
            return box[1]
    else:
        kc, vc = sh.caches_s()
        compiled, row = compile_program(
            sh, "decode", "S", (sh.outer, sh.stacked, kc, vc, tokens, positions), layer_kv
        )
        nxt, hidden, kc, vc = compiled(sh.outer, sh.stacked, kc, vc, tokens, positions)
        wk, wv = _written_s(kc, vc, positions)
        box = [(kc, vc), nxt]

        def call():
            box[1], _, k_, v_ = compiled(sh.outer, sh.stacked, *box[0], box[1], positions)
            box[0] = (k_, v_)
            return box[1]

    logits = sh.logits(hidden)
    sh.outputs[("decode", variant)] = dict(
        hidden=host(hidden), k=host(wk), v=host(wv), logits=logits, argmax=np.asarray(nxt)
    )
    del hidden, wk, wv
    row["run_ms"] = median_ms(call, n=10)
    box.clear()
    itemsize = jnp.dtype(sh.kv_dtype).itemsize
    read = int(np.sum(np.minimum(np.asarray(positions) + 1, p.max_len)))
    kv_read = read * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    gbps = (sh.wbytes + kv_read) / (row["run_ms"] / 1e3) / 1e9
    row.update(tok_s=p.batch / row["run_ms"] * 1e3, gbps=gbps, hbm_mb=(sh.wbytes + kv_read) / 2**20)
    if peak:
        row["pct_roofline"] = 100 * gbps / peak
    return row


def compare(sh: Shape, program: str) -> dict[str, Any] | None:
    u, s = sh.outputs.get((program, "U")), sh.outputs.get((program, "S"))
    if u is None or s is None:
        return None
    out = dict(shape=sh.name, program=program, label=program_label(program, sh.plan))
    for key in ("hidden", "k", "v", "logits"):
        out[f"{key}_maxdiff"] = float(np.max(np.abs(u[key] - s[key])))
        out[f"{key}_maxabs"] = float(np.max(np.abs(u[key])))
    out["argmax_agree"] = float(np.mean(u["argmax"] == s["argmax"]))
    if program == "decode":  # the program's own argmax against the one from its hidden state
        out["argmax_vs_hidden"] = float(np.mean(s["argmax"] == s["logits"].argmax(-1)))
    return out


# ------------------------------------------------------------------------------------------ the driver


def need_s(sh: Shape, program: str, variant: str, reduced: bool) -> float:
    """Seconds a section should have left before it starts: its expected compile and runs."""
    if reduced:
        return 2.0
    per_layer = {"prefill_small": 1.5, "decode": 1.5, "prefill_big": 5.0}[program]
    scale = sh.cfg.num_layers if variant == "U" else 4
    return 15 + per_layer * scale * (1.3 if sh.quantization == "int8" else 1)


def probe_shape(name: str, reduced: bool, quantization: str, peak: float | None, skip: set[str]) -> None:
    ctx: dict[str, Shape] = {}

    def setup():
        sh = Shape(name, reduced, quantization)
        ctx["sh"] = sh
        return dict(
            shape=name,
            layers=sh.cfg.num_layers,
            dtype=jnp.dtype(sh.dtype).name,
            quantization=quantization,
            weight_gb=sh.wbytes / 1e9,
            layer_gb=sh.layer_bytes / 1e9,
            kv_gb=sh.kv_bytes / 1e9,
            plan=dataclasses.asdict(sh.plan),
        )

    section(f"{name} setup", need=30 if not reduced else 1)(setup)()
    sh = ctx.get("sh")
    if sh is None:
        return
    programs = [p for p in PROGRAMS if p not in skip]
    both = sh.fits_both()
    RESULTS["sections"][f"{name} setup"]["fits_both"] = both

    def variant_section(program, variant, reserve=0.0):
        """`reserve`: seconds to leave for the S sections that must follow (a U alone answers nothing)."""

        def body():
            if program == "decode":
                row = run_decode(sh, variant, peak)
            else:
                row = run_prefill(sh, program, variant)
            row = dict(
                shape=name, program=program, label=program_label(program, sh.plan), variant=variant, **row
            )
            RESULTS["rows"].append(row)
            save()
            return row

        need = need_s(sh, program, variant, reduced) + reserve
        return section(f"{name} {program} {variant}", need=need)(body)()

    def stack(free):
        return section(f"{name} stack", need=5)(lambda: sh.stack(free))()

    if both:  # interleaved: each program U then S, so a short budget still leaves whole pairs
        stack(False)
        for program in programs:
            if sh.stacked is None:  # no S to pair with: U alone still measures the baseline
                variant_section(program, "U")
                continue
            variant_section(program, "U", need_s(sh, program, "S", reduced))
            variant_section(program, "S")
    else:  # U and S weights do not fit together: every U first, then S on the layers U gave up
        s_total = sum(need_s(sh, program, "S", reduced) for program in programs)
        for program in programs:
            variant_section(program, "U", s_total)
        if stack(True) is not None:
            for program in programs:
                variant_section(program, "S")
    for program in programs:
        try:
            c = compare(sh, program)
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"].append(f"{name} {program} compare: {type(e).__name__}: {e}")
            continue
        if c is not None:
            RESULTS["compare"].append(c)
            print(
                f"  {name} {program}: S vs U max|diff| hidden {c['hidden_maxdiff']:.3g} "
                f"k {c['k_maxdiff']:.3g} v {c['v_maxdiff']:.3g} logits {c['logits_maxdiff']:.3g} "
                f"argmax agree {100 * c['argmax_agree']:.1f}%",
                flush=True,
            )
    sh.outputs.clear()
    ctx.clear()


OUT: list[str | None] = [None]  # --out: rewritten after every section, so a run cut short keeps its rows


def save() -> None:
    if OUT[0]:
        Path(OUT[0]).write_text(json.dumps(RESULTS, indent=1, default=str))


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table() -> str:
    lines = [
        f"{'shape':6} {'program':20} {'v':1} {'lower s':>8} {'relower s':>9} {'compile s':>9} {'run ms':>9} "
        f"{'%roof':>6} {'temp MB':>8} {'copies':>10}"
    ]
    for r in RESULTS["rows"]:
        copies = f"{r['copies']}/{r['copy_mb']:.0f}MB" if "copies" in r else "-"
        lines.append(
            f"{r['shape']:6} {r['label']:20} {r['variant']:1} {r['lower_s']:8.2f} {_f(r.get('relower_s'), '9.2f'):>9} "
            f"{r['compile_s']:9.2f} {r['run_ms']:9.3f} {_f(r.get('pct_roofline'), '6.1f'):>6} "
            f"{_f(r.get('temp_mb'), '8.1f'):>8} {copies:>10}"
        )
    rows = {(r["shape"], r["program"], r["variant"]): r for r in RESULTS["rows"]}
    lines.append("")
    lines.append(
        f"{'shape':6} {'program':20} {'compile U/S':>11} {'lower U/S':>9} {'run S/U':>8} {'hidden diff':>11} "
        f"{'kv diff':>9} {'logit diff':>10} {'argmax':>7}"
    )
    for c in RESULTS["compare"]:
        u, s = rows.get((c["shape"], c["program"], "U")), rows.get((c["shape"], c["program"], "S"))
        cu = u["compile_s"] / s["compile_s"] if u and s else None
        lu = u["lower_s"] / s["lower_s"] if u and s else None
        rs = s["run_ms"] / u["run_ms"] if u and s else None
        kv = max(c["k_maxdiff"], c["v_maxdiff"])
        lines.append(
            f"{c['shape']:6} {c['label']:20} {_f(cu, '11.1f'):>11} {_f(lu, '9.1f'):>9} {_f(rs, '8.3f'):>8} "
            f"{c['hidden_maxdiff']:11.3g} {kv:9.3g} {c['logits_maxdiff']:10.3g} {100 * c['argmax_agree']:6.1f}%"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--reduced", action="store_true", help="the tiny shape (4 layers, float32): a CPU smoke test"
    )
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", default="1b64", help="comma list of 1b64, 1b128, 8b (8b: int8 weights)")
    p.add_argument("--quantization", default=None, help="none|int8 for every shape (default: int8 for 8b)")
    p.add_argument("--skip", default="", help=f"comma list of programs: {', '.join(PROGRAMS)}")
    p.add_argument(
        "--compile-cache",
        action="store_true",
        help="leave the persistent compilation cache as configured (default: off, every compile a cold one; "
        "jax decides once per process, so in a process that compiled already the switch does nothing)",
    )
    a = p.parse_args(argv)
    DEADLINE[0] = time.perf_counter() + a.budget_s
    OUT[0] = a.out
    RESULTS.clear()
    RESULTS.update(sections={}, errors=[], rows=[], compare=[])
    # every compile a cold one: a warm persistent cache would hide what the probe measures
    if a.compile_cache:
        return _run(a)
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return _run(a)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was)


def _run(a) -> int:
    dev = jax.devices()[0]
    peak = peak_gbps(dev.device_kind)
    RESULTS.update(
        device=dev.device_kind,
        jax=jax.__version__,
        peak_gbps=peak,
        reduced=a.reduced,
        compile_cache=jax.config.jax_enable_compilation_cache,
    )
    print(f"device {dev.device_kind} jax {jax.__version__} peak {peak}", flush=True)
    skip = set(a.skip.split(",")) - {""}
    shapes = ["tiny"] if a.reduced else a.shapes.split(",")
    for shape in shapes:
        quant = a.quantization or ("int8" if shape.startswith("8b") else "none")
        probe_shape(shape, a.reduced, quant, peak, skip)
        save()
    text = table()
    RESULTS["table"] = text
    print(text, flush=True)
    save()
    print("errors:", RESULTS["errors"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
