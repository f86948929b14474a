"""Why a step is slow: each engine step's device and host seconds on /metrics, by program kind
(drivers/step_timing.py; vsurge_step_device_seconds, vsurge_step_host_seconds), and a jax.profiler trace
of N seconds of serving on demand (POST /debug/profile, server/profile_routes.py)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from patience import ceiling
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


# ------------------------------------------------------------------------------ POST /debug/profile

ADMIN = "admin-key-for-profiles"


def jit_names(surge, *prefixes: str) -> set[str]:
    """The jit names (as a trace shows them) of the engine's programs whose inventory names start with
    one of ``prefixes`` (engines/program_inventory.py)."""
    from vsurge.engines.program_inventory import programs

    listed = programs(surge.driver.engines[0])
    return {f"jit_{p.fn.__name__}" for p in listed if p.name.startswith(prefixes)}


@pytest.fixture(scope="module")
def profiled(server, surge, tmp_path_factory):
    """A second server over the suite's running engine, with a profile directory and an admin key."""
    from vsurge.server import start, vSurgeApiServer

    directory = tmp_path_factory.mktemp("profiles")
    api = vSurgeApiServer({MODEL: surge}, owns_engines=False, admin_key=ADMIN, profile_dir=str(directory))
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=False, progress=None)
    api.mark_ready()
    yield running
    running.stop()


def _profile(url: str, seconds: str = "2", key: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/debug/profile", params={"seconds": seconds}, headers=headers, timeout=300)


def test_a_trace_of_serving_names_the_engines_programs(profiled, surge):
    """N seconds of serving traced: the .xplane.pb file is there, and the engine's decode, prefill and
    insert programs ran in it, by their jit names (read back with jax's own trace reader, and as raw
    bytes). Seen: jit__decode_impl 210 runs, jit__prefill_{embed,layer,finish}_impl, jit__insert_impl,
    jit__firsts_impl in 3 s of requests one after another."""
    import threading

    from vsurge.server.trace_programs import programs

    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            _generate(profiled.url, 1)

    worker = threading.Thread(target=load)
    worker.start()
    try:
        r = _profile(profiled.url, "3")
    finally:
        stop.set()
        worker.join(120)
    assert r.status_code == 200, r.text
    body = r.json()
    trace = Path(body["trace"])
    assert trace.is_file() and trace.name.endswith(".xplane.pb") and body["seconds"] == 3
    listed = {p["name"]: p for p in programs(trace)}
    print("\nprograms in the trace:\n" + "\n".join(f"  {p}" for p in programs(trace)))
    assert [p["name"] for p in body["programs"]] == list(listed)  # the answer lists the same
    raw = trace.read_bytes()
    wanted = jit_names(surge, "decode slots", "prefill bucket", "insert from prefill bucket")
    assert len(wanted) >= 5, wanted  # decode; the prefill chain's embed, layer, finish; insert
    for name in wanted:
        assert name in listed and listed[name]["executions"] >= 1, (name, sorted(listed))
        assert name.encode() in raw


def test_profile_requests_that_cannot_run_say_why(server, profiled):
    off = _profile(server.url, "1", key=None)  # the suite's server: no profile directory
    assert off.status_code == 404 and off.json()["error"]["code"] == "profiling_disabled"
    assert "--profile-dir" in off.json()["error"]["message"]
    assert _profile(profiled.url, "1", key="not-the-admin-key").status_code == 401
    for bad in ("abc", "0", "-1", "nan", "1e9", ""):
        r = _profile(profiled.url, bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seconds", (bad, r.text)
    r = httpx.post(f"{profiled.url}/debug/profile", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seconds"


def test_one_trace_at_a_time(profiled):
    """Two requests that overlap: one traces, the other gets 409 (whichever reached the server first
    wins; on a loaded machine the two may not overlap at all, and the pair is sent again)."""
    import concurrent.futures

    deadline = time.monotonic() + ceiling(30)
    while True:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long = pool.submit(_profile, profiled.url, "3")
            time.sleep(0.5)
            short = pool.submit(_profile, profiled.url, "1")
            answers = [long.result(), short.result()]
        if any(r.status_code != 200 for r in answers) or time.monotonic() > deadline:
            break
    assert sorted(r.status_code for r in answers) == [200, 409], [r.text for r in answers]
    busy = next(r for r in answers if r.status_code == 409)
    assert busy.json()["error"]["code"] == "profile_in_progress"


def test_serve_takes_the_profile_dir_from_its_flag_or_variable(tmp_path):
    from vsurge.cli.main import build_api, parse_serve_config

    flag, var = str(tmp_path / "flag"), str(tmp_path / "var")
    assert parse_serve_config(["--profile-dir", flag], env={"VSURGE_PROFILE_DIR": var}).profile_dir == flag
    assert parse_serve_config([], env={"VSURGE_PROFILE_DIR": var}).profile_dir == var
    assert parse_serve_config([], env={}).profile_dir is None
    api = build_api(parse_serve_config(["--profile-dir", flag], env={}))
    assert api.profile_dir == flag and (tmp_path / "flag").is_dir()  # made at start: a bad path fails there
    assert build_api(parse_serve_config([], env={})).profile_dir is None
