"""LoRA adapters through HTTP: `model` selects an adapter, /v1/models lists it with its parent, vLLM's
load / unload routes (behind --enable-lora-runtime-updates and the API key), 404 for unknown names, the
per-adapter metrics and the GIE gauge; and `vsurge serve`'s --lora flags as the operator renders them."""

from __future__ import annotations

import httpx
import pytest
from lora_adapters import make_adapter
from server_helpers import MODEL
from tiny_models import make_checkpoint

import vsurge
from vsurge import vSurge
from vsurge.cli.serve_options import ConfigError, parse_serve_config

KEY = "admin-key"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from vsurge.server import start, vSurgeApiServer

    root = tmp_path_factory.mktemp("lora-server")
    hf = make_checkpoint(root / "base", "llama", seed=0)
    for i, name in enumerate(("sql", "chat")):
        make_adapter(hf, root / name, name, seed=i)
    model, tok = vsurge.load_model(str(root / "base"))
    config = vsurge.EngineConfig(
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_concurrent_decodes=4,
        max_length=64,
        prefill_lengths=(16,),
    )
    surge = vSurge.create(model, tok, config)
    surge.lora.add("sql", str(root / "sql"))  # what --lora sql=... does at start
    api = vSurgeApiServer({MODEL: surge}, api_key=KEY, lora_runtime_updates=True, metrics_on_main_port=True)
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=False, progress=None)
    api.warm_up()
    with httpx.Client(base_url=running.url, timeout=60, headers={"authorization": f"Bearer {KEY}"}) as c:
        yield c, root, api
    running.stop()
    surge.stop()


def complete(c, model, prompt=(5, 17, 42, 99)):
    body = {"model": model, "prompt": list(prompt), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return c.post("/v1/completions", json=body)


def test_models_list_adapters_and_requests_select_them(lora_server):
    c, _, _ = lora_server
    cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert cards[MODEL]["parent"] is None
    assert cards["sql"]["parent"] == MODEL
    assert c.get("/v1/models/sql").json()["parent"] == MODEL
    base, sql = complete(c, MODEL), complete(c, "sql")
    assert base.status_code == sql.status_code == 200
    assert sql.json()["model"] == "sql"
    assert sql.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]  # the adapter matters
    missing = complete(c, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_at_run_time(lora_server):
    c, root, _ = lora_server
    body = {"lora_name": "chat", "lora_path": str(root / "chat")}
    assert httpx.post(f"{c.base_url}/v1/load_lora_adapter", json=body).status_code == 401  # no key
    r = c.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 200, r.text
    assert c.post("/v1/load_lora_adapter", json=body).status_code == 400  # already loaded
    bad = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root)})
    assert bad.status_code == 400 and "not a PEFT adapter directory" in bad.json()["error"]["message"]
    assert "chat" in {m["id"] for m in c.get("/v1/models").json()["data"]}
    assert complete(c, "chat").status_code == 200
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    assert complete(c, "chat").status_code == 404
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404


def test_per_adapter_metrics_and_the_gie_gauge(lora_server):
    c, _, _ = lora_server
    assert complete(c, "sql").status_code == 200
    text = c.get("/metrics").text
    assert f'vsurge_lora_requests_total{{adapter="sql",model="{MODEL}"}}' in text
    assert f'vsurge_lora_generation_tokens_total{{adapter="sql",model="{MODEL}"}}' in text
    assert 'vllm:lora_requests_info{max_lora="2"' in text


def test_runtime_routes_are_off_without_the_flag(lora_server):
    from starlette.testclient import TestClient

    from vsurge.server import vSurgeApiServer

    _, root, api = lora_server
    other = vSurgeApiServer({MODEL: api.models[MODEL].surge}, owns_engines=False)
    r = TestClient(other.app).post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root)})
    assert r.status_code == 404


def test_serve_takes_the_operators_lora_args():
    """operator/vsurge_operator/adapters.py renders `--lora NAME=SOURCE ... --max-loras N --max-lora-rank R`."""
    cfg = parse_serve_config(
        ["--lora", "sql=hf://org/sql-lora@v1", "--lora", "chat=/mnt/adapters/loras/b", "--max-loras", "4"]
        + ["--max-lora-rank", "32"],
        {},
    )
    assert cfg.loras == (("sql", "hf://org/sql-lora@v1"), ("chat", "/mnt/adapters/loras/b"))
    assert (cfg.engine.enable_lora, cfg.engine.max_loras, cfg.engine.max_lora_rank) == (True, 4, 32)
    assert not parse_serve_config([], {}).engine.enable_lora  # no adapters: no bank
    assert parse_serve_config([], {"VSURGE_ENABLE_LORA_RUNTIME_UPDATES": "1"}).engine.enable_lora
    with pytest.raises(ConfigError, match="NAME=SOURCE"):
        parse_serve_config(["--lora", "sql"], {})
    with pytest.raises(ConfigError, match="unique"):
        parse_serve_config(["--lora", "a=/x", "--lora", "a=/y"], {})


ADMIN = "the-admin-key"


def test_admin_key_alone_opens_the_admin_routes(lora_server, caplog):
    """A second real server on the same engine with --admin-key: load/unload need that key (401 with the
    API key, another key or none; the API key still opens generation), and it does what it did before."""
    from vsurge.server import start, vSurgeApiServer

    _, root, api = lora_server
    admin = vSurgeApiServer(
        {MODEL: api.models[MODEL].surge},
        api_key=KEY,
        admin_key=ADMIN,
        lora_runtime_updates=True,
        owns_engines=False,
    )
    running = start(admin, host="127.0.0.1", port=0, metrics_port=-1, warm_up=False, progress=None)
    admin.warm_up()  # the engine is warm already: this only marks the server ready
    body = {"lora_name": "chat", "lora_path": str(root / "chat")}
    try:
        with httpx.Client(base_url=running.url, timeout=60) as c:
            for headers in ({}, {"authorization": f"Bearer {KEY}"}, {"authorization": "Bearer nope"}):
                for route, payload in (("load", body), ("unload", {"lora_name": "sql"})):
                    r = c.post(f"/v1/{route}_lora_adapter", json=payload, headers=headers)
                    assert r.status_code == 401, (route, headers, r.text)
                    assert r.json()["error"]["code"] == "invalid_admin_key"
            assert "chat" not in {
                m["id"]
                for m in c.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()["data"]
            }
            as_admin = {"authorization": f"Bearer {ADMIN}"}
            assert c.post("/v1/load_lora_adapter", json=body, headers=as_admin).status_code == 200
            tenant = {"authorization": f"Bearer {KEY}"}
            r = c.post(
                "/v1/completions", headers=tenant, json={"model": "chat", "prompt": [5, 17], "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            assert (
                c.post("/v1/completions", headers=as_admin, json={"model": "chat", "prompt": [5]}).status_code
                == 401
            )
            assert (
                c.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}, headers=as_admin).status_code
                == 200
            )
    finally:
        running.stop()


def test_admin_routes_without_an_admin_key(lora_server, caplog):
    """No admin key: the routes exist only behind the explicit flag (404 otherwise, even with the API key),
    and with the flag the start says who can call them."""
    import logging

    from starlette.testclient import TestClient

    from vsurge.server import vSurgeApiServer

    _, root, api = lora_server
    surge = api.models[MODEL].surge
    off = vSurgeApiServer({MODEL: surge}, api_key=KEY, admin_key=ADMIN, owns_engines=False)
    r = TestClient(off.app).post(
        "/v1/load_lora_adapter",
        json={"lora_name": "a", "lora_path": str(root)},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert r.status_code == 404  # an admin key does not turn the routes on
    with caplog.at_level(logging.WARNING, logger="vsurge.server.lora_routes"):
        vSurgeApiServer({MODEL: surge}, lora_runtime_updates=True, owns_engines=False)
    assert "without an admin key" in caplog.text and "anyone who reaches this port" in caplog.text
    with pytest.raises(ValueError, match="differ"):
        vSurgeApiServer({MODEL: surge}, api_key=KEY, admin_key=KEY, owns_engines=False)


def test_serve_reads_the_admin_key():
    assert parse_serve_config(["--admin-key", ADMIN], {}).admin_key == ADMIN
    assert parse_serve_config([], {"VSURGE_ADMIN_KEY": ADMIN}).admin_key == ADMIN
    assert parse_serve_config([], {}).admin_key is None
    with pytest.raises(ConfigError, match="must differ"):
        parse_serve_config([], {"VSURGE_ADMIN_KEY": KEY, "VSURGE_API_KEY": KEY})
