"""GPU placement (spec.gpu), int8 weights (spec.engine.quantization), speculative decoding
(spec.engine.speculative, numSpeculativeTokens), the KV cache, prefill and decode dtypes
(spec.engine.kvCacheDtype, prefillDtype, decodeDtype): CRD
schema, validation, manifests, and the pod's environment as `vsurge serve` reads it."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from kubernetes_validate import utils as kv

from vsurge_operator import crd, engine_options, gpu, manifests, spec, validation

SCHEMA = crd.openapi_schema(crd.load_crd())
SPEC = SCHEMA["properties"]["spec"]
VALIDATOR = jsonschema.Draft4Validator(SCHEMA)


def body(**fields: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"model": {"source": "default"}, "image": "img:1-cuda"}
    s.update(fields)
    return {
        "apiVersion": "vsurge.io/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "llama", "namespace": "team", "uid": "u", "generation": 1},
        "spec": s,
    }


def env(m: spec.ModelSpec) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in manifests.env(m)}


def test_schema_matches_the_operator():
    props = SPEC["properties"]
    from vsurge.contracts.engine_config import QUANTIZATIONS

    # the CRD and the operator offer what vsurge serve accepts
    assert tuple(props["engine"]["properties"]["quantization"]["enum"]) == QUANTIZATIONS
    assert engine_options.BY_KEY["quantization"].choices == QUANTIZATIONS
    assert props["gpu"]["properties"]["type"]["pattern"] == validation.GPU_TYPE_PATTERN
    assert props["gpu"]["required"] == ["count"]
    rules = {r["rule"] for r in SPEC["x-kubernetes-validations"]}
    assert "!has(self.tpu) || !has(self.gpu)" in rules


def test_quantization_reaches_the_pod_and_vsurge_serve():
    from vsurge.cli.main import parse_serve_config

    b = body(engine={"quantization": "int8", "driver": "odriver"})
    VALIDATOR.validate(b)
    assert validation.validate(b) == []
    m = spec.parse(b)
    assert m.engine.quantization == "int8"
    values = env(m)
    assert values["VSURGE_QUANTIZATION"] == "int8"
    pod_env = {k: v for k, v in values.items() if k.startswith("VSURGE_") and v is not None}
    cfg = parse_serve_config([], pod_env)
    assert cfg.engine.quantization == "int8" and cfg.engine.driver == "odriver"
    assert "VSURGE_QUANTIZATION" not in env(spec.parse(body()))  # unset: the server's default (none)


def test_speculative_decoding_reaches_the_pod_and_vsurge_serve():
    from vsurge.cli.main import parse_serve_config
    from vsurge.contracts.engine_config import SPECULATIVE_METHODS

    assert tuple(SPEC["properties"]["engine"]["properties"]["speculative"]["enum"]) == SPECULATIVE_METHODS
    assert engine_options.BY_KEY["speculative"].choices == SPECULATIVE_METHODS
    b = body(engine={"speculative": "ngram", "numSpeculativeTokens": 6})
    VALIDATOR.validate(b)
    assert validation.validate(b) == []
    values = env(spec.parse(b))
    assert (values["VSURGE_SPECULATIVE"], values["VSURGE_NUM_SPECULATIVE_TOKENS"]) == ("ngram", "6")
    cfg = parse_serve_config(
        [], {k: v for k, v in values.items() if k.startswith("VSURGE_") and v is not None}
    )
    assert (cfg.engine.speculative, cfg.engine.num_speculative_tokens) == ("ngram", 6)
    unset = env(spec.parse(body()))
    assert "VSURGE_SPECULATIVE" not in unset and "VSURGE_NUM_SPECULATIVE_TOKENS" not in unset


def test_kv_cache_prefill_and_decode_dtypes_reach_the_pod_and_vsurge_serve():
    from vsurge.cli.main import parse_serve_config
    from vsurge.contracts.engine_config import DECODE_DTYPES, KV_CACHE_DTYPES, PREFILL_DTYPES

    engine = SPEC["properties"]["engine"]["properties"]
    for key, choices in (
        ("kvCacheDtype", KV_CACHE_DTYPES),
        ("prefillDtype", PREFILL_DTYPES),
        ("decodeDtype", DECODE_DTYPES),
    ):
        assert tuple(engine[key]["enum"]) == choices == engine_options.BY_KEY[key].choices
    b = body(engine={"kvCacheDtype": "bfloat16", "prefillDtype": "bfloat16", "decodeDtype": "bfloat16"})
    VALIDATOR.validate(b)
    assert validation.validate(b) == []
    values = env(spec.parse(b))
    names = ("VSURGE_KV_CACHE_DTYPE", "VSURGE_PREFILL_DTYPE", "VSURGE_DECODE_DTYPE")
    assert [values[n] for n in names] == ["bfloat16"] * 3
    cfg = parse_serve_config(
        [], {k: v for k, v in values.items() if k.startswith("VSURGE_") and v is not None}
    )
    assert cfg.engine.kv_cache_dtype == cfg.engine.prefill_dtype == cfg.engine.decode_dtype == "bfloat16"
    unset = env(spec.parse(body()))
    assert not set(names) & set(unset)


@pytest.mark.parametrize(
    ("gpu_spec", "selector"),
    [
        ({"count": 1}, {}),
        ({"count": 8, "type": "nvidia-h100-80gb"}, {gpu.NODE_LABEL_GKE_ACCELERATOR: "nvidia-h100-80gb"}),
        ({"count": 2, "type": "NVIDIA-H200"}, {gpu.NODE_LABEL_GPU_PRODUCT: "NVIDIA-H200"}),
    ],
)
def test_gpu_placement_manifests(gpu_spec, selector):
    b = body(gpu=gpu_spec, resources={"requests": {"cpu": "8"}}, nodeSelector={"pool": "gpu"})
    VALIDATOR.validate(b)
    assert validation.validate(b) == []
    m = spec.parse(b)
    d = manifests.workload(m)
    assert d["kind"] == "Deployment"
    pod = d["spec"]["template"]["spec"]
    n = str(gpu_spec["count"])
    assert pod["containers"][0]["resources"] == {
        "requests": {"cpu": "8", "nvidia.com/gpu": n},
        "limits": {"nvidia.com/gpu": n},
    }
    assert pod["nodeSelector"] == {"pool": "gpu", **selector}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert not any(
        "google.com/tpu" in str(v) for v in (pod["tolerations"], pod["containers"][0]["resources"])
    )
    mesh = env(m).get("VSURGE_MESH")
    assert mesh == (None if gpu_spec["count"] == 1 else f"tp={gpu_spec['count']}")
    for obj in manifests.desired_objects(m):
        kv.validate(obj, kv.latest_version(), strict=True)


def test_gpu_mesh_given_must_cover_the_gpus():
    ok = body(gpu={"count": 4}, engine={"mesh": "dp=2,tp=2"})
    assert validation.validate(ok) == []
    assert env(spec.parse(ok))["VSURGE_MESH"] == "dp=2,tp=2"
    bad = body(gpu={"count": 4}, engine={"mesh": "tp=8"})
    assert [e.field for e in validation.validate(bad)] == ["spec.engine.mesh"]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"gpu": {"count": 0}}, "spec.gpu.count"),
        ({"gpu": {"count": 17}}, "spec.gpu.count"),
        ({"gpu": {"count": "2"}}, "spec.gpu.count"),
        ({"gpu": {"type": "nvidia-l4"}}, "spec.gpu.count"),
        ({"gpu": {"count": 1, "type": "bad type"}}, "spec.gpu.type"),
        ({"engine": {"quantization": "int4"}}, "spec.engine.quantization"),
    ],
)
def test_bad_gpu_and_quantization_fields(fields, field):
    b = body(**fields)
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(b)
    assert field in [e.field for e in validation.validate(b)]


def test_tpu_and_gpu_together_are_refused():
    b = body(gpu={"count": 1}, tpu={"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"})
    assert "spec.gpu" in [e.field for e in validation.validate(b)]
