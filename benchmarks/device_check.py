"""One command for a lent accelerator: is the engine's decode step where the hardware says it should be?

    python benchmarks/device_check.py              # 1B and 8B Llama shapes, batch 1/32/128 (<= ~8 min)
    python benchmarks/device_check.py --reduced    # tiny shapes, seconds (the default on CPU; run by tests)

For Llama-shaped models with random weights built directly on the device (no hub, no checkpoint files), in
bfloat16 and in int8 (models/quantization.py), over the dense KV cache (vEngine's) and the paged one
(oEngine's, pure-JAX page walk), at each batch: the decode step time, tokens/s and the achieved memory
bandwidth = (weight bytes + KV bytes read per step) / step time, as a share of the device's peak (a table
below; an unknown device prints n/a). Then the greedy tokens of a tiny model decoded on the device, dense
and paged, float32 and int8, against the CPU reference (models/reference.py) of the same weights.

A time budget (--budget-s, default 450) skips the configurations that no longer fit and says so.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from vsurge.models.attention import DenseDecodeAttention  # noqa: E402
from vsurge.models.config import ModelConfig  # noqa: E402
from vsurge.models.llama import LlamaForCausalLM  # noqa: E402
from vsurge.models.paged_attention import PagedDecodeAttention  # noqa: E402

# Peak memory bandwidth, GB/s (vendor figures), matched on jax's device_kind (lower case, first match).
PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("h200", 4800.0),
    ("h100 pcie", 2000.0),
    ("h100", 3350.0),  # SXM, HBM3
    ("a100-sxm4-80gb", 2039.0),
    ("a100 80gb pcie", 1935.0),
    ("a100", 1555.0),  # 40 GB
    ("l4", 300.0),
    ("tpu v4", 1200.0),
    ("tpu v5 lite", 819.0),  # v5e
    ("tpu v5e", 819.0),
    ("tpu v5p", 2765.0),
    ("tpu v5", 2765.0),  # v5p reports "TPU v5"
    ("tpu v6 lite", 1640.0),  # v6e (Trillium)
    ("tpu v6e", 1640.0),
)


def peak_gbps(device_kind: str) -> float | None:
    kind = device_kind.lower()
    return next((gbps for key, gbps in PEAK_GBPS if key in kind), None)


def llama(name: str, **kw: Any) -> tuple[str, ModelConfig]:
    base = dict(model_type="llama", rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
    return name, ModelConfig(**{**base, **kw})


SHAPES = dict(
    [
        llama(  # Llama-3.2-1B
            "1b",
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            tie_word_embeddings=True,
        ),
        llama(  # Llama-3.1-8B
            "8b",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
        ),
        llama(
            "tiny",
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
        ),
    ]
)
PARITY_SHAPE = replace(SHAPES["tiny"], vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16)


# ------------------------------------------------------------------------------------------ the model


def random_model(
    cfg: ModelConfig, dtype: Any, quantization: str, seed: int = 0, device=None, std: float = 0.02
) -> nnx.Module:
    """A model with random weights (N(0, std), int8 alike) made on `device` parameter by parameter (no host
    copy, no file)."""
    device = device or jax.devices()[0]
    abstract = nnx.eval_shape(
        lambda: LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), quantization=quantization)
    )
    graphdef, state = nnx.split(abstract)
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        shape, dt = var.get_value().shape, var.get_value().dtype
        leaf = str(path[-1])
        var.set_value(_fill(jax.random.fold_in(key, i), shape, jnp.dtype(dt).name, leaf, device, std))
    return nnx.merge(graphdef, state)


@partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _fill_jit(key, shape, dtype, leaf, _device_id, std):
    if dtype == "int8":
        return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)
    if leaf == "scale":  # int8 * scale ~ N(0, 0.02)-sized weights
        return jnp.full(shape, std / 64, dtype)
    if leaf in ("weight", "bias") and len(shape) == 1:  # norms at 1 (+ noise), biases small
        return (
            (1.0 + 0.02 * jax.random.normal(key, shape)).astype(dtype)
            if leaf == "weight"
            else jnp.zeros(shape, dtype)
        )
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _fill(key, shape, dtype: str, leaf: str, device, std: float) -> jax.Array:
    with jax.default_device(device):
        return jax.device_put(_fill_jit(key, tuple(shape), dtype, leaf, device.id, std), device)


def weight_bytes(model: nnx.Module) -> int:
    """Bytes a decode step reads from the weights: every parameter, except an untied embedding table
    (a decode step gathers only its batch's rows)."""
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if model.lm_head is not None:
        total -= model.model.embed_tokens.embedding[...].nbytes
    return total


# ------------------------------------------------------------------------------------------ decode steps


@dataclass
class Decoder:
    """A jitted decode step over one KV layout, its caches and its per-step metadata."""

    name: str
    step: Any
    caches: list
    meta: Any
    kv_bytes_read: int  # per step, at the filled context


def make_decoder(
    model, attention: str, batch: int, context: int, page_size: int = 64, device=None
) -> Decoder:
    cfg = model.config
    device = device or jax.devices()[0]
    graphdef, _ = nnx.split(model)
    kv_dtype = model.dtype
    itemsize = jnp.dtype(kv_dtype).itemsize
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    positions = jnp.full((batch,), context - 1, jnp.int32)  # each row reads a full context
    if attention == "dense":
        shape = (batch, context, cfg.num_kv_heads, cfg.head_dim)
        backend = DenseDecodeAttention(window=cfg.sliding_window)
        meta = positions
    else:
        pages_per_row = -(-context // page_size)
        shape = (1 + batch * pages_per_row, page_size, cfg.num_kv_heads, cfg.head_dim)  # page 0: scratch
        table = 1 + jnp.arange(batch * pages_per_row, dtype=jnp.int32).reshape(batch, pages_per_row)
        backend = PagedDecodeAttention(
            page_size=page_size, num_pages=pages_per_row, window=cfg.sliding_window
        )
        meta = (positions, table)
    with jax.default_device(device):
        caches = [(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype)) for _ in range(cfg.num_layers)]

    @partial(jax.jit, donate_argnums=(1,))
    def step(state, caches, tokens, meta):
        m = nnx.merge(graphdef, state)
        pos = meta if attention == "dense" else meta[0]
        hidden, caches = m(tokens[:, None], pos[:, None], backend, caches, meta)
        return jnp.argmax(m.compute_logits(hidden[:, 0]), axis=-1).astype(jnp.int32), caches

    return Decoder(attention, step, caches, meta, batch * context * per_token)


def time_decoder(model, dec: Decoder, batch: int, steps: int) -> float:
    """Seconds per decode step (median of `steps` after two warm-up steps)."""
    state = nnx.state(model)
    tokens = jnp.zeros((batch,), jnp.int32)
    caches = dec.caches
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        tokens, caches = dec.step(state, caches, tokens, dec.meta)
        tokens.block_until_ready()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    dec.caches = caches
    return float(np.median(times))


# ------------------------------------------------------------------------------------------ parity


def greedy_by_decode(model, attention: str, prompt: list[int], new: int, device) -> list[int]:
    """Greedy tokens of one sequence, the prompt fed one decode step at a time, on `device`."""
    context = len(prompt) + new
    dec = make_decoder(model, attention, 1, context, page_size=8, device=device)
    state = nnx.state(model)
    caches, out = dec.caches, []
    seq = list(prompt)
    for t in range(context - 1):
        pos = jnp.full((1,), t, jnp.int32)
        meta = pos if attention == "dense" else (pos, dec.meta[1])
        nxt, caches = dec.step(state, caches, jnp.asarray([seq[t]], jnp.int32), meta)
        if t >= len(prompt) - 1:
            seq.append(int(nxt[0]))
            out.append(int(nxt[0]))
    return out[:new]


def parity(new_tokens: int = 8) -> list[dict[str, Any]]:
    """The tiny model's greedy tokens on the default device (dense, paged; float32, int8) against the CPU
    reference of the same weights."""
    from vsurge.models import reference

    cpu = jax.devices("cpu")[0]
    dev = jax.devices()[0]
    prompt = [3, 17, 101, 42, 7, 200, 5]
    rows = []
    with jax.default_matmul_precision("highest"):  # no TF32 on GPUs: float32 means float32 here
        for quant in ("none", "int8"):
            # weights large enough that the greedy tokens vary (at 0.02 a tiny model repeats one token)
            ref_model = random_model(PARITY_SHAPE, jnp.float32, quant, seed=1, device=cpu, std=0.25)
            want = reference.greedy_generate(ref_model, [prompt], new_tokens)[0]
            graphdef, state = nnx.split(ref_model)
            on_dev = nnx.merge(graphdef, jax.device_put(state, dev))
            for attention in ("dense", "paged"):
                got = greedy_by_decode(on_dev, attention, prompt, new_tokens, dev)
                rows.append(
                    dict(
                        weights="f32" if quant == "none" else "int8",
                        attention=attention,
                        ok=got == want,
                        got=got,
                        want=want,
                    )
                )
    return rows


# ------------------------------------------------------------------------------------------ main


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = jax.devices()[0]
    reduced = args.reduced or (args.reduced is None and dev.platform == "cpu")
    shapes = args.shapes or (["tiny"] if reduced else ["1b", "8b"])
    batches = args.batches or ([1, 4] if reduced else [1, 32, 128])
    context = args.context or (32 if reduced else 1024)
    steps = args.steps or (3 if reduced else 10)
    dtype = jnp.bfloat16
    peak = peak_gbps(dev.device_kind)
    print(
        f"device: {dev.device_kind} ({dev.platform}), {len(jax.devices())} device(s); peak "
        f"{'n/a' if peak is None else f'{peak:.0f} GB/s'}; jax {jax.__version__}; "
        f"{'reduced' if reduced else 'full'} run: context {context}, {steps} timed steps"
    )
    header = f"{'model':6} {'weights':7} {'kv':6} {'batch':>5} {'step ms':>9} {'tok/s':>10} {'MB/step':>9} {'GB/s':>8} {'% peak':>7}"
    print(header)
    budget = args.budget_s if args.budget_s is not None else (float("inf") if reduced else 450.0)
    deadline = time.perf_counter() + budget
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        cfg = SHAPES[shape]
        for quant in ("none", "int8"):
            label = "bf16" if quant == "none" else "int8"
            if time.perf_counter() > deadline:
                print(f"{shape:6} {label:7} skipped: time budget")
                continue
            model = random_model(cfg, dtype, quant)
            wbytes = weight_bytes(model)
            for attention in ("dense", "paged"):
                for batch in batches:
                    if time.perf_counter() > deadline:
                        print(f"{shape:6} {label:7} {attention:6} {batch:5} skipped: time budget")
                        continue
                    dec = make_decoder(model, attention, batch, context)
                    sec = time_decoder(model, dec, batch, steps)
                    moved = wbytes + dec.kv_bytes_read
                    gbps = moved / sec / 1e9
                    share = None if peak is None else gbps / peak
                    row = dict(
                        model=shape,
                        weights=label,
                        attention=attention,
                        batch=batch,
                        step_s=sec,
                        tokens_per_s=batch / sec,
                        weight_bytes=wbytes,
                        kv_bytes=dec.kv_bytes_read,
                        gbps=gbps,
                        peak_share=share,
                    )
                    rows.append(row)
                    print(
                        f"{shape:6} {label:7} {attention:6} {batch:5} {sec * 1e3:9.3f} {batch / sec:10.1f} "
                        f"{moved / 1e6:9.1f} {gbps:8.1f} {'n/a' if share is None else f'{100 * share:6.1f}%':>7}"
                    )
                    del dec
            del model
    checks = parity()
    for c in checks:
        print(
            f"greedy parity vs CPU reference: tiny {c['weights']:4} {c['attention']:5}: "
            f"{'ok' if c['ok'] else 'MISMATCH'} {c['got']}" + ("" if c["ok"] else f" want {c['want']}")
        )
    return {
        "device": dev.device_kind,
        "platform": dev.platform,
        "peak_gbps": peak,
        "rows": rows,
        "parity": checks,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reduced", action="store_true", default=None, help="tiny shapes (default on CPU)")
    p.add_argument("--full", dest="reduced", action="store_false", help="1B/8B shapes even on CPU")
    p.add_argument("--shapes", type=lambda s: s.split(","), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--context", type=int, help="KV positions each row reads (default 1024; reduced 32)")
    p.add_argument("--steps", type=int, help="timed steps per configuration (default 10; reduced 3)")
    p.add_argument(
        "--budget-s", type=float, help="skip what starts after this many seconds (default 450; reduced: none)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    return 0 if all(c["ok"] for c in result["parity"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
