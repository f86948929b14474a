"""vLLM's routes beside generation, against the real server: /load (what a router polls), /invocations
(SageMaker's dispatch), /tokenize with chat options and token strings, /tokenizer_info, /ping, /version, and
the model card's vLLM fields."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from server_helpers import MAX_LENGTH, MODEL, SLOTS, wait_for

MESSAGES = [{"role": "user", "content": "Hello world"}]


# ------------------------------------------------------------------------------------------------ /load


def test_load_report_from_driver_counters():
    from vsurge.drivers.metrics import DriverMetrics
    from vsurge.server.load_report import load_report

    dense = DriverMetrics(slots_used=3, slots_total=8, requests_running=3, requests_waiting=2)
    paged = DriverMetrics(slots_used=1, slots_total=4, requests_running=1, pages_used=30, pages_total=120)
    report = load_report("ready", 5, {"a": dense, "b": paged, "c": RuntimeError("gone")})
    a, b = report["models"]["a"], report["models"]["b"]
    assert a == {
        "driver": "vdriver",
        "requests_waiting": 2,
        "requests_running": 3,
        "slots_used": 3,
        "slots_total": 8,
        "slots_free": 5,
        "kv_pages_used": None,  # dense KV: one row per slot, so its KV use is slot use
        "kv_pages_total": None,
        "kv_usage": 0.375,
    }
    assert b["driver"] == "odriver" and (b["kv_pages_used"], b["kv_pages_total"], b["kv_usage"]) == (
        30,
        120,
        0.25,
    )
    assert report["models"]["c"] == {"error": "RuntimeError"}
    assert report["server_load"] == 5 and report["slots_free"] == 8 and report["requests_waiting"] == 2
    assert (report["kv_pages_used"], report["kv_pages_total"]) == (30, 120)


def _poll_during(http, burst) -> list[dict]:
    """/load snapshots taken back to back while ``burst`` (a started thread pool future list) runs."""
    snapshots = []
    while not all(f.done() for f in burst):
        snapshots.append(http.get("/load").json())
    for f in burst:
        f.result()
    return snapshots


def _at_rest(http) -> dict | None:
    report = http.get("/load").json()
    m = report["models"][MODEL]
    return (
        report if report["server_load"] == 0 and m["slots_used"] == 0 and m["requests_waiting"] == 0 else None
    )


def test_load_follows_a_burst_and_returns_to_idle(server, http):
    # The server is shared by the session: a request that ended in the test before (a client that went
    # away, a cancel) frees its slot at the driver's next step, a moment after its HTTP exchange is over.
    idle = wait_for(lambda: _at_rest(http), timeout=60)
    assert idle["server_load"] == 0 and idle["status"] == "ready"
    m = idle["models"][MODEL]
    # the vDriver: one dense KV row per slot, so no pages and KV use is slot use
    assert m["driver"] == "vdriver" and m["kv_pages_used"] is None and m["kv_pages_total"] is None
    assert (m["slots_total"], m["slots_free"], m["slots_used"], m["kv_usage"]) == (SLOTS, SLOTS, 0, 0.0)
    assert m["requests_waiting"] == 0 and m["requests_running"] == 0
    # three requests of SLOTS samples each: they take every slot in turn, and the others wait
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 120, "n": SLOTS, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        burst = [
            pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=120) for _ in range(3)
        ]
        snapshots = _poll_during(http, burst)
    assert all(f.result().status_code == 200 for f in burst)
    for snap in snapshots:  # every answer is consistent in itself
        sm = snap["models"][MODEL]
        assert 0 <= snap["server_load"] <= 3 and sm["slots_used"] + sm["slots_free"] == SLOTS
        assert sm["kv_usage"] == pytest.approx(sm["slots_used"] / SLOTS, abs=1e-3)
        assert snap["slots_used"] == sm["slots_used"] and snap["requests_waiting"] == sm["requests_waiting"]
    # and it saw the burst: in flight, every slot taken, samples waiting for one
    assert max(s["server_load"] for s in snapshots) >= 2
    assert max(s["models"][MODEL]["slots_used"] for s in snapshots) == SLOTS
    assert max(s["models"][MODEL]["requests_running"] for s in snapshots) >= 1
    assert max(s["models"][MODEL]["requests_waiting"] for s in snapshots) >= 1
    wait_for(lambda: http.get("/load").json()["server_load"] == 0)
    wait_for(lambda: http.get("/load").json()["models"][MODEL]["slots_used"] == 0)


@pytest.mark.slow  # compiles the paged engine's programs (~45 s cold on 2 cores)
def test_load_on_the_paged_engine_reports_kv_pages(tiny_dir):
    import vsurge
    from vsurge import vSurge
    from vsurge.server import start, vSurgeApiServer

    model, processor = vsurge.load_model(tiny_dir)
    surge = vSurge.create_odriver(
        model,
        processor,
        max_concurrent_decodes=2,
        max_length=96,
        prefill_lengths=[32],
        page_size=16,
        vsurge_name="p",
    )
    api = vSurgeApiServer({"p": surge})
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=True, progress=None)
    try:
        running.wait_ready(600)
        with httpx.Client(base_url=running.url, timeout=120) as c:
            idle = c.get("/load").json()["models"]["p"]
            assert idle["driver"] == "odriver" and idle["kv_pages_total"] > 0
            total = idle["kv_pages_total"]
            body = {"model": "p", "prompt": [5] * 40, "max_tokens": 40, "n": 2, "ignore_eos": True}
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                burst = [pool.submit(c.post, "/v1/completions", json=body) for _ in range(2)]
                snapshots = _poll_during(c, burst)
            for snap in snapshots:
                pm = snap["models"]["p"]
                assert pm["kv_pages_total"] == total and 0 <= pm["kv_pages_used"] <= total
                assert pm["kv_usage"] == pytest.approx(pm["kv_pages_used"] / total, abs=1e-3)
            # a sample of 40 + 40 tokens holds at least 5 pages of 16 while it decodes
            assert max(s["models"]["p"]["kv_pages_used"] for s in snapshots) >= 5
    finally:
        running.stop()


def test_load_needs_no_api_key_and_reports_a_starting_server(surge):
    from vsurge.server import start, vSurgeApiServer

    api = vSurgeApiServer(api_key="k", owns_engines=False)
    # the card's root is where the weights came from, without what could carry a credential
    api.add_model(MODEL, surge, root="s3://user:secret@bucket/models/tiny?X-Amz-Signature=abc")
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=False, progress=None)
    try:
        r = httpx.get(f"{running.url}/load", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "starting"
        assert httpx.get(f"{running.url}/ping", timeout=10).status_code == 503
        assert httpx.get(f"{running.url}/tokenizer_info", timeout=10).status_code == 401
        card = httpx.get(f"{running.url}/v1/models", headers={"Authorization": "Bearer k"}, timeout=10).json()
        assert card["data"][0]["root"] == "s3://bucket/models/tiny"
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
    bad = http.post("/invocations", json={"model": MODEL, "text": "x"})  # "input" is an embeddings body
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
