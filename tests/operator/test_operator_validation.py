"""Spec validation: every problem comes back with the name of the field that causes it."""

from __future__ import annotations

from typing import Any

import pytest
from operator_harness import DELETE, issue_example, with_field

from vsurge_operator import validation

_EXAMPLE = issue_example()


def body(**spec: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"model": {"source": "default"}, "image": "img:1"}
    s.update(spec)
    return {"metadata": {"name": "llama", "namespace": "ns"}, "spec": s}


VALID = [
    body(),
    body(model={"source": "hf://meta-llama/Llama-3.1-8B-Instruct", "servedName": "llama-3.1-8b"}),
    body(model={"source": "pvc://weights/llama/8b"}, tpu={"accelerator": "tpu-v6e-slice", "topology": "2x4"}),
    body(  # the issue's example engine and slice, with an explicit mesh
        engine={**_EXAMPLE["engine"], "mesh": "dp=2,tp=4"},
        tpu=_EXAMPLE["tpu"],
        replicas=2,
        autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 8, "target": 0.7},
        tracing={"endpoint": "http://otel-collector:4317", "samplingRatio": 0.1},
        resources={"requests": {"cpu": "8", "memory": "32Gi", "google.com/tpu": 8}},
        env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
        nodeSelector={"cloud.google.com/gke-tpu-topology": "2x4", "pool": "serving"},
        tolerations=[{"key": "dedicated", "operator": "Exists"}],
        serviceAccountName="vsurge-models",
    ),
    body(autoscaling={"enabled": True, "metric": "prefillQueueSize", "target": 4}),
    body(  # driver-restricted options at their idle values are fine on the other driver
        engine={
            "driver": "odriver",
            "decodeSteps": 1,
            "speculative": "none",
            "kvCacheDtype": "auto",
            "seed": 7,
        }
    ),
]


@pytest.mark.parametrize("b", VALID)
def test_valid_specs_have_no_errors(b):
    assert validation.validate(b) == []


def _with(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copy of a valid body with ``path`` (dotted, under the body) set; None deletes it."""
    return with_field(base or body(), path, DELETE if value is None else value)


TPU = {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4"}

BAD = [
    ("metadata.name", _with("metadata.name", "Llama")),
    ("metadata.name", _with("metadata.name", "1llama")),
    ("metadata.name", _with("metadata.name", "a" * 64)),
    ("spec", {"metadata": {"name": "x"}}),
    ("spec.model", _with("spec.model", None)),
    ("spec.model.source", _with("spec.model", {})),
    ("spec.model.source", _with("spec.model.source", "ftp://host/model")),
    ("spec.model.source", _with("spec.model.source", "pvc://Bad_Claim/x")),
    ("spec.model.servedName", _with("spec.model.servedName", "has space")),
    ("spec.image", _with("spec.image", None)),
    ("spec.imagePullPolicy", _with("spec.imagePullPolicy", "Sometimes")),
    ("spec.replicas", _with("spec.replicas", -1)),
    ("spec.replicas", _with("spec.replicas", "3")),
    ("spec.replicas", _with("spec.replicas", True)),
    ("spec.engine.driver", _with("spec.engine", {"driver": "turbo"})),
    ("spec.engine.maxConcurrentDecodes", _with("spec.engine", {"maxConcurrentDecodes": 0})),
    ("spec.engine.maxLength", _with("spec.engine", {"maxLength": 8})),
    ("spec.engine.pageSize", _with("spec.engine", {"pageSize": 100})),
    ("spec.engine.hbmUtilization", _with("spec.engine", {"hbmUtilization": 0})),
    ("spec.engine.hbmUtilization", _with("spec.engine", {"hbmUtilization": 1.5})),
    ("spec.engine.dtype", _with("spec.engine", {"dtype": "int8"})),
    ("spec.engine.speculative", _with("spec.engine", {"speculative": "eagle"})),
    ("spec.engine.speculative", _with("spec.engine", {"speculative": "ngram", "driver": "odriver"})),
    ("spec.engine.kvCacheDtype", _with("spec.engine", {"kvCacheDtype": "fp8"})),
    ("spec.engine.kvCacheDtype", _with("spec.engine", {"kvCacheDtype": "bfloat16", "driver": "odriver"})),
    ("spec.engine.prefillDtype", _with("spec.engine", {"prefillDtype": "float8"})),
    ("spec.engine.prefillDtype", _with("spec.engine", {"prefillDtype": "bfloat16", "driver": "odriver"})),
    ("spec.engine.decodeDtype", _with("spec.engine", {"decodeDtype": "float8"})),
    ("spec.engine.decodeDtype", _with("spec.engine", {"decodeDtype": "bfloat16", "driver": "odriver"})),
    ("spec.engine.numSpeculativeTokens", _with("spec.engine", {"numSpeculativeTokens": 0})),
    ("spec.engine.numSpeculativeTokens", _with("spec.engine", {"numSpeculativeTokens": 17})),
    # the serve options the CRD gained with the generated table (issue 31)
    ("spec.engine.maxConcurrentPrefill", _with("spec.engine", {"maxConcurrentPrefill": 0})),
    ("spec.engine.seed", _with("spec.engine", {"seed": "7"})),
    ("spec.engine.attention", _with("spec.engine", {"attention": "flash"})),
    ("spec.engine.maxNumBatchedTokens", _with("spec.engine", {"maxNumBatchedTokens": 0})),
    ("spec.engine.decodeSteps", _with("spec.engine", {"decodeSteps": 0})),
    ("spec.engine.decodeSteps", _with("spec.engine", {"decodeSteps": 4, "driver": "odriver"})),
    ("spec.engine.mesh", _with("spec.engine", {"mesh": "tp=0"})),
    ("spec.engine.mesh", _with("spec.engine", {"mesh": "tp=2,tp=4"})),
    ("spec.engine.mesh", _with("spec.engine", {"mesh": "tp=4"}, _with("spec.tpu", TPU))),
    ("spec.engine.prefillLengths", _with("spec.engine", {"prefillLengths": []})),
    ("spec.engine.prefillLengths", _with("spec.engine", {"prefillLengths": [1024, 256]})),
    ("spec.engine.prefillLengths", _with("spec.engine", {"maxLength": 1024, "prefillLengths": [256, 2048]})),
    ("spec.engine.prefillLengths[1]", _with("spec.engine", {"prefillLengths": [256, "1024"]})),
    ("spec.tpu.accelerator", _with("spec.tpu", {"accelerator": "tpu-v9", "topology": "2x4"})),
    ("spec.tpu.topology", _with("spec.tpu", {"accelerator": "tpu-v5-lite-podslice", "topology": "4x4x4"})),
    ("spec.tpu.topology", _with("spec.tpu", {"accelerator": "tpu-v5-lite-podslice", "topology": "2by4"})),
    ("spec.tpu.topology", _with("spec.tpu", {"accelerator": "tpu-v5-lite-podslice"})),
    ("spec.autoscaling.maxReplicas", _with("spec.autoscaling", {"minReplicas": 5, "maxReplicas": 2})),
    ("spec.autoscaling.maxReplicas", _with("spec.autoscaling", {"minReplicas": 5})),
    ("spec.autoscaling.target", _with("spec.autoscaling", {"target": 0})),
    ("spec.autoscaling.target", _with("spec.autoscaling", {"target": 1.5})),
    ("spec.autoscaling.metric", _with("spec.autoscaling", {"metric": "cpu"})),
    ("spec.autoscaling.enabled", _with("spec.autoscaling", {"enabled": "yes"})),
    ("spec.autoscaling.intervalSeconds", _with("spec.autoscaling", {"intervalSeconds": 0})),
    ("spec.autoscaling.tolerance", _with("spec.autoscaling", {"tolerance": 0.9})),
    ("spec.autoscaling.scaleDownPercent", _with("spec.autoscaling", {"scaleDownPercent": 150})),
    ("spec.tracing.endpoint", _with("spec.tracing", {"endpoint": "otel:4317"})),
    ("spec.tracing.samplingRatio", _with("spec.tracing", {"endpoint": "http://o:4317", "samplingRatio": 2})),
    (
        "spec.resources.limits.google.com/tpu",
        _with("spec.resources", {"limits": {"google.com/tpu": 4}}, _with("spec.tpu", TPU)),
    ),
    ("spec.resources.requests.cpu", _with("spec.resources", {"requests": {"cpu": [1]}})),
    ("spec.env[0]", _with("spec.env", [{"value": "x"}])),
    ("spec.env[0].name", _with("spec.env", [{"name": "1=bad"}])),
    ("spec.env", _with("spec.env", {"A": "b"})),
    (
        "spec.nodeSelector.cloud.google.com/gke-tpu-topology",
        _with("spec.nodeSelector", {"cloud.google.com/gke-tpu-topology": "4x4"}, _with("spec.tpu", TPU)),
    ),
    ("spec.tolerations", _with("spec.tolerations", ["NoSchedule"])),
    ("spec.serviceAccountName", _with("spec.serviceAccountName", "Not_Valid")),
    # Refused by the real API server (tests/cluster), so by the operator too:
    ("spec.model.source", _with("spec.model.source", "default\n")),  # Go regexp: $ is the very end
    ("spec.env[1].name", _with("spec.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}])),
    ("spec.env[0].valueFrom", _with("spec.env", [{"name": "A", "valueFrom": "secret"}])),
    ("spec.resources.limits.cpu", _with("spec.resources", {"limits": {"cpu": 1.5}})),  # int-or-string
    (
        "spec.tolerations[0].tolerationSeconds",
        _with("spec.tolerations", [{"key": "k", "tolerationSeconds": "5"}]),
    ),
    ("spec.engine.mesh", _with("spec.engine", {"mesh": "tp=1," * 12 + "dp=1"})),  # maxLength 64
]


@pytest.mark.parametrize(("field", "b"), BAD, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD)])
def test_bad_specs_name_the_field(field, b):
    errors = validation.validate(b)
    assert errors, "expected a validation error"
    assert field in {e.field for e in errors}, errors
    assert all(str(e).startswith(f"{e.field}: ") for e in errors)


def test_default_image_makes_image_optional():
    b = _with("spec.image", None)
    assert validation.validate(b, default_image="ghcr.io/x/vsurge-service:1") == []


def test_all_problems_are_reported_at_once():
    b = body(
        replicas=-1, engine={"dtype": "int8", "driver": "x"}, tpu={"accelerator": "nope", "topology": "1x1"}
    )
    fields = [e.field for e in validation.validate(b)]
    assert fields == ["spec.replicas", "spec.engine.driver", "spec.engine.dtype", "spec.tpu.accelerator"]
    assert validation.format_errors(validation.validate(b)).count(";") == 3
