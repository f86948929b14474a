"""n-gram speculative decoding through the real server (`speculative="ngram"` on vDriver).

A second vSurge over the session's tiny model runs with speculation; every answer is compared with the
session server's (the same model without it), through the official openai client. The tiny random model
falls into loops quickly, so drafts are proposed and accepted in most steps: the comparisons exercise
verify steps, not only plain decode steps (the acceptance counters prove it).
"""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL, make_surge, wait_for

K = 3
PROMPTS = [
    "hello world hello world hello world",
    "the cat sat on the mat and the cat sat on the",
    "one two three four five six seven",
    "a b a b a b a b",
    "Quote this: the quick brown fox jumps over the lazy dog. Again: the quick brown",
]


@pytest.fixture(scope="module")
def spec_surge(tiny_dir):
    s = make_surge(tiny_dir, speculative="ngram", num_speculative_tokens=K)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def spec_server(spec_surge):
    from vsurge.server import start, vSurgeApiServer

    api = vSurgeApiServer({MODEL: spec_surge}, owns_engines=False)
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=False, progress=None)
    api.warm_up()  # compiles the verify programs with the rest
    yield running
    running.stop()


@pytest.fixture(scope="module")
def spec_client(spec_server):
    return openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def spec_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("vsurge_spec_decode") and s.labels.get("model") == MODEL
    }


def complete(client, prompt: str, **kw):
    r = client.completions.create(model=MODEL, prompt=prompt, **kw)
    return [(c.text, c.finish_reason) for c in r.choices], r.usage.completion_tokens


def both(client, spec_client, prompts, **kw):
    """Each prompt on both servers, all at once (so verify steps run with several live rows)."""
    with concurrent.futures.ThreadPoolExecutor(2 * len(prompts)) as pool:
        plain = [pool.submit(complete, client, p, **kw) for p in prompts]
        spec = [pool.submit(complete, spec_client, p, **kw) for p in prompts]
        return [f.result() for f in plain], [f.result() for f in spec]


def test_greedy_output_is_identical_and_drafts_are_accepted(client, spec_client, spec_server):
    before = spec_metrics(spec_server.url)
    plain, spec = both(
        client, spec_client, PROMPTS, max_tokens=100, temperature=0, extra_body={"ignore_eos": True}
    )
    assert spec == plain
    assert all(n == 100 for _, n in spec)
    after = spec_metrics(spec_server.url)
    drafted = after["vsurge_spec_decode_draft_tokens_total"] - before.get(
        "vsurge_spec_decode_draft_tokens_total", 0
    )
    accepted = after["vsurge_spec_decode_accepted_tokens_total"] - before.get(
        "vsurge_spec_decode_accepted_tokens_total", 0
    )
    assert drafted > 0 and 0 < accepted <= drafted
    assert 0 < after["vsurge_spec_decode_acceptance_rate"] <= 1


def test_stops_inside_a_draft_end_where_plain_decoding_ends(client, spec_client):
    # stop strings taken from the plain output itself, so they do occur, often inside an accepted draft
    [(text, _)], _ = complete(
        client, PROMPTS[3], max_tokens=60, temperature=0, extra_body={"ignore_eos": True}
    )
    stops = [text[20:23], text[41:44]]
    for kw in (
        {"max_tokens": 7},
        {"max_tokens": 50, "stop": stops},
        {
            "max_tokens": 50,
            "extra_body": {"ignore_eos": True, "stop_token_ids": [int(t) for t in range(3, 9)]},
        },
    ):
        plain, spec = both(client, spec_client, PROMPTS, temperature=0, **kw)
        assert spec == plain, kw


def test_streaming_gives_the_same_text(client, spec_client):
    def stream(c):
        chunks = c.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=80,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)

    assert stream(spec_client) == stream(client)


def test_requests_that_do_not_speculate_decode_as_without_it(client, spec_client):
    # logprobs and top_k requests never get drafts: the same tokens and logprobs as the plain server,
    # while greedy requests in the same steps do speculate
    kw = {"max_tokens": 40, "temperature": 0, "logprobs": 3, "extra_body": {"ignore_eos": True}}

    def with_logprobs(c):
        r = c.completions.create(model=MODEL, prompt=PROMPTS[1], **kw)
        lp = r.choices[0].logprobs
        return r.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(complete, spec_client, p, max_tokens=60, temperature=0) for p in PROMPTS[:2]]
        spec = with_logprobs(spec_client)
        [f.result() for f in busy]
    plain = with_logprobs(client)
    assert spec[:2] == plain[:2]
    assert spec[2] == pytest.approx(plain[2], abs=1e-4)
    for a, b in zip(spec[3], plain[3], strict=True):
        assert a.keys() == b.keys()
    sampled = {
        "max_tokens": 30,
        "temperature": 1.0,
        "seed": 5,
        "extra_body": {"top_k": 4, "ignore_eos": True},
    }
    assert complete(spec_client, PROMPTS[2], **sampled) == complete(client, PROMPTS[2], **sampled)


def test_sampled_requests_speculate_and_finish(spec_client, spec_surge):
    # temperature alone: rejection sampling; the exact distribution is tested at the engine level
    # (tests/service/test_speculative.py); here: lengths, n > 1, and every slot back at the end
    r = spec_client.completions.create(
        model=MODEL,
        prompt=PROMPTS[3],
        max_tokens=45,
        temperature=0.7,
        n=3,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    assert r.usage.completion_tokens == 3 * 45
    wait_for(lambda: spec_surge.metrics().slots_used == 0)


def test_plain_server_has_no_speculation_metrics(server):
    assert spec_metrics(server.url) == {}
