"""Pods the operator makes inherit `vsurge serve`'s sized slots and context (vsurge/cli/sizing.py): the operator
passes an engine variable only when the InferenceModel sets it, so a pod started with none sizes them from
its own device; one that sets them gets exactly those."""

from __future__ import annotations

from vsurge_operator import manifests, spec

SIZED = ("VSURGE_MAX_CONCURRENT_DECODES", "VSURGE_MAX_LENGTH", "VSURGE_HBM_UTILIZATION")


def _env(**overrides) -> dict[str, str]:
    s = {"model": {"source": "default"}, "image": "img:1", **overrides}
    body = {"metadata": {"name": "m", "namespace": "team", "uid": "u", "generation": 1}, "spec": s}
    return {e["name"]: e.get("value") for e in manifests.env(spec.parse(body))}


def test_no_engine_block_leaves_slots_and_context_to_the_pod():
    for placement in ({}, {"tpu": {"accelerator": "tpu-v5-lite-podslice", "topology": "1x1"}}):
        env = _env(**placement)
        assert not set(SIZED) & set(env), env


def test_set_values_reach_the_pod_as_given():
    env = _env(engine={"maxConcurrentDecodes": 96, "maxLength": 1024, "hbmUtilization": 0.8})
    assert [env[k] for k in SIZED] == ["96", "1024", "0.8"]
