"""`vsurge serve` options: flags over VSURGE_* variables over defaults; bad values name their source."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vsurge.cli.main import SERVE_OPTIONS, ConfigError, parse_serve_config
from vsurge.server.tracing import provider_from_env, tracing_configured


def test_defaults():
    cfg = parse_serve_config([], {})
    assert cfg.model == "default" and cfg.port == 11556 and cfg.resolved_metrics_port == 11557
    assert cfg.engine.driver == "vdriver" and cfg.host == "0.0.0.0" and cfg.api_key is None
    assert cfg.model_name == "SmolLM2-135M-Instruct"


def test_every_option_reads_its_env_var():
    env = {
        "VSURGE_MODEL": "/models/llama/",
        "VSURGE_SERVED_MODEL_NAME": "llama",
        "VSURGE_DRIVER": "odriver",
        "VSURGE_MAX_CONCURRENT_DECODES": "16",
        "VSURGE_MAX_CONCURRENT_PREFILL": "4",
        "VSURGE_MAX_LENGTH": "4096",
        "VSURGE_PREFILL_LENGTHS": "512, 128,256",
        "VSURGE_PAGE_SIZE": "64",
        "VSURGE_HBM_UTILIZATION": "0.8",
        "VSURGE_MESH": "tp=4",
        "VSURGE_DTYPE": "bfloat16",
        "VSURGE_HOST": "127.0.0.1",
        "VSURGE_PORT": "9000",
        "VSURGE_METRICS_PORT": "-1",
        "VSURGE_API_KEY": "sekrit",
        "VSURGE_SSL_KEYFILE": "k.pem",
        "VSURGE_SSL_CERTFILE": "c.pem",
        "VSURGE_NUM_SPECULATIVE_TOKENS": "6",
    }
    cfg = parse_serve_config([], env)
    e = cfg.engine
    assert (cfg.model, cfg.served_model_name, e.driver) == ("/models/llama/", "llama", "odriver")
    assert (e.max_concurrent_decodes, e.max_length, e.prefill_lengths) == (16, 4096, (128, 256, 512))
    assert e.max_concurrent_prefill == 4
    assert (e.page_size, e.hbm_utilization, e.mesh, cfg.dtype) == (64, 0.8, "tp=4", "bfloat16")
    assert (cfg.host, cfg.port, cfg.resolved_metrics_port) == ("127.0.0.1", 9000, -1)
    assert (cfg.api_key, cfg.ssl_keyfile, cfg.ssl_certfile) == ("sekrit", "k.pem", "c.pem")
    assert cfg.engine.num_speculative_tokens == 6
    documented = {o.env for o in SERVE_OPTIONS}
    assert set(env) <= documented


def test_flag_beats_env_and_names():
    cfg = parse_serve_config(["--port", "8000", "--model", "/m/x.gguf"], {"VSURGE_PORT": "9000"})
    assert cfg.port == 8000 and cfg.resolved_metrics_port == 8001 and cfg.model_name == "x"
    assert parse_serve_config(["--model", "/m/dir/"], {}).model_name == "dir"


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"VSURGE_PORT": "abc"}, "VSURGE_PORT='abc': expected an integer"),
        ({"VSURGE_PORT": "70000"}, "VSURGE_PORT"),
        ({"VSURGE_DRIVER": "tdriver"}, "must be one of vdriver, odriver"),
        ({"VSURGE_HBM_UTILIZATION": "1.5"}, "VSURGE_HBM_UTILIZATION"),
        ({"VSURGE_PREFILL_LENGTHS": "128,x"}, "VSURGE_PREFILL_LENGTHS"),
        ({"VSURGE_MAX_LENGTH": "0"}, "must be >= 1"),
        ({"VSURGE_SSL_KEYFILE": "k.pem"}, "needs both"),
        ({"VSURGE_PORT": "9000", "VSURGE_METRICS_PORT": "9000"}, "equals --port"),
        ({"VSURGE_SPECULATIVE": "medusa"}, "VSURGE_SPECULATIVE"),
        ({"VSURGE_DRIVER": "odriver", "VSURGE_SPECULATIVE": "ngram"}, "runs on driver vdriver, not odriver"),
    ],
)
def test_bad_env_values_name_the_variable(env, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        parse_serve_config([], env)
    assert fragment in str(e.value)


def test_bad_flag_exits_with_usage(capsys):
    with pytest.raises(SystemExit):
        parse_serve_config(["--max-length", "-3"], {})
    assert "--max-length" in capsys.readouterr().err


def test_help_is_light():
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from vsurge.cli.main import main; main(['serve', '--help'])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "VSURGE_MAX_CONCURRENT_DECODES" in out.stdout
    mods = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, vsurge.cli.main; vsurge.cli.main.build_parser(); print('jax' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert mods.stdout.strip() == "False"


def test_tracing_is_off_unless_configured():
    assert not tracing_configured({})
    assert provider_from_env({}) is None
    assert not tracing_configured(
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}
    )
    assert not tracing_configured(
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}
    )
    assert tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"})
    provider = provider_from_env({"OTEL_TRACES_EXPORTER": "console"})
    try:
        assert provider.resource.attributes["service.name"] == "vsurge"
    finally:
        provider.shutdown()
    with pytest.raises(RuntimeError, match="unknown exporter"):
        provider_from_env({"OTEL_TRACES_EXPORTER": "zipkin2"})


@pytest.mark.parametrize("driver", ["vdriver", "odriver"])
def test_engine_options_reach_the_engine(tiny_dir, driver):
    import vsurge
    from vsurge.cli.main import build_surge

    flags = [
        "--driver",
        driver,
        "--max-concurrent-decodes=3",
        "--max-concurrent-prefill=5",
        "--max-length=96",
    ]
    cfg = parse_serve_config([*flags, "--prefill-lengths=16,32", "--page-size=16"], {})
    engine = build_surge(cfg, *vsurge.load_model(tiny_dir)).driver.engines[0]
    assert engine.max_concurrent_decodes == 3
    if driver == "vdriver":  # the paged engine schedules prefill chunks its own way
        assert engine.max_concurrent_prefill == 5
    assert (engine.max_length, engine.prefill_lengths) == (96, [16, 32])
    assert engine.speculator is None if driver == "vdriver" else not hasattr(engine, "speculator")


def test_speculative_flags_reach_the_engine(tiny_dir):
    import vsurge
    from vsurge.cli.main import build_surge

    flags = [
        "--speculative",
        "ngram",
        "--num-speculative-tokens",
        "2",
        "--max-length=96",
        "--prefill-lengths=16",
    ]
    surge = build_surge(parse_serve_config(flags, {}), *vsurge.load_model(tiny_dir))
    engine = surge.driver.engines[0]
    assert engine.speculator is not None and engine.speculator.k == 2
    assert surge.metrics().spec_decode_draft_tokens_total == 0


def test_kv_cache_prefill_and_decode_dtypes_reach_the_engine(tiny_dir):
    import jax
    import jax.numpy as jnp

    import vsurge
    from vsurge.cli.main import build_surge
    from vsurge.models.attention import KV_BITS

    flags = ["--kv-cache-dtype", "bfloat16", "--prefill-dtype", "bfloat16", "--decode-dtype", "bfloat16"]
    engine = build_surge(
        parse_serve_config(
            flags + ["--max-length=96", "--prefill-lengths=16", "--max-concurrent-decodes=8"], {}
        ),
        *vsurge.load_model(tiny_dir),
    )
    engine = engine.driver.engines[0]
    assert engine.cache_dtype == KV_BITS
    bf16 = jnp.dtype(jnp.bfloat16)
    assert bf16 in {a.dtype for a in jax.tree.leaves(engine.prefill_params)}
    assert bf16 in {a.dtype for a in jax.tree.leaves(engine.step_params(8))}
    assert bf16 not in {a.dtype for a in jax.tree.leaves(engine.step_params(4))}
    names = ("VSURGE_KV_CACHE_DTYPE", "VSURGE_PREFILL_DTYPE", "VSURGE_DECODE_DTYPE")
    env = parse_serve_config([], dict.fromkeys(names, "bfloat16"))
    assert env.engine.kv_cache_dtype == env.engine.prefill_dtype == env.engine.decode_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="prefill_dtype: bfloat16 is vdriver's packed prefill"):
        parse_serve_config(["--driver", "odriver", "--prefill-dtype", "bfloat16"], {})
    with pytest.raises(ConfigError, match="kv_cache_dtype: bfloat16 is vdriver's dense cache"):
        parse_serve_config(["--driver", "odriver", "--kv-cache-dtype", "bfloat16"], {})
    with pytest.raises(ConfigError, match="decode_dtype: bfloat16 is vdriver's decode step"):
        parse_serve_config(["--driver", "odriver", "--decode-dtype", "bfloat16"], {})


def test_tool_call_parser_reaches_the_server():
    from vsurge.cli.main import build_api
    from vsurge.server.tool_parsers import PARSERS

    help_text = next(o.help for o in SERVE_OPTIONS if o.env == "VSURGE_TOOL_CALL_PARSER")
    assert all(name in help_text for name in PARSERS)  # the help names every parser there is
    for name in PARSERS:
        cfg = parse_serve_config(["--tool-call-parser", name], {})
        assert build_api(cfg).tool_call_parser == name
    from_env = parse_serve_config([], {"VSURGE_TOOL_CALL_PARSER": "mistral"})
    assert build_api(from_env).tool_call_parser == "mistral"
    assert build_api(parse_serve_config([], {})).tool_call_parser is None  # read from the chat template
    with pytest.raises(ConfigError, match="VSURGE_TOOL_CALL_PARSER='pythonic'"):
        parse_serve_config([], {"VSURGE_TOOL_CALL_PARSER": "pythonic"})
