"""Prometheus metrics parsed with prometheus_client's own parser; spans caught by the SDK's in-memory exporter."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading

from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL, SLOTS, wait_for

REQUIRED = {
    "vsurge_slots_used": "gauge",
    "vsurge_slot_occupancy": "gauge",
    "vsurge_prefill_queue_size": "gauge",
    "vsurge_requests_running": "gauge",
    "vsurge_requests_waiting": "gauge",
    "vsurge_requests_finished": "counter",
    "vsurge_prompt_tokens": "counter",
    "vsurge_generation_tokens": "counter",
    "vsurge_time_to_first_token_seconds": "histogram",
    "vsurge_time_per_output_token_seconds": "histogram",
    "vsurge_e2e_request_latency_seconds": "histogram",
    "vsurge_request_queue_time_seconds": "histogram",
    "vsurge_model_load_seconds": "gauge",
    "vsurge_compile_seconds": "gauge",
    "vsurge_kv_pages_used": "gauge",
    "vsurge_kv_pages_total": "gauge",
    "vsurge_http_requests_in_flight": "gauge",
    "vsurge_ready": "gauge",
}


def scrape(http) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from /metrics, through prometheus_client's parser."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(http) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(http.get("/metrics").text)}


def m(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted({"model": MODEL, **labels}.items()))), 0.0)


def test_metric_names_and_types(http):
    fams = families(http)
    for name, kind in REQUIRED.items():
        assert fams.get(name) == kind, (name, fams.get(name))


def test_engine_info_says_what_the_engine_runs(http):
    # the operator copies these labels into the InferenceModel's status.engine
    info = [k for k, v in scrape(http).items() if k[0] == "vsurge_engine_info" and v == 1]
    assert len(info) == 1
    labels = dict(info[0][1])
    assert labels["model"] == MODEL and labels["driver"] in ("vdriver", "odriver")
    assert labels["backend"] == "cpu" and labels["decode_steps"] == "1" and labels["attention"]


def test_metrics_move_under_load_and_return_to_zero(http, client):
    before = scrape(http)
    assert m(before, "vsurge_slots_total") == SLOTS
    assert m(before, "vsurge_compile_seconds") > 0
    n_req, n_tok = SLOTS, 100
    seen = {"slots": 0.0, "occupancy": 0.0, "running": 0.0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            s = scrape(http)
            seen["slots"] = max(seen["slots"], m(s, "vsurge_slots_used"))
            seen["occupancy"] = max(seen["occupancy"], m(s, "vsurge_slot_occupancy"))
            seen["running"] = max(seen["running"], m(s, "vsurge_requests_running"))

    def one(i):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"load {i}"}],
            max_tokens=n_tok,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return sum(1 for _ in stream)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(n_req) as pool:
            list(pool.map(one, range(n_req)))
    finally:
        stop.set()
        watcher.join()
    assert seen["slots"] >= 2 and 0 < seen["occupancy"] <= 1 and seen["running"] >= 1

    def idle():
        s = scrape(http)
        return s if m(s, "vsurge_slots_used") == 0 else None

    after = wait_for(idle)
    assert m(after, "vsurge_slot_occupancy") == 0 and m(after, "vsurge_requests_running") == 0
    assert m(after, "vsurge_prefill_queue_size") == 0 and m(after, "vsurge_ready") == 1
    assert after[("vsurge_http_requests_in_flight", ())] == 0
    gen = m(after, "vsurge_generation_tokens_total") - m(before, "vsurge_generation_tokens_total")
    assert gen >= n_req * n_tok
    assert m(after, "vsurge_prompt_tokens_total") > m(before, "vsurge_prompt_tokens_total")
    fin = m(after, "vsurge_requests_finished_total", finish_reason="length")
    assert fin - m(before, "vsurge_requests_finished_total", finish_reason="length") >= n_req
    for h in (
        "vsurge_time_to_first_token_seconds",
        "vsurge_time_per_output_token_seconds",
        "vsurge_e2e_request_latency_seconds",
    ):
        assert m(after, f"{h}_count") - m(before, f"{h}_count") >= n_req, h
    route = {"route": "/v1/chat/completions", "status": "200"}
    assert (
        m(after, "vsurge_http_requests_total", **route) - m(before, "vsurge_http_requests_total", **route)
        >= n_req
    )


def _find(exporter, trace_id: int, timeout: float = 10.0):
    def spans():
        return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]

    return wait_for(spans, timeout)


def test_spans_carry_genai_attributes_and_continue_traceparent(client, span_exporter):
    trace_id, parent_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
    header = {"traceparent": f"00-{trace_id:032x}-{parent_id:016x}-01"}
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "trace me"}],
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        extra_headers=header,
        extra_body={"ignore_eos": True},
    )
    (span,) = _find(span_exporter, trace_id)
    assert span.name == f"chat {MODEL}"
    assert span.parent is not None and span.parent.span_id == parent_id and span.parent.is_remote
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.response.id"] == r.id and tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens and a["gen_ai.usage.output_tokens"] == 5
    events = [e.name for e in span.events]
    assert events[0] == "gen_ai.request.queued" and "gen_ai.request.prefill_done" in events
    assert "gen_ai.response.first_token" in events
    assert [e.timestamp for e in span.events] == sorted(e.timestamp for e in span.events)
    assert span.start_time <= span.events[0].timestamp <= span.end_time


def test_streamed_and_failed_requests_have_spans(client, span_exporter):
    import openai

    trace_id = 0x11111111111111111111111111111111
    header = {"traceparent": f"00-{trace_id:032x}-{0x2222222222222222:016x}-01"}
    list(
        client.completions.create(
            model=MODEL,
            prompt="stream",
            max_tokens=3,
            stream=True,
            extra_headers=header,
            extra_body={"ignore_eos": True},
        )
    )
    (span,) = _find(span_exporter, trace_id)
    assert span.name == f"text_completion {MODEL}" and span.attributes["gen_ai.usage.output_tokens"] == 3
    trace_id = 0x33333333333333333333333333333333
    header = {"traceparent": f"00-{trace_id:032x}-{0x4444444444444444:016x}-01"}
    with contextlib.suppress(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x " * 300, max_tokens=3, extra_headers=header)
    (span,) = _find(span_exporter, trace_id)
    assert span.attributes["error.type"] == "context_length_exceeded"
