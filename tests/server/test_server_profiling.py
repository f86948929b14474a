"""Why a step is slow: each engine step's device and host seconds on /metrics, by program kind
(drivers/step_timing.py; vsurge_step_device_seconds, vsurge_step_host_seconds)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL, make_odriver_surge, serve_surge


def step_counts(text: str) -> dict[tuple[str, str], tuple[float, float]]:
    """{(device | host, kind): (count, sum)} of the step histograms of MODEL."""
    out: dict[tuple[str, str], list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name not in ("vsurge_step_device_seconds", "vsurge_step_host_seconds"):
            continue
        what = fam.name.split("_")[2]
        for s in fam.samples:
            if s.labels.get("model") != MODEL or not s.name.endswith(("_count", "_sum")):
                continue
            entry = out.setdefault((what, s.labels["kind"]), [0.0, 0.0])
            entry[s.name.endswith("_sum")] = s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def grown(before: dict, after: dict) -> dict[tuple[str, str], tuple[float, float]]:
    """The series whose count grew: (steps, seconds) added."""
    zero = (0.0, 0.0)
    return {
        k: (after[k][0] - before.get(k, zero)[0], after[k][1] - before.get(k, zero)[1])
        for k in after
        if after[k][0] > before.get(k, zero)[0]
    }


def _generate(url: str, n: int = 3) -> None:
    for i in range(n):
        body = {"model": MODEL, "prompt": f"Tell me about step {i}", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text


def _check(added: dict, kinds: set[str]) -> None:
    for kind in kinds:
        for what in ("device", "host"):
            steps, seconds = added.get((what, kind), (0, 0))
            assert steps >= 1 and seconds > 0, (what, kind, added)


def test_vdriver_steps_are_timed_by_kind(server, http):
    """The suite's vDriver: prefill calls (prefill thread, read by the transfer thread) and decode steps
    (step thread, read by the detokenizer)."""
    before = step_counts(http.get("/metrics").text)
    _generate(server.url)
    added = grown(before, step_counts(http.get("/metrics").text))
    _check(added, {"prefill", "decode"})
    assert {kind for _, kind in added} <= {"prefill", "decode"}, added
    steps, _ = added[("device", "decode")]
    assert steps >= 3 * 6  # 8 tokens each: the first from the prefill, most of the rest one step each


@pytest.fixture(scope="module")
def odriver_server(tiny_dir):
    running = serve_surge(make_odriver_surge(tiny_dir))
    yield running
    running.stop()


def test_odriver_steps_are_timed_by_kind(odriver_server):
    """oDriver prefills in its steps: a prompt's chunks alone are a `prefill` step, beside decoding rows
    a `mixed` one; the rest `decode`. Prompts sent while a long stream decodes make mixed steps."""
    url = odriver_server.url
    before = step_counts(httpx.get(f"{url}/metrics", timeout=60).text)
    long = {"model": MODEL, "prompt": "Count on", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # decoding now
        _generate(url, 2)
        for _ in lines:
            pass
    added = grown(before, step_counts(httpx.get(f"{url}/metrics", timeout=60).text))
    _check(added, {"prefill", "mixed", "decode"})
    assert {kind for _, kind in added} <= {"prefill", "mixed", "decode"}, added
