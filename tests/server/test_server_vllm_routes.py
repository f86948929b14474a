"""vLLM's routes beside generation, against the real server: /load (what a router polls), /invocations
(SageMaker's dispatch), /tokenize with chat options and token strings, /tokenizer_info, /ping, /version, and
the model card's vLLM fields."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import MAX_LENGTH, MODEL, SLOTS, wait_for

MESSAGES = [{"role": "user", "content": "Hello world"}]


# ------------------------------------------------------------------------------------------------ /load


def test_load_reports_in_flight_requests_slots_and_kv(server, http):
    idle = http.get("/load")
    assert idle.status_code == 200
    body = idle.json()
    assert body["server_load"] == 0 and body["status"] == "ready"
    m = body["models"][MODEL]
    # the vDriver: one dense KV row per slot, so no pages and KV use is slot use
    assert m["driver"] == "vdriver" and m["kv_pages_used"] is None and m["kv_pages_total"] is None
    assert m["slots_total"] == SLOTS and m["slots_free"] == SLOTS and m["slots_used"] == 0
    assert m["requests_waiting"] == 0 and m["requests_running"] == 0 and m["kv_usage"] == 0.0
    assert {k: body[k] for k in ("slots_total", "slots_free", "requests_running")} == {
        "slots_total": SLOTS,
        "slots_free": SLOTS,
        "requests_running": 0,
    }
    # a long stream holds a slot: after its first chunk, /load sees it (vLLM's server_load counts it)
    payload = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": MAX_LENGTH - 8,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(base_url=server.url, timeout=60) as streamer,
        streamer.stream("POST", "/v1/completions", json=payload) as r,
    ):
        assert next(line for line in r.iter_lines() if line.startswith("data: "))
        busy = http.get("/load").json()
        assert busy["server_load"] == 1
        bm = busy["models"][MODEL]
        assert bm["slots_used"] == 1 and bm["slots_free"] == SLOTS - 1 and bm["requests_running"] == 1
        assert bm["kv_usage"] == pytest.approx(1 / SLOTS, abs=1e-3)
        assert busy["slots_free"] == SLOTS - 1
    # the client left: the request is cancelled, its slot and the count come back
    wait_for(lambda: http.get("/load").json()["server_load"] == 0)
    wait_for(lambda: http.get("/load").json()["models"][MODEL]["slots_used"] == 0)


def test_load_needs_no_api_key_and_reports_a_starting_server(surge):
    from vsurge.server import start, vSurgeApiServer

    api = vSurgeApiServer({MODEL: surge}, api_key="k", owns_engines=False)
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=False, progress=None)
    try:
        r = httpx.get(f"{running.url}/load", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "starting"
        assert httpx.get(f"{running.url}/ping", timeout=10).status_code == 503
        assert httpx.get(f"{running.url}/tokenizer_info", timeout=10).status_code == 401
    finally:
        running.stop()


# ------------------------------------------------------------------------------------------ /invocations


def test_invocations_dispatches_chat_and_completion_bodies(http):
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": False}
    direct = http.post("/v1/chat/completions", json=chat).json()
    via = http.post("/invocations", json=chat)
    assert via.status_code == 200, via.text
    via = via.json()
    assert via.keys() == direct.keys() and via["object"] == "chat.completion"
    assert via["choices"] == direct["choices"]
    comp = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0}
    direct = http.post("/v1/completions", json=comp).json()
    via = http.post("/invocations", json=comp).json()
    assert via["object"] == "text_completion" and via["choices"] == direct["choices"]
    # a stream through /invocations is a stream
    with http.stream("POST", "/invocations", json={**comp, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    bad = http.post("/invocations", json={"model": MODEL, "input": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------------------------------------- tokens


def test_tokenize_chat_options_tools_and_token_strs(http, surge):
    tok = surge.processor
    conversation = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Sure,"}]
    for add_special in (False, True):
        for add_generation, continue_final in ((True, False), (False, False), (False, True)):
            text = tok.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation,
                continue_final_message=continue_final,
            )
            r = http.post(
                "/tokenize",
                json={
                    "model": MODEL,
                    "messages": conversation,
                    "add_special_tokens": add_special,
                    "add_generation_prompt": add_generation,
                    "continue_final_message": continue_final,
                },
            )
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["tokens"] == tok.encode(text, add_special_tokens=add_special)
            assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_LENGTH
            assert out["token_strs"] is None
    both = {
        "model": MODEL,
        "messages": conversation,
        "continue_final_message": True,
        "add_generation_prompt": True,
    }
    r = http.post("/tokenize", json=both)
    assert r.status_code == 400 and "Cannot set both" in r.json()["error"]["message"]
    # tools: rendered as chat generation renders them (this template has no tool support: a system message)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = http.post("/tokenize", json={"model": MODEL, "messages": conversation[:1], "tools": tools})
    assert with_tools.status_code == 200, with_tools.text
    plain = http.post("/tokenize", json={"model": MODEL, "messages": conversation[:1]}).json()
    assert with_tools.json()["count"] > plain["count"]
    assert "get_weather" in tok.decode(with_tools.json()["tokens"])
    chat = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": conversation[:1], "tools": tools, "max_tokens": 1},
    ).json()
    assert chat["usage"]["prompt_tokens"] == with_tools.json()["count"]
    # return_token_strs: the tokenizer's own vocabulary entries
    prompt = "This is a token_strs test prompt!"
    out = http.post("/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    assert out["tokens"] == tok.encode(prompt)
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])


def test_tokenizer_info(http, surge):
    r = http.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == type(surge.processor).__name__
    assert info["chat_template"] == surge.processor.chat_template
    assert info["eos_token"] == "<|im_end|>"
    assert not any(k.endswith("_file") for k in info)  # no server paths
    assert info.get("model_max_length", MAX_LENGTH) >= MAX_LENGTH
    json.dumps(info)
    assert http.get("/tokenizer_info", params={"model": MODEL}).json() == info
    assert http.get("/tokenizer_info", params={"model": "nope"}).status_code == 404


# --------------------------------------------------------------------------------------- small routes


def test_models_card_ping_and_version(client, http):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_extra["root"] == MODEL and card.model_extra["parent"] is None
    assert card.model_extra["max_model_len"] == MAX_LENGTH
    assert card.model_extra["permission"][0]["object"] == "model_permission"
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    from vsurge import __version__

    assert http.get("/version").json() == {"version": __version__}
