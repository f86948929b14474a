"""EngineConfig: one home for the engine knobs; `vsurge serve` derives its engine options from it; what the
operator puts on a pod is what `vsurge serve` and `load_model` accept."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import vsurge
from vsurge.cli.main import SERVE_OPTIONS, ConfigError, parse_serve_config
from vsurge.contracts.engine_config import (
    DEFAULT_SEED,
    REMOVED_KNOBS,
    EngineConfig,
    env_name,
    flag_name,
    serve_fields,
)
from vsurge.seed_api.args import seed_engine_config

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "helm" / "vsurge" / "crds" / "inferencemodels.vsurge.io.yaml"

# Contracts with the operator, the chart and users' scripts: these names never change (a new knob adds its
# own, which this list need not name).
ENGINE_FLAGS = {
    "--driver": "VSURGE_DRIVER",
    "--max-concurrent-decodes": "VSURGE_MAX_CONCURRENT_DECODES",
    "--max-concurrent-prefill": "VSURGE_MAX_CONCURRENT_PREFILL",
    "--max-length": "VSURGE_MAX_LENGTH",
    "--prefill-lengths": "VSURGE_PREFILL_LENGTHS",
    "--page-size": "VSURGE_PAGE_SIZE",
    "--hbm-utilization": "VSURGE_HBM_UTILIZATION",
    "--mesh": "VSURGE_MESH",
    "--seed": "VSURGE_SEED",
    "--attention": "VSURGE_ATTENTION",
    "--max-num-batched-tokens": "VSURGE_MAX_NUM_BATCHED_TOKENS",
    "--speculative": "VSURGE_SPECULATIVE",
    "--num-speculative-tokens": "VSURGE_NUM_SPECULATIVE_TOKENS",
    "--quantization": "VSURGE_QUANTIZATION",
    "--kv-cache-dtype": "VSURGE_KV_CACHE_DTYPE",
    "--prefill-dtype": "VSURGE_PREFILL_DTYPE",
    "--decode-dtype": "VSURGE_DECODE_DTYPE",
    "--decode-steps": "VSURGE_DECODE_STEPS",
}


# ---------------------------------------------------------------------------------------- the dataclass


def test_exported_and_frozen():
    assert vsurge.EngineConfig is EngineConfig
    cfg = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 64  # type: ignore[misc]
    assert cfg.replace(page_size=64).page_size == 64 and cfg.page_size == 128


def test_defaults_are_the_seeds():
    cfg = EngineConfig()
    assert cfg.seed == DEFAULT_SEED == 894
    assert (cfg.driver, cfg.max_concurrent_decodes, cfg.page_size, cfg.hbm_utilization) == (
        "vdriver",
        16,
        128,
        0.6,
    )
    assert (cfg.max_queue_size, cfg.min_decode_tokens, cfg.enable_prefix_caching) == (1024, 128, True)
    assert cfg.max_length is None and cfg.prefill_lengths is None and cfg.kv_cache_bytes is None
    assert cfg.resolved("max_concurrent_prefill") == 64
    assert cfg.replace(driver="odriver").resolved("max_concurrent_prefill") == 1


def test_none_means_the_default_and_lengths_are_normalized():
    cfg = EngineConfig(seed=None, page_size=None, prefill_lengths=[512, 128, 128, 256])
    assert (cfg.seed, cfg.page_size, cfg.prefill_lengths) == (894, 128, (128, 256, 512))


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"page_size": 0}, "page_size: must be >= 1, got 0"),
        ({"max_concurrent_decodes": 2.5}, "max_concurrent_decodes: expected an integer"),
        ({"hbm_utilization": 1.5}, "hbm_utilization: must be in (0, 1], got 1.5"),
        ({"driver": "tdriver"}, "driver: must be one of vdriver, odriver"),
        ({"prefill_lengths": [16, 0]}, "prefill_lengths: must be >= 1"),
        ({"prefill_lengths": []}, "prefill_lengths: expected at least one length"),
        ({"max_prefill_length": 512, "max_length": 256}, "max_prefill_length 512 exceeds max_length 256"),
        ({"mesh": " "}, "mesh: expected a mesh spec"),
        ({"speculative": "eagle"}, "speculative: must be one of none, ngram"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens: must be >= 1, got 0"),
        ({"driver": "odriver", "speculative": "ngram"}, "speculative: ngram decoding runs on driver vdriver"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype: must be one of auto, bfloat16"),
        ({"driver": "odriver", "kv_cache_dtype": "bfloat16"}, "kv_cache_dtype: bfloat16 is vdriver's"),
        ({"prefill_dtype": "float16"}, "prefill_dtype: must be one of auto, bfloat16"),
        ({"driver": "odriver", "prefill_dtype": "bfloat16"}, "prefill_dtype: bfloat16 is vdriver's"),
        ({"decode_dtype": "float16"}, "decode_dtype: must be one of auto, bfloat16"),
        (
            {"driver": "odriver", "decode_dtype": "bfloat16"},
            "decode_dtype: bfloat16 is vdriver's decode step",
        ),
    ],
)
def test_bad_values_name_the_field(changes, fragment):
    with pytest.raises(ValueError) as e:
        EngineConfig(**changes)
    assert fragment in str(e.value)


@pytest.mark.parametrize("driver", ["vdriver", "odriver"])
def test_lora_is_accepted_with_prefill_inside_the_decode_steps(driver):
    """vdriver's mixed steps carry each row's and each chunk's adapter (issue 35): it was refused before,
    as odriver's never was."""
    cfg = EngineConfig(driver=driver, enable_lora=True, max_num_batched_tokens=64)
    assert (cfg.enable_lora, cfg.max_num_batched_tokens) == (True, 64)
    assert EngineConfig(driver=driver, max_num_batched_tokens=64).replace(enable_lora=True).enable_lora


def test_build_applies_keywords_over_a_config():
    base = EngineConfig(max_length=256, page_size=64)
    cfg = EngineConfig.build(base, seed=7, page_size=32)
    assert (cfg.max_length, cfg.page_size, cfg.seed) == (256, 32, 7)
    assert EngineConfig.build(None) == EngineConfig()
    with pytest.raises(TypeError, match="unknown engine option.*max_lenght"):
        EngineConfig.build(None, max_lenght=3)
    with pytest.raises(TypeError, match="expected an EngineConfig"):
        EngineConfig.build(32)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- vsurge serve


def test_serve_engine_options_come_from_the_config():
    by_flag = {o.flag: o for o in SERVE_OPTIONS}
    assert ENGINE_FLAGS.items() <= {flag_name(f): env_name(f) for f in serve_fields()}.items()
    for f in serve_fields():
        opt = by_flag[flag_name(f)]
        assert opt.env == env_name(f) and opt.default == f.default and opt.help == f.metadata["help"]
    flags = [o.flag for o in SERVE_OPTIONS]
    assert len(flags) == len(set(flags)) and len({o.env for o in SERVE_OPTIONS}) == len(flags)


def test_serve_config_carries_an_engine_config():
    cfg = parse_serve_config(["--page-size", "64", "--seed", "3"], {"VSURGE_PREFILL_LENGTHS": "256,128"})
    assert cfg.engine == EngineConfig(page_size=64, seed=3, prefill_lengths=(128, 256))
    assert not hasattr(cfg, "page_size")  # one place for an engine knob: cfg.engine
    assert parse_serve_config([], {}).engine == EngineConfig()
    with pytest.raises(ConfigError, match="VSURGE_PAGE_SIZE='0': must be >= 1"):
        parse_serve_config([], {"VSURGE_PAGE_SIZE": "0"})


def test_help_shows_the_engine_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_serve_config(["--help"], {})
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "(default: sized from the device's memory (vsurge/cli/sizing.py; 16 from Python)) [env VSURGE_MAX_CONCURRENT_DECODES]"
        in out
    )
    assert "(default: 894) [env VSURGE_SEED]" in out


# ---------------------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama", heads=8, kv_heads=4)
    return vsurge.load_model(path)


def test_engines_take_a_config_and_keywords(tiny):
    from vsurge import vSurge
    from vsurge.engines.paged.paging import bytes_per_page

    model, tok = tiny
    cfg = EngineConfig(max_concurrent_decodes=3, max_length=96, prefill_lengths=(16, 32), seed=5)
    v = vSurge.create_vdriver(model, tok, cfg, max_concurrent_prefill=2).driver.engines[0]
    assert (v.max_concurrent_decodes, v.max_concurrent_prefill, v.max_length) == (3, 2, 96)
    assert v.prefill_lengths == [16, 32] and v.engine_config.seed == 5
    assert v.engine_config.driver == "vdriver"

    per_page = bytes_per_page(model.config, 8, model.dtype)
    o = vSurge.create(
        model,
        tok,
        cfg.replace(driver="odriver", page_size=8, kv_cache_bytes=40 * per_page, min_decode_tokens=32),
    )
    e = o.driver.engines[0]
    assert type(e).__name__ == "oEngine" and (e.page_size, e.max_length, e.max_concurrent_prefill) == (
        8,
        96,
        1,
    )
    assert e.manager.num_pages == 39  # one page of the 40 is the null page
    with pytest.raises(TypeError, match="unknown engine option"):
        vSurge.create_vdriver(model, tok, max_lenght=3)


# ---------------------------------------------------------------------------------------- operator contracts


def _pod_env_names() -> dict[str, str]:
    """{name: value} of every VSURGE_* variable the operator puts on any container of any pod it builds,
    for specs that set every engine field, credentials and tracing (CPU, one-host and multi-host TPU)."""
    from vsurge_operator import engine_options, manifests, spec

    chosen = {
        "driver": "odriver",
        "prefill_lengths": (128, 256),
        "hbm_utilization": 0.5,
        "dtype": "bfloat16",
        "mesh": "tp=4",
        "quantization": "int8",
        "num_speculative_tokens": 8,
    }
    full_engine: dict[str, Any] = {}
    for o in engine_options.OPTIONS:
        # this spec runs odriver: a vdriver-only option at its idle value (ngram, bfloat16 are vdriver's)
        fallback = o.idle[0] if o.only else o.choices[0] if o.choices and 64 not in o.choices else 64
        full_engine[o.field] = chosen.get(o.field, fallback)
    engine = spec.EngineSpec(**full_engine)

    def body(**s: Any) -> dict[str, Any]:
        s = {"model": {"source": "hf://org/name", "credentialsSecret": "creds"}, "image": "img:1", **s}
        s["tracing"] = {"endpoint": "http://otel:4317"}
        return {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1}, "spec": s}

    models = [
        spec.parse(body()),
        spec.parse(body(tpu={"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"})),
        spec.parse(body(tpu={"accelerator": "tpu-v6e-slice", "topology": "4x4"})),
    ]
    out: dict[str, str] = {}
    for m in models:
        m = dataclasses.replace(m, engine=engine)
        for obj in manifests.desired_objects(m):
            for container in _containers(obj):
                for e in container.get("env", []):
                    if e["name"].startswith("VSURGE_"):
                        out[e["name"]] = e.get("value", "")
    return out


def _containers(obj: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                found += v
            else:
                found += _containers(v)
    elif isinstance(obj, list):
        for v in obj:
            found += _containers(v)
    return found


# Read by the model-source layer under `vsurge serve` (not flags: they configure where bytes live).
SOURCE_ENV = {
    "VSURGE_CACHE_DIR": "vsurge.models.default_model",
    "VSURGE_CREDENTIALS_DIR": "vsurge.models.sources.gcs",
    # a multi-host group's step-lane secret: a file, never a flag
    "VSURGE_LANE_SECRET_FILE": "vsurge.multihost.channel",
}


def test_every_vsurge_variable_on_a_pod_is_read_by_vsurge_serve(monkeypatch, tmp_path):
    import importlib
    import inspect

    pod = _pod_env_names()
    options = {o.env for o in SERVE_OPTIONS}
    engine_spec_vars = {n for n in pod if n not in SOURCE_ENV}
    assert engine_spec_vars <= options, (
        f"the operator sets variables vsurge serve ignores: {engine_spec_vars - options}"
    )
    # and what the operator writes there parses, once Kubernetes has expanded $(VAR) references
    # (the multi-host pods take their process group from the LeaderWorkerSet's variables)
    lws = {"LWS_LEADER_ADDRESS": "m-0.m.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}

    def expand(value: str) -> str:
        return re.sub(r"\$\((\w+)\)", lambda m: lws.get(m.group(1), pod.get(m.group(1), m.group(0))), value)

    cfg = parse_serve_config([], {n: expand(pod[n]) for n in engine_spec_vars})
    e = cfg.engine
    assert (e.driver, e.page_size, e.prefill_lengths, e.mesh) == ("odriver", 64, (128, 256), "tp=4")
    assert cfg.engine.max_concurrent_decodes == 64 and cfg.dtype == "bfloat16"
    assert cfg.engine.quantization == "int8"
    assert (cfg.engine.speculative, cfg.engine.num_speculative_tokens) == ("none", 8)
    assert cfg.engine.kv_cache_dtype == cfg.engine.prefill_dtype == cfg.engine.decode_dtype == "auto"
    for name in set(pod) & set(SOURCE_ENV):
        assert f'"{name}"' in inspect.getsource(importlib.import_module(SOURCE_ENV[name])), name
    from vsurge.models import default_model

    monkeypatch.setenv("VSURGE_CACHE_DIR", str(tmp_path))
    assert Path(default_model.cache_dir()) == tmp_path


def _crd_source_pattern() -> str:
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["spec"]["properties"]["model"]["properties"]["source"]["pattern"]


EXAMPLE = {
    "hf": "hf://org/name@main",
    "gs": "gs://bucket/models/llama",
    "s3": "s3://bucket/models/llama",
    "pvc": "pvc://weights/llama-3/8b",
}


def test_every_model_source_scheme_the_crd_accepts_is_one_load_model_opens(monkeypatch):
    from vsurge.models import loader, sources

    pattern = _crd_source_pattern()
    schemes = set(re.findall(r"([a-z0-9]+)://", pattern))
    assert schemes == set(EXAMPLE), f"a CRD scheme without an example here: {schemes ^ set(EXAMPLE)}"
    assert schemes <= {*sources.REMOTE_SCHEMES, "pvc"}

    class Resolved(Exception):
        pass

    def resolve(source: str) -> str:
        raise Resolved(source)

    monkeypatch.setattr(sources, "resolve", resolve)
    for source in EXAMPLE.values():
        assert re.fullmatch(pattern, source), source
        with pytest.raises(Resolved, match=re.escape(source)):
            loader.load_model(source)  # fetched (or mounted) through models.sources, then loaded
    # the other alternatives: the default model and an absolute local path (what pvc:// becomes on a pod)
    assert re.fullmatch(pattern, "default") and re.fullmatch(pattern, "/models/llama")
    with pytest.raises(Exception, match="no such file"):
        loader.load_model("/nonexistent/model-dir")


@pytest.mark.parametrize("name", ["max_decode_stall", "batch_size"])
def test_a_removed_knob_is_refused_saying_why(name):
    # they did nothing (issue 31): giving one is an error naming it and the reason, wherever it is given
    why = REMOVED_KNOBS[name].split(":")[0]
    with pytest.raises(ValueError, match=f"^{name}: {why}"):
        EngineConfig(**{name: 1})
    with pytest.raises(ValueError, match=f"^{name}: {why}"):
        EngineConfig().replace(**{name: 1})
    with pytest.raises(ValueError, match=f"^{name}: {why}"):
        seed_engine_config(None, "vdriver", {}, {name: 1})
    assert name not in {f.name for f in dataclasses.fields(EngineConfig)}  # nothing lists or serves it
    assert EngineConfig(**{name: None}) == EngineConfig()  # "not given" stays fine


def test_the_seed_batch_size_is_the_decode_batch():
    assert seed_engine_config(None, "vdriver", {"batch_size": 4}, {}).max_concurrent_decodes == 4
    same = {"batch_size": 4, "max_concurrent_decodes": 4}
    assert seed_engine_config(None, "odriver", same, {}).max_concurrent_decodes == 4
    with pytest.raises(ValueError, match="batch_size 4 and max_concurrent_decodes 8"):
        seed_engine_config(None, "vdriver", {"batch_size": 4}, {"max_concurrent_decodes": 8})


# ---------------------------------------------------------------------------------------- the CRD and the operator
# Both are generated from EngineConfig's serve fields (tools/docgen/engine_crd.py, run by tools/gen_docs.py):
# the operator cannot import vsurge, so what it offers is checked in and compared here.


def _gen_docs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _crd_engine() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "engine"
    ]


def test_the_crd_and_the_operator_table_are_generated_from_engine_config():
    gen_docs = _gen_docs()
    stale = {p: (text, fresh) for p, (text, fresh) in gen_docs.fresh_code().items() if text != fresh}
    assert not stale, "\n".join(
        f"{gen_docs._diff(p, text, fresh)}\n{p.relative_to(REPO)} is out of date: run `python tools/gen_docs.py`"
        for p, (text, fresh) in stale.items()
    )
    # and the YAML reads back as the schema the generator meant
    engine_crd = gen_docs.engine_crd
    assert _crd_engine() == engine_crd.engine_schema(engine_crd.options(), EngineConfig().driver)


def test_every_serve_knob_is_reachable_from_an_inference_model():
    from vsurge_operator import engine_options

    engine_crd = _gen_docs().engine_crd
    assert set(engine_crd.NOT_IN_CRD) <= {f.name for f in serve_fields()}, "NOT_IN_CRD names no serve knob"
    props = _crd_engine()["properties"]
    table = {o.key: o for o in engine_options.OPTIONS}
    for f in serve_fields():
        if f.name in engine_crd.NOT_IN_CRD:
            continue
        key = engine_crd.camel(f.name)
        assert key in props and table[key].field == f.name and table[key].env == env_name(f), f.name


def test_a_new_knob_is_reported_until_regenerated():
    """A knob added to EngineConfig and not regenerated: the check names both files and shows the new key,
    its variable and its driver rule."""
    from vsurge.contracts.engine_config import DriverOnly, at_least, knob
    from vsurge.contracts.env_options import parse_int

    @dataclasses.dataclass(frozen=True)
    class WithKnob(EngineConfig):
        prefill_budget: int = knob(
            8,
            "a knob nobody generated",
            check=at_least(2),
            serve=True,
            text=parse_int,
            only=DriverOnly((8,), "budget"),
        )

    gen_docs = _gen_docs()
    fields = [f for f in dataclasses.fields(WithKnob) if f.metadata.get("serve")]
    stale = gen_docs.stale(fields=fields)
    crd, table = CRD, REPO / "operator" / "vsurge_operator" / "engine_options.py"
    assert set(stale) >= {crd, table}, sorted(map(str, stale))
    assert "+                    prefillBudget:" in stale[crd]
    assert "+                      minimum: 2" in stale[crd]
    assert "message: prefillBudget applies to driver vdriver's budget" in stale[crd]
    assert (
        '+        key="prefillBudget",' in stale[table]
        and '+        env="VSURGE_PREFILL_BUDGET",' in stale[table]
    )
    assert not gen_docs.stale(fields=serve_fields()).keys() & {crd, table}  # the real fields: current


def _sample(o: Any) -> Any:
    """A valid value of spec.engine option ``o`` other than its idle one."""
    if o.choices:
        return o.choices[-1]
    low = 1 if o.minimum is None else o.minimum
    return {
        "integer": low + 1 if o.maximum is None or low + 1 <= o.maximum else low,
        "number": 0.5,
        "integers": [low, 2 * low],
        "string": "tp=1",
    }[o.kind]


def test_every_option_reaches_vsurge_serve_as_set():
    """Each variable option of spec.engine, set alone: the CRD and the operator accept it, the pod's variable
    parses in `vsurge serve` to the value the spec gave."""
    import jsonschema

    from vsurge_operator import crd, engine_options, manifests, spec, validation

    validator = jsonschema.Draft4Validator(crd.openapi_schema(crd.load_crd()))
    for o in engine_options.OPTIONS:
        if o.env is None:
            continue  # passed as a flag (the LoRA bank): adapters.args
        value = _sample(o)
        body = {
            "apiVersion": "vsurge.io/v1alpha1",
            "kind": "InferenceModel",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"model": {"source": "default"}, "image": "img:1", "engine": {o.key: value}},
        }
        validator.validate(body)
        assert validation.validate(body) == [], o.key
        pod_env = {k: v for k, v in manifests.engine_env(spec.parse(body))}
        assert o.env in pod_env, o.key
        cfg = parse_serve_config([], pod_env)
        got = getattr(cfg.engine, o.field) if hasattr(cfg.engine, o.field) else getattr(cfg, o.field)
        assert got == (tuple(value) if isinstance(value, list) else value), o.key


def test_the_crd_mesh_takes_exactly_the_engines_axes():
    """A mesh the CRD admits must be one `vsurge serve --mesh` parses, or the pod fails at start."""
    from vsurge.models import sharding
    from vsurge_operator import validation

    assert set(validation.MESH_AXES) == set(sharding.AXES)
    mesh = _crd_engine()["properties"]["mesh"]
    for spec in ("tp=8", "dp=2,tp=4", "fsdp=2", "tp=2,sp=2"):
        admitted = re.fullmatch(mesh["pattern"], spec) is not None
        try:
            sharding.parse_mesh_spec(spec)
            parsed = True
        except ValueError:
            parsed = False
        assert admitted == parsed, spec
