"""The TPU benchmark's yardsticks on CPU with the tiny model (benchmarks/tpu_workloads.py): the parameters a
token is multiplied by (the embedding table only as a tied head), the measured matmul peak, the mixed
workload as arriving traffic (more requests than slots) through a real vSurge, and its limit estimate."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from tpu_workloads import ARRIVING, matmul_params, matmul_peak, mixed_limit, run_requests, workloads  # noqa: E402


def _hand_count(hidden, inter, layers, heads, kv_heads, head_dim, vocab, tied):
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return layers * per_layer + vocab * hidden  # the head (tied: the table itself, once)


@pytest.mark.parametrize("arch", ["llama", "tied"])
def test_matmul_params_leave_out_the_gathered_embedding_table(tiny_checkpoint, arch):
    import vsurge

    path, torch_model = tiny_checkpoint(arch)
    model, _ = vsurge.load_model(path)
    c = torch_model.config
    want = _hand_count(
        c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
        c.num_key_value_heads, c.head_dim, c.vocab_size, arch == "tied",
    )  # fmt: skip
    assert matmul_params(model) == want
    everything = sum(p.numel() for p in torch_model.parameters())
    # untied: the table and the head are both parameters, one is multiplied; tied: one tensor, multiplied
    assert (
        everything - matmul_params(model)
        == (c.vocab_size * c.hidden_size if arch == "llama" else 0)
        + (2 * c.num_hidden_layers + 1) * c.hidden_size
    )  # and the norms, which are elementwise


def test_matmul_peak_is_measured():
    peak = matmul_peak(256, "float32", repeats=2)
    assert 1e8 < peak < 1e13  # any CPU does 0.1 GFLOP/s; none does 10 TFLOP/s in float32


def test_mixed_is_arriving_traffic_and_its_limit_counts_every_output(tiny_checkpoint):
    fixed, mixed = workloads(vocab=320, batch=4, fixed_prompt=8, fixed_out=6, mixed_max_prompt=40)
    assert len(fixed[0]) == 4 and len(mixed[0]) == len(mixed[1]) == ARRIVING * 4
    prompts, outputs = mixed
    # full slots: the total output over 4 slots, or the longest output, whichever takes more steps
    steps = max(max(outputs), -(-sum(outputs) // 4))
    flops = 2.0 * 1000 * sum(len(p) for p in prompts)
    assert mixed_limit(0.01, prompts, outputs, 1000, 1e9, 4) == pytest.approx(steps * 0.01 + flops / 1e9)
    assert mixed_limit(0.01, prompts, outputs, 1000, 1e9, 1) > mixed_limit(
        0.01, prompts, outputs, 1000, 1e9, 4
    )

    import vsurge

    path, _ = tiny_checkpoint("llama")
    model, tok = vsurge.load_model(path)
    surge = vsurge.vSurge.create(
        model, tok, vsurge.EngineConfig(max_concurrent_decodes=4, max_length=192, prefill_lengths=(32, 64))
    )
    surge.compile()
    surge.start()
    try:  # the arriving workload, cut to fit the tiny model's outputs: 8 requests, 4 in flight
        short = [min(n, 12) for n in outputs]
        got = run_requests(surge, prompts, short, max_in_flight=4, deadline=time.perf_counter() + 120)
    finally:
        surge.stop()
    assert got["cancelled"] == 0 and got["tokens"] == sum(short) and len(got["ttfts"]) == ARRIVING * 4
