"""The router forwards the newer APIs to the pod as it does chat: /v1/responses (whole and streamed),
Anthropic's /v1/messages and count_tokens, /v1/embeddings, /pooling and the gateway's render routes, each
through a real router in front of a real vSurgeApiServer (the server suite's tiny model and shapes), with
the official clients; and the usage it reads from their answers (Responses' and Anthropic's names)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
import yaml
from router_helpers import REPO, RunningRouter, ThreadedServer

from vsurge.router.usage import UsageScanner, usage_of

sys.path.insert(0, str(REPO / "tests" / "server"))
from server_helpers import MODEL, make_surge  # noqa: E402
from tiny_models import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    from vsurge.router.app import build_app
    from vsurge.router.config import RouterConfig
    from vsurge.server import start, vSurgeApiServer

    root = tmp_path_factory.mktemp("router-apis")
    make_checkpoint(root / "tiny", "llama", seed=0)
    surge = make_surge(str(root / "tiny"))
    server = start(vSurgeApiServer({MODEL: surge}), host="127.0.0.1", port=0, metrics_port=-1, progress=None)
    server.wait_ready(600)
    config = root / "static.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": MODEL, "upstreams": [server.url]}]}))
    cfg = RouterConfig(
        host="127.0.0.1", port=0, static_config=str(config), kubernetes=False, load_poll_seconds=0
    )
    router = RunningRouter(ThreadedServer(build_app(cfg), as_router=True).start(), None)
    try:
        yield router.url, server.url
    finally:
        router.server.stop()
        server.stop()
        surge.stop()


def test_responses_and_embeddings_through_the_router(routed) -> None:
    url, _ = routed
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, temperature=0)
    assert r.usage.output_tokens == 3 and r.output_text
    kinds = [
        e.type for e in client.responses.create(model=MODEL, input="hi", max_output_tokens=3, stream=True)
    ]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    e = client.embeddings.create(model=MODEL, input=["a", "b c"])
    assert len(e.data) == 2 and len(e.data[0].embedding) > 8
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input="x", dimensions=1)
    assert err.value.body["param"] == "dimensions"


def test_messages_pooling_and_render_through_the_router(routed) -> None:
    url, server_url = routed
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    m = claude.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert m.usage.output_tokens == 3
    with claude.messages.stream(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    assert final.usage.output_tokens == 3
    n = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    with httpx.Client(timeout=60) as http:
        pooled = http.post(f"{url}/pooling", json={"model": MODEL, "input": "a"})
        assert pooled.status_code == 200 and pooled.json()["data"][0]["object"] == "pooling"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        via_router = http.post(f"{url}/v1/chat/completions/render", json=body).json()
        direct = http.post(f"{server_url}/v1/chat/completions/render", json=body).json()
        assert via_router["token_ids"] == direct["token_ids"]
        assert (
            http.post(f"{url}/v1/completions/render", json={"model": MODEL, "prompt": "x"}).status_code == 200
        )


def test_usage_read_from_the_newer_shapes() -> None:
    assert usage_of({"usage": {"input_tokens": 5, "output_tokens": 2}}).total == 7
    event = {"type": "response.completed", "response": {"usage": {"input_tokens": 4, "output_tokens": 3}}}
    assert usage_of(event).total == 7
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 2, "cache_read_input_tokens": 3}}}
    assert usage_of(start).prompt_tokens == 5
    scanner = UsageScanner(stream=True)
    scanner.feed(b'event: message_delta\ndata: {"usage": {"input_tokens": 6, "output_tokens": 9}}\n\n')
    assert (scanner.usage.prompt_tokens, scanner.usage.completion_tokens) == (6, 9)
