"""The InferenceModel CRD on a real API server (apiextensions-apiserver 0.36, with CEL).

Every invalid spec of the KMock suite's tables (tests/operator/test_operator_crd.py and
test_operator_validation.py) is sent to the server (dry-run create): the server itself must refuse it and
name the field, unless the rule needs what only the operator knows (its TPU tables, its default image);
those few are listed here, and the server must accept exactly them. Valid specs come back with the
server's defaults, which must equal the operator's own.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import test_operator_crd as crd_cases
import test_operator_validation as validation_cases
from kubernetes.client.exceptions import ApiException

from vsurge_operator import spec as specmod
from vsurge_operator import validation

PATH = "/apis/vsurge.io/v1alpha1/namespaces/{ns}/inferencemodels"

# Rules the schema cannot express, left to the operator (it sets Degraded/InvalidSpec; see
# test_cluster_operator.py): (table, field) of the KMock cases the server accepts.
OPERATOR_ONLY = {
    ("validation", "spec.image"),  # required only when the operator has no --default-image
    ("validation", "spec.engine.mesh"),  # tp=4 on a 2x4 slice: needs the chip count of the slice
    ("validation", "spec.tpu.topology"),  # 4x4x4 is not a v5e slice: the operator's TPU table
    ("validation", "spec.resources.limits.google.com/tpu"),  # chips per host of the slice
    ("validation", "spec.nodeSelector.cloud.google.com/gke-tpu-topology"),  # conflicts with spec.tpu
}

# The cases found on this server that validation.py let through (a trailing newline past a pattern, duplicate
# env names, a float quantity, a non-object valueFrom, a string tolerationSeconds, an over-long mesh) are
# now in test_operator_validation.BAD, so they are replayed here with the rest.


def _post(api: Any, namespace: str, doc: dict[str, Any], dry_run: bool = True) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["apiVersion"] = "vsurge.io/v1alpha1"
    doc["kind"] = "InferenceModel"
    doc.setdefault("metadata", {})["namespace"] = namespace
    query = {"dryRun": "All"} if dry_run else None
    return api.request("POST", PATH.format(ns=namespace), doc, query=query)


def _rejection(api: Any, namespace: str, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The server's Status of a refused create, or None when it accepted the object."""
    try:
        _post(api, namespace, doc)
    except ApiException as e:
        assert e.status == 422, (e.status, e.body)
        return json.loads(e.body)
    return None


def _names_field(status: dict[str, Any], field: str) -> bool:
    causes = [c.get("field") or "" for c in (status.get("details") or {}).get("causes") or []]
    field = field.replace("prefillLengths[]", "prefillLengths[0]")
    # The server may name the field, a key below it, or the list item it belongs to (a duplicate env
    # name is "spec.env[1]: Duplicate value" where validation.py says spec.env[1].name).
    return any(
        c == field
        or c.startswith((field + ".", field + "["))
        or (c.endswith("]") and field.startswith(c + "."))
        for c in causes
        if c
    ) or (field in status.get("message", ""))


CASES = [("crd", f, d) for f, d in crd_cases.BAD] + [("validation", f, d) for f, d in validation_cases.BAD]


def test_every_invalid_spec_of_the_kmock_suite_is_refused_by_the_server(k8s, namespace):
    api = k8s.kube()
    wrong: list[str] = []
    accepted: set[tuple[str, str]] = set()
    for table, field, doc in CASES:
        status = _rejection(api, namespace, doc)
        if status is None:
            accepted.add((table, field))
            if (table, field) not in OPERATOR_ONLY:
                wrong.append(f"{table} {field}: accepted by the server")
        elif not _names_field(status, field):
            wrong.append(f"{table} {field}: refused without naming it: {status.get('message')}")
    assert not wrong, "\n".join(wrong)
    # The exceptions are real: each is accepted by the server and refused by the operator.
    assert accepted == OPERATOR_ONLY
    for table, field, doc in CASES:
        if (table, field) in OPERATOR_ONLY:
            errors = validation.validate(doc, default_image=None if field == "spec.image" else "img")
            assert field in {e.field for e in errors}, (field, errors)


def test_valid_specs_are_stored_with_the_servers_defaults(k8s, namespace):
    api = k8s.kube()
    for name, doc in crd_cases.VALID.items():
        assert _rejection(api, namespace, doc) is None, name
    doc = {
        "metadata": {"name": "defaults"},
        "spec": {
            "model": {"source": "default"},
            "autoscaling": {"enabled": True},
            "tracing": {"endpoint": "http://otel:4317"},
            "unknownField": {"pruned": True},
        },
    }
    stored = _post(api, namespace, doc, dry_run=False)
    assert stored["metadata"]["generation"] == 1 and stored["metadata"]["uid"]
    spec = stored["spec"]
    assert "unknownField" not in spec  # pruned by the structural schema
    defaults = specmod.AutoscalingSpec()
    assert spec["autoscaling"] == {
        "enabled": True,
        **{k: getattr(defaults, py) for k, py in specmod._AUTOSCALING_KEYS.items() if k != "enabled"},
    }
    assert spec["tracing"]["samplingRatio"] == specmod.TracingSpec("x").sampling_ratio
    # The operator reads the defaulted object exactly as it reads the sparse one.
    parsed = specmod.parse(stored, default_image="img")
    sparse = specmod.parse({**doc, "metadata": stored["metadata"]}, default_image="img")
    assert parsed == sparse


def test_printer_columns_and_scale_subresource_are_served(k8s, namespace):
    api = k8s.kube()
    body = {"metadata": {"name": "cols"}, "spec": {"model": {"source": "default"}, "replicas": 2}}
    _post(api, namespace, body, dry_run=False)
    # The Table form kubectl asks for: the CRD's additionalPrinterColumns, computed by the server.
    url = api.api.configuration.host + PATH.format(ns=namespace) + "/cols"
    response = api.api.call_api(
        "GET",
        url,
        header_params={
            "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io",
            "Authorization": api.api.configuration.get_api_key_with_prefix("authorization") or "",
        },
    )
    table = json.loads(response.read())
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns == ["Name", "Model", "Accelerator", "Topology", "Ready", "Desired", "Occupancy", "Age"]
    assert table["rows"][0]["cells"][:2] == ["cols", "default"]
    scale = api.request("GET", PATH.format(ns=namespace) + "/cols/scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 2


def test_cel_rules_of_the_pod_fields_are_enforced_by_the_server(k8s, namespace):
    """The rules only CEL can state (tests/operator checks that the operator enforces them as well)."""
    api = k8s.kube()
    for field, doc in crd_cases.CEL_ONLY:
        status = _rejection(api, namespace, doc)
        assert status is not None, f"{field}: accepted by the server"
        # A rule on a map names the map (spec.podTemplate.metadata.labels), the operator names the key.
        server_field = field if ".labels." not in field else field[: field.index(".labels.") + len(".labels")]
        assert _names_field(status, server_field), (field, status.get("message"))
    # The defaults fill the rollout and the drain of a sparse spec.
    stored = _post(api, namespace, {"metadata": {"name": "sparse"}, "spec": {"model": {"source": "default"}}})
    assert stored["spec"]["drainSeconds"] == specmod.DEFAULT_DRAIN_SECONDS
    assert stored["spec"]["rollout"] == {"surge": 1, "maxUnavailable": 0}
    # surge 0 alone is refused (maxUnavailable defaults to 0); with maxUnavailable 1 it is the in-place rollout.
    surge0 = {"metadata": {"name": "s0"}, "spec": {"model": {"source": "default"}, "rollout": {"surge": 0}}}
    assert _rejection(api, namespace, surge0) is not None
    surge0["spec"]["rollout"]["maxUnavailable"] = 1
    assert _post(api, namespace, surge0)["spec"]["rollout"] == {"surge": 0, "maxUnavailable": 1}
