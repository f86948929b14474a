"""spec.adapters (LoRA): validation, what the pods get, and status.adapters from the pods' /v1/models.

The pods' side is `vsurge serve --lora NAME=SOURCE`, which lists each adapter in `GET /v1/models` as a model
object with `parent` = the base model. Until the server's adapter support lands on this branch, the
listing is read from a small real HTTP server that answers exactly that contract.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from typing import Any

import pytest
from kmock_harness import free_port

from vsurge_operator import adapters, manifests, spec, validation


def body(**spec_fields: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"model": {"source": "hf://org/base"}, "image": "img"}
    s.update(spec_fields)
    return {"metadata": {"name": "llama", "namespace": "ns", "uid": "u"}, "spec": s}


def errors(doc: dict[str, Any]) -> list[str]:
    return [str(e) for e in validation.validate(doc)]


# ------------------------------------------------------------------------------------------ validation


def test_valid_adapters_pass_and_parse():
    doc = body(
        adapters=[
            {"name": "sql", "source": "hf://org/sql-lora@v1"},
            {"name": "team/chat:v2", "source": "/opt/adapters/chat"},
        ],
        engine={"maxLoras": 2, "maxLoraRank": 16},
    )
    assert errors(doc) == []
    model = spec.parse(doc)
    assert model.adapters == (
        adapters.AdapterSpec("sql", "hf://org/sql-lora@v1"),
        adapters.AdapterSpec("team/chat:v2", "/opt/adapters/chat"),
    )
    assert (model.engine.max_loras, model.engine.max_lora_rank) == (2, 16)


@pytest.mark.parametrize(
    ("adapters_field", "message"),
    [
        ("not a list", "spec.adapters: must be a list"),
        ([{"name": "a", "source": "hf://o/a"}, {"name": "a", "source": "gs://b/a"}], "must be unique"),
        ([{"name": "llama", "source": "hf://o/a"}], "the model's served name"),
        ([{"name": "a=b", "source": "hf://o/a"}], "spec.adapters[0].name"),
        ([{"name": "a", "source": "default"}], "spec.adapters[0].source"),
        ([{"name": "a"}], "spec.adapters[0].source: is required"),
        (["a=hf://o/a"], "spec.adapters[0]: must be an object"),
        ([{"name": "a", "source": "/" + "x" * 1024}], "at most 1024 characters"),
    ],
)
def test_bad_adapters_are_refused_with_the_field(adapters_field, message):
    found = errors(body(adapters=adapters_field))
    assert any(message in e for e in found), found


def test_the_served_name_is_what_an_adapter_must_not_shadow():
    # servedName set: the object's name is free for an adapter, the served name is not.
    doc = body(
        model={"source": "hf://org/base", "servedName": "base"}, adapters=[{"name": "llama", "source": "/a"}]
    )
    assert errors(doc) == []
    doc["spec"]["adapters"][0]["name"] = "base"
    assert any("served name" in e for e in errors(doc))


# ------------------------------------------------------------------------------------------ manifests


def test_adapters_become_serve_flags_in_spec_order():
    model = spec.parse(
        body(
            adapters=[{"name": "sql", "source": "hf://org/sql"}, {"name": "chat", "source": "s3://b/chat"}],
            engine={"maxLoras": 4, "maxLoraRank": 32},
        )
    )
    c = manifests.container(model)
    assert c["command"] == ["vsurge", "serve"]
    assert c["args"] == [
        "--lora",
        "sql=hf://org/sql",
        "--lora",
        "chat=s3://b/chat",
        "--max-loras",
        "4",
        "--max-lora-rank",
        "32",
    ]
    # Without adapters or LoRA knobs the pod is exactly as before: no args at all.
    assert "args" not in manifests.container(spec.parse(body()))


def test_pvc_adapters_are_mounted_read_only():
    model = spec.parse(
        body(
            model={"source": "pvc://weights/llama"},
            adapters=[
                {"name": "same-claim", "source": "pvc://weights/adapters/a"},
                {"name": "other", "source": "pvc://loras/b"},
                {"name": "other-root", "source": "pvc://loras"},
                {"name": "third", "source": "pvc://more.claims/x/y"},
            ],
        )
    )
    c = manifests.container(model)
    assert c["args"] == [
        "--lora",
        "same-claim=/mnt/models/adapters/a",  # the model's claim is mounted already
        "--lora",
        "other=/mnt/adapters/loras/b",
        "--lora",
        "other-root=/mnt/adapters/loras",
        "--lora",
        "third=/mnt/adapters/more.claims/x/y",
    ]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["adapters-0"] == {
        "name": "adapters-0",
        "mountPath": "/mnt/adapters/loras",
        "readOnly": True,
    }
    assert mounts["adapters-1"]["mountPath"] == "/mnt/adapters/more.claims"
    volumes = {v["name"]: v for v in manifests.pod_template(model)["spec"]["volumes"]}
    assert volumes["adapters-0"]["persistentVolumeClaim"] == {"claimName": "loras", "readOnly": True}
    assert volumes["adapters-1"]["persistentVolumeClaim"]["claimName"] == "more.claims"
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "weights"
    assert "adapters-2" not in volumes


def test_a_change_of_adapters_changes_the_pod_template():
    # The Deployment rolls its pods when the template changes: that is how new adapters reach them.
    a = manifests.deployment(spec.parse(body(adapters=[{"name": "sql", "source": "hf://o/sql"}])))
    b = manifests.deployment(spec.parse(body(adapters=[{"name": "sql", "source": "hf://o/sql-v2"}])))
    assert a["spec"]["template"] != b["spec"]["template"]


# ------------------------------------------------------------------------------------------ status


def test_status_entries():
    specd = (adapters.AdapterSpec("sql", "hf://o/sql"), adapters.AdapterSpec("chat", "hf://o/chat"))
    listings = [{"sql", "chat"}, {"sql", "runtime"}, None]  # the third pod did not answer
    assert adapters.status_entries(specd, listings) == [
        {"name": "sql", "loaded": True, "pods": 2, "inSpec": True},
        {"name": "chat", "loaded": False, "pods": 1, "inSpec": True},
        {"name": "runtime", "loaded": False, "pods": 1, "inSpec": False},
    ]
    # No pod answered: nothing is loaded as far as anyone knows.
    assert adapters.status_entries(specd[:1], [None]) == [
        {"name": "sql", "loaded": False, "pods": 0, "inSpec": True}
    ]
    assert adapters.status_entries((), []) == []


def test_listed_adapters_reads_model_objects_with_a_parent():
    answer = {
        "object": "list",
        "data": [
            {"id": "llama", "object": "model"},
            {"id": "sql", "object": "model", "parent": "llama", "root": "hf://o/sql"},
            {"id": 3, "parent": "llama"},
            "garbage",
        ],
    }
    assert adapters.listed_adapters(answer) == {"sql"}
    assert adapters.listed_adapters({"detail": "Not Found"}) is None
    assert adapters.listed_adapters([]) is None


def test_models_url_follows_the_scrape_target():
    assert adapters.models_url("http://10.0.0.7:11557/metrics", 11556) == "http://10.0.0.7:11556/v1/models"
    assert adapters.models_url("http://[fd00::7]:11557/metrics", 8000) == "http://[fd00::7]:8000/v1/models"
    pod = {
        "spec": {
            "containers": [
                {"ports": [{"name": "metrics", "containerPort": 1}, {"name": "http", "containerPort": 9}]}
            ]
        }
    }
    assert adapters.http_port(pod, 11556) == 9
    assert adapters.http_port({}, 11556) == 11556


class _ModelsHandler(http.server.BaseHTTPRequestHandler):
    """`GET /v1/models` as `vsurge serve --lora` answers it (the server's adapter contract)."""

    listing: dict[str, Any] = {}
    status = 200

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        if self.path != "/v1/models":
            self.send_error(404)
            return
        payload = json.dumps(self.listing).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


def _server(listing: dict[str, Any], status: int = 200) -> http.server.ThreadingHTTPServer:
    handler = type("H", (_ModelsHandler,), {"listing": listing, "status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def test_read_pods_over_http():
    base = {"id": "llama", "object": "model"}
    both = _server(
        {
            "object": "list",
            "data": [base, {"id": "sql", "parent": "llama"}, {"id": "chat", "parent": "llama"}],
        }
    )
    one = _server({"object": "list", "data": [base, {"id": "sql", "parent": "llama"}]})
    locked = _server({"error": {"message": "unauthorized"}}, status=401)  # a pod with an API key
    dead = free_port()
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}/v1/models" for s in (both, one, locked)]
        urls.append(f"http://127.0.0.1:{dead}/v1/models")
        listings = asyncio.run(adapters.read_pods(urls, timeout=2))
    finally:
        for s in (both, one, locked):
            s.shutdown()
            s.server_close()
    assert listings == [{"sql", "chat"}, {"sql"}, None, None]
    entries = adapters.status_entries(
        (adapters.AdapterSpec("sql", "/a"), adapters.AdapterSpec("chat", "/b")), listings
    )
    assert [(e["name"], e["loaded"], e["pods"]) for e in entries] == [("sql", True, 2), ("chat", False, 1)]
