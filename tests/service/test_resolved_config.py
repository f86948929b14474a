"""The resolved engine configuration: backend defaults, where each value came from, `--print-config`."""

import json

from vsurge.cli.main import main
from vsurge.contracts.engine_config import EngineConfig
from vsurge.engines.resolved_config import resolve
from vsurge.models.config import ModelConfig


def _by_name(rows):
    return {r.name: r for r in rows}


def _hd64() -> ModelConfig:
    return ModelConfig.from_hf(
        dict(
            model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        )
    )  # fmt: skip


def test_tpu_defaults_are_resolved_with_their_reasons():
    tpu = _by_name(resolve(EngineConfig(max_concurrent_decodes=64), "tpu", _hd64()))
    cpu = _by_name(resolve(EngineConfig(max_concurrent_decodes=64), "cpu", _hd64()))
    assert tpu["decode_steps"].value == 4 and tpu["decode_steps"].source == "backend"
    assert cpu["decode_steps"].value == 1
    assert tpu["decode row buckets"].value == [8, 32, 64]
    assert cpu["decode row buckets"].value == [1, 2, 4, 8, 16, 32, 64]
    assert "flat rows" in tpu["attention path"].value and "per-head" in cpu["attention path"].value
    assert tpu["driver"].value == "vdriver" and "measured" in tpu["driver"].why


def test_paged_on_tpu_takes_the_kernel_with_head_dim_64_padded():
    rows = _by_name(resolve(EngineConfig(driver="odriver"), "tpu", _hd64()))
    assert rows["attention path"].value.startswith("paged, Pallas ragged kernel")
    assert "padded to 128" in rows["attention path"].value
    assert rows["decode_steps"].value == 1  # blocks are vdriver's
    assert _by_name(resolve(EngineConfig(driver="odriver", attention="jax"), "tpu"))[
        "attention path"
    ].value == ("paged, pure JAX")


def test_explicit_knobs_say_so_and_speculation_keeps_single_steps():
    rows = _by_name(resolve(EngineConfig(speculative="ngram", decode_steps=None, max_length=512), "tpu"))
    assert rows["max_length"].source == "set" and rows["max_length"].value == 512
    assert rows["decode_steps"].value == 1 and "n-gram" in rows["decode_steps"].why
    rows = _by_name(resolve(EngineConfig(decode_steps=8), "cpu"))
    assert rows["decode_steps"].value == 8 and rows["decode_steps"].source == "set"


def test_print_config_prints_the_resolved_knobs_and_exits(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
            )
        )
    )  # fmt: skip
    assert main(["serve", "--model", str(tmp_path), "--decode-steps", "2", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "backend cpu" in out
    line = next(x for x in out.splitlines() if x.startswith("decode_steps"))
    assert " 2 " in line and "[set]" in line
    assert "attention path" in out


def test_tpu_compiles_fewer_shapes():
    from vsurge.engines.engine_base import default_prefill_lengths, row_buckets

    assert default_prefill_lengths(1024, "tpu") == [128, 256, 512, 1024]
    assert default_prefill_lengths(1024, "cpu") == [32, 64, 128, 192, 256, 384, 512, 768, 1024]
    assert default_prefill_lengths(300, "cpu") == [32, 64, 128, 192, 256, 300]
    assert default_prefill_lengths(100, "cpu") == [32, 64, 100]
    assert row_buckets(256, 1, "tpu") == [8, 32, 128, 256] and row_buckets(4, 1, "tpu") == [4]
