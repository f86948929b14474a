"""The official `openai` client against the real server on loopback, over a real vSurge on a tiny model."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_helpers import MAX_LENGTH, MODEL, SLOTS

from vsurge.contracts.sampling_params import SamplingParams

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world"}]


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(**kw)


async def chat_async(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 12)
    return await client.chat.completions.create(**kw)


def test_chat_non_streaming_shape(client):
    r = chat(client, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    (c,) = r.choices
    assert c.index == 0 and c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def in_process(surge, prompt: str, max_tokens: int):
    (out,) = asyncio.run(surge.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens)))
    return out


def test_greedy_text_equals_vsurge_in_process(client, surge):
    """What the API returns is exactly what vSurge generates for the chat-templated prompt."""
    api = chat(client, temperature=0, max_tokens=24)
    prompt = surge.processor.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    direct = in_process(surge, prompt, 24)
    assert api.choices[0].message.content == direct.text
    assert api.usage.completion_tokens == direct.num_generated_tokens
    comp = client.completions.create(model=MODEL, prompt="The capital of", max_tokens=16, temperature=0)
    direct = in_process(surge, "The capital of", 16)
    assert comp.choices[0].text == direct.text


def test_chat_streaming_matches_non_streaming(client):
    full = chat(client, temperature=0, max_tokens=20, extra_body={"ignore_eos": True})
    chunks = list(chat(client, temperature=0, max_tokens=20, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.id == chunks[0].id and ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.usage is None for ch in chunks)  # no include_usage: no usage anywhere


def test_include_usage(client):
    chunks = list(
        chat(
            client,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(ch.usage is None for ch in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + 8


def test_n_greater_than_one(client):
    r = chat(client, n=3, temperature=1.0, seed=7, max_tokens=10)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    chunks = list(chat(client, n=3, temperature=1.0, seed=7, max_tokens=10, stream=True))
    streamed = {i: "" for i in range(3)}
    finished = set()
    for ch in chunks:
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert streamed == {c.index: c.message.content for c in r.choices}  # same seed, same samples
    comp = client.completions.create(model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=4)
    assert sorted(c.index for c in comp.choices) == [0, 1, 2, 3]


def test_seed_reproducibility(client):
    a = chat(client, temperature=1.0, seed=1234, max_tokens=16)
    b = chat(client, temperature=1.0, seed=1234, max_tokens=16)
    c = chat(client, temperature=1.0, seed=4321, max_tokens=16)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content


def test_stop_strings(client):
    base = (
        chat(client, temperature=0, max_tokens=30, extra_body={"ignore_eos": True}).choices[0].message.content
    )
    stop = base[6:9]
    assert stop and stop in base
    r = chat(client, temperature=0, max_tokens=30, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == base[: base.index(stop)]
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in chat(client, temperature=0, max_tokens=30, stop=stop, stream=True)
    )
    assert streamed == base[: base.index(stop)]


def test_logprobs(client):
    r = chat(
        client, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
    )
    entries = r.choices[0].logprobs.content
    assert len(entries) == 6
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs), abs=1e-5)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    comp = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    # OpenAI: up to logprobs + 1 entries, the sampled token among them
    assert lp.text_offset[0] == 0 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert all(tok in top for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    streamed = list(chat(client, max_tokens=4, logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    assert (
        sum(len(ch.choices[0].logprobs.content) for ch in streamed if ch.choices and ch.choices[0].logprobs)
        == 4
    )


def test_completions_forms_and_echo(client, surge):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, echo=True, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text.startswith("Hello")
    ids = surge.tokenize("Hello world")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=["x", "y"], max_tokens=3, stream=True))
    assert {c.index for ch in chunks for c in ch.choices} == {0, 1}


def test_models_and_token_routes(client, http, surge):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    tok = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tok["tokens"] == surge.tokenize("Hello world") and tok["max_model_len"] == MAX_LENGTH
    detok = http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
    assert detok["prompt"] == "Hello world"
    count = http.post("/v1/count_tokens", json={"model": MODEL, "conversation": MESSAGES}).json()
    assert count == {"model": MODEL, "count": surge.count_tokens(MESSAGES)}
    count = http.post("/v1/count_tokens", json={"model": MODEL, "conversation": "Hello world"}).json()
    assert count["count"] == len(tok["tokens"])
    chat_tok = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert chat_tok["count"] == surge.count_tokens(MESSAGES)


def test_errors_arrive_as_openai_exceptions(client, base_url):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, temperature=5)
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=[{"role": "user", "content": "word " * 400}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=[{"type": "function", "function": {"name": "f", "parameters": []}}])
    assert e.value.body["param"] == "tools[0].function.parameters"
    with pytest.raises(openai.BadRequestError) as e:
        chat(
            client,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
        )
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="no-such-model")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # a prompt that does not fit also gets its status on a stream, before any event
    with pytest.raises(openai.BadRequestError):
        list(chat(client, messages=[{"role": "user", "content": "word " * 400}], stream=True))
    big = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        big.completions.create(model=MODEL, prompt="x" * (9 * 1024 * 1024), max_tokens=1)
    assert e.value.status_code == 413


def test_queue_full_is_429_with_retry_after(base_url, server):
    """More requests than slots + backlog + queue: the excess gets 429 and Retry-After, the rest finish."""
    c = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
    burst = 160

    # The burst must outrun what the bounded queues hold: each request asks for n=SLOTS samples, so it takes
    # every slot and the engine drains one request per 40 steps, and an asyncio client sends all of them
    # in a fraction of a second. Prefilled prompts fill the prefill queue (8), the prefill call, the
    # transfer queue (4 calls) and the backlog (16) -- about 70 requests -- and the rest must be refused.
    # (64 thread-pool clients of single-sample requests once drained as fast as they arrived in CI.)
    async def one():
        try:
            return await chat_async(c, n=SLOTS, max_tokens=40, extra_body={"ignore_eos": True})
        except openai.RateLimitError as e:
            return e

    async def all_of_them():
        try:
            return await asyncio.gather(*[one() for _ in range(burst)])
        finally:
            await c.close()

    results = asyncio.run(all_of_them())
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    done = [r for r in results if not isinstance(r, Exception)]
    assert limited, "the burst never filled the queue"
    assert limited[0].response.headers["retry-after"] == "1"
    assert limited[0].body["type"] == "rate_limit_error"
    assert done and all(r.usage.completion_tokens == 40 * SLOTS for r in done)
    assert len(limited) + len(done) == burst


def test_not_ready_is_503(surge):
    from vsurge.server import start, vSurgeApiServer

    api = vSurgeApiServer({MODEL: surge}, owns_engines=False)  # never marked ready
    running = start(api, host="127.0.0.1", port=0, metrics_port=-1, warm_up=False, progress=None)
    try:
        c = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            chat(c)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
        assert httpx.get(f"{running.url}/readiness").status_code == 503
        assert httpx.get(f"{running.url}/liveness").status_code == 200
    finally:
        running.stop()
