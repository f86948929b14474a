"""Decode throughput with LoRA adapters: batch 32 with 0, 1 and 4 distinct adapters (rank 16), against the
same engine without an adapter bank.

    PYTHONPATH=service python benchmarks/lora.py [--model default] [--steps 32] [--dtype float32] [--json OUT]

One vEngine per case pair (no bank; bank), 32 prompts prefilled and inserted, then ``--steps`` decode steps
timed (tokens per second = 32 * steps / seconds). Adapters are random PEFT files written for the model's
shapes (no torch needed). Each row uses adapter ``row % k`` (k = 0: the base, every row -1).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np

from vsurge import EngineConfig, load_model, vEngine
from vsurge.contracts.sampling_params import SamplingParams
from vsurge.drivers.lora_adapters import LoraAdapters
from vsurge.models.lora import TARGETS, target_shape

BATCH, RANK, PROMPT = 32, 16, 16  # BATCH: --batch's default


def write_adapter(directory: str, cfg, seed: int) -> None:
    """A random rank-RANK PEFT adapter on every projection of ``cfg``'s model."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in TARGETS:
            din, dout = target_shape(cfg, module)
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = (0.02 * rng.standard_normal((RANK, din))).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((dout, RANK))).astype(np.float32)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(
            {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGETS)}, f
        )


def decode_rate(engine: vEngine, adapters: list[int], steps: int) -> float:
    """Tokens per second of ``steps`` decode steps over len(adapters) rows (row i on bank slot adapters[i])."""
    batch = len(adapters)
    state = engine.init_decode_state()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1)
    prompts = [[5 + (i + j) % 200 for j in range(PROMPT)] for i in range(batch)]
    per_call = engine.max_concurrent_prefill
    for at in range(0, batch, per_call):
        group = prompts[at : at + per_call]
        prefix = engine.prefill_many(group, [params] * len(group), None, adapters[at : at + per_call])
        for j in range(len(group)):
            state, _ = engine.insert(prefix, state, at + j, index=j)
    state, out = engine.decode(state)  # one untimed step
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out = engine.decode(state)
    jax.block_until_ready(out)
    return batch * steps / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=BATCH, help="rows decoding (4 for a smoke run)")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (bfloat16 on a TPU)")
    ap.add_argument("--json", help="also write the rates here")
    args = ap.parse_args(argv)
    model, tok = load_model(args.model, dtype=args.dtype)
    # decode_steps=1: decode_rate times the single decode step (no decode blocks to compile on a TPU)
    common = dict(
        max_concurrent_decodes=args.batch,
        max_length=128,
        prefill_lengths=(32,),
        max_concurrent_prefill=8,
        decode_steps=1,
    )
    results = {}
    base = vEngine(model, tok, config=EngineConfig(**common))
    base.compile()
    results["no bank"] = decode_rate(base, [-1] * args.batch, args.steps)
    del base
    engine = vEngine(
        model, tok, config=EngineConfig(**common, enable_lora=True, max_loras=4, max_lora_rank=RANK)
    )
    engine.compile()
    lora = LoraAdapters([engine])
    with tempfile.TemporaryDirectory() as d:
        for i in range(4):
            write_adapter(os.path.join(d, str(i)), engine.model_config, i)
            lora.add(f"a{i}", os.path.join(d, str(i)))
            lora.bank.write(i, lora._entries[f"a{i}"].weights)
    for k in (0, 1, 4):
        rows = [i % k if k else -1 for i in range(args.batch)]
        results[f"{k} adapters"] = decode_rate(engine, rows, args.steps)
    for name, rate in results.items():
        print(f"batch {args.batch}, {name:>10}: {rate:7.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    batch=args.batch,
                    rank=RANK,
                    dtype=args.dtype,
                    device=jax.devices()[0].device_kind,
                    rates=results,
                ),
                f,
            )


if __name__ == "__main__":
    main()
