"""`vsurge serve`'s default slots and context from the device's memory (vsurge/cli/sizing.py): numbers in,
slots and context out, for the chips and models issue 52 measured; and `--print-config` showing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vsurge.cli.sizing import Sizing, estimate_weights_bytes, kv_bytes_per_token, size, slot_cap
from vsurge.contracts.engine_config import EngineConfig

GIB = 1 << 30
V5E = 16 * GIB
# Llama-3.2-1B (head_dim 64): 16 layers, 8 KV heads; Llama-3.1-8B: 32 layers, 8 KV heads of 128
KV_1B = kv_bytes_per_token(type("C", (), dict(num_layers=16, num_kv_heads=8, head_dim=64))(), 2)
KV_8B = kv_bytes_per_token(type("C", (), dict(num_layers=32, num_kv_heads=8, head_dim=128))(), 2)


def test_caps_by_backend_and_cores():
    assert slot_cap("tpu", 1) == 128 and slot_cap("gpu", 8) == 256
    assert slot_cap("cpu", 2) == 16 and slot_cap("cpu", 1) == 8 and slot_cap("cpu", 8) == 64


def test_1b_on_one_v5e_gets_most_of_the_cap_at_full_context():
    s = size(
        backend="tpu", memory_bytes=V5E, weights_bytes=int(2.5 * GIB), kv_bytes_per_token=KV_1B,
        max_position=131072, fraction=0.6,
    )  # fmt: skip
    assert KV_1B == 32 * 1024
    assert s.context == 2048  # the model's 131072, capped
    # 0.6 x 13.5 GiB / (2048 x 32 KiB) = 129.6 rows -> the cap
    assert s.slots == 128 and "the cap (129 rows of 2048" in s.why
    assert s.budget_bytes == int(0.6 * 13.5 * GIB)


def test_8b_int8_halves_its_context_to_keep_a_quarter_of_the_cap():
    s = size(
        backend="tpu", memory_bytes=V5E, weights_bytes=int(8.6 * GIB), kv_bytes_per_token=KV_8B,
        max_position=131072, fraction=0.6,
    )  # fmt: skip
    # at 2048: 0.6 x 7.4 GiB / 256 MiB = 17 rows -> 16, under 32 = cap/4; at 1024: 35 -> 32
    assert (s.slots, s.context) == (32, 1024) and "halved" in s.why and "17 rows of 2048" in s.why
    # a bigger share of the memory buys the full context back
    s = size(
        backend="tpu", memory_bytes=V5E, weights_bytes=int(8.6 * GIB), kv_bytes_per_token=KV_8B,
        max_position=131072, fraction=1.0,
    )  # fmt: skip
    assert (s.slots, s.context) == (56, 1024)  # 29 rows at 2048 (24 < 32): halved once, 59 -> 56


def test_the_default_model_on_a_2_core_cpu_keeps_todays_16_slots_and_2048():
    # SmolLM2-135M in float32: 30 layers x 3 KV heads x 64 x 4 bytes x 2 = 45 KiB per slot-token
    kv = kv_bytes_per_token(type("C", (), dict(num_layers=30, num_kv_heads=3, head_dim=64))(), 4)
    s = size(
        backend="cpu", memory_bytes=8 * GIB, weights_bytes=540 << 20, kv_bytes_per_token=kv,
        max_position=8192, fraction=0.6, cores=2,
    )  # fmt: skip
    assert (s.slots, s.context) == (16, 2048)
    # a small box: what fits, in multiples of 8
    s = size(
        backend="cpu", memory_bytes=2 * GIB, weights_bytes=540 << 20, kv_bytes_per_token=kv,
        max_position=8192, fraction=0.6, cores=2,
    )  # fmt: skip
    assert s.slots == 8 and s.context == 2048


def test_a_set_value_is_kept_and_the_other_sized_around_it():
    kw = dict(backend="tpu", memory_bytes=V5E, weights_bytes=int(2.5 * GIB), kv_bytes_per_token=KV_1B,
              max_position=131072, fraction=0.6)  # fmt: skip
    s = size(slots=64, context=1024, **kw)
    assert (s.slots, s.context, s.why) == (64, 1024, "both set")
    s = size(context=8192, **kw)  # 0.6 x 13.5 GiB / (8192 x 32 KiB) = 32.4
    assert (s.slots, s.context) == (32, 8192)
    s = size(slots=512, **kw)  # 0.6 x 13.5 GiB / (512 x 32 KiB) = 518 tokens -> 512
    assert (s.slots, s.context) == (512, 512)
    s = size(slots=16, **kw)
    assert s.context == 2048  # never past the model's (capped) context


def test_no_room_still_gives_one_slot_and_the_description_names_the_numbers():
    s = size(backend="tpu", memory_bytes=V5E, weights_bytes=V5E, kv_bytes_per_token=KV_8B,
             max_position=4096, fraction=0.9)  # fmt: skip
    assert s.slots == 1 and s.context == 512
    text = Sizing(
        16, 2048, "cpu", 8 * GIB, GIB, 46080, 0.6, 16, 8192, "the model's context, capped"
    ).describe()
    for part in ("memory 8.0 GiB", "weights 1.00 GiB", "x 0.6", "45.0 KiB per slot-token", "cap 16 slots"):
        assert part in text, text


def test_weights_estimate_from_the_config_matches_the_1b_parameter_count():
    cfg = type("C", (), dict(hidden_size=2048, intermediate_size=8192, vocab_size=128256, num_layers=16,
                             num_heads=32, num_kv_heads=8, head_dim=64, tie_word_embeddings=True))()  # fmt: skip
    assert estimate_weights_bytes(cfg, 1) == pytest.approx(1.236e9, rel=0.01)  # Llama-3.2-1B: 1.24B
    assert estimate_weights_bytes(cfg, 2, int8=True) < estimate_weights_bytes(cfg, 2)


def test_print_config_on_cpu_shows_the_sizing(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import make_checkpoint

    make_checkpoint(tmp_path, "llama", seed=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VSURGE_")}
    env.update(JAX_PLATFORMS="cpu")
    run = [sys.executable, "-m", "vsurge.cli", "serve", "--model", str(tmp_path), "--print-config"]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    ctx = min(json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"], 2048)
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert "[sized]" in lines["max_concurrent_decodes"] and "[sized]" in lines["max_length"], text
    assert lines["max_length"].split()[1] == str(ctx)
    assert "sizing" in text and "GiB" in text and "KiB per slot-token" in text and "cap" in text, text
    # a value given is kept, and says so
    out = subprocess.run([*run, "--max-concurrent-decodes", "4"], env=env, capture_output=True, text=True)
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert lines["max_concurrent_decodes"].split()[1] == "4" and "[set]" in lines["max_concurrent_decodes"]


def test_the_knobs_sizing_keeps_are_those_given():
    from vsurge.cli.serve_options import ServeConfig, parse_serve_config

    assert parse_serve_config([], {}).set_knobs == frozenset()
    cfg = parse_serve_config(["--max-length", "512"], {"VSURGE_MAX_CONCURRENT_DECODES": "16"})
    assert cfg.set_knobs == {"max_length", "max_concurrent_decodes"}  # 16 given is kept, though the default
    built = ServeConfig(engine=EngineConfig(max_concurrent_decodes=4))  # in Python: what differs
    assert built.set_knobs == {"max_concurrent_decodes"}
