"""Checks of vLLM's own OpenAI-API tests (tests/entrypoints/openai in the vLLM repository) that our server
failed, restated against the suite's server on the tiny model: /invocations answers what the route it
dispatches to answers, key for key as the `openai` client parses it (chat, and an embeddings body), and a
completion's legacy `top_logprobs` start with the token at that place (vLLM's order), echo included, with
between max(N, 1) and N + 1 entries."""

from __future__ import annotations

import numpy as np
import pytest

MESSAGES = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "1+1?"}]


def test_invocations_chat_equals_the_client_parsed_chat(client, http):
    args = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_completion_tokens": 5,
        "temperature": 0.0,
        "logprobs": False,
    }
    chat = client.chat.completions.create(**args).model_dump()
    invoked = http.post("/invocations", json=args).json()
    assert chat.keys() == invoked.keys()
    assert chat["choices"] == invoked["choices"]  # tool_calls included: null on both sides


def test_invocations_embedding_bodies(http):
    body = {"model": "tiny", "input": ["The chef prepared a meal."], "encoding_format": "float"}
    direct = http.post("/v1/embeddings", json=body).json()
    invoked = http.post("/invocations", json=body).json()
    assert direct.keys() == invoked.keys() and direct["data"][0].keys() == invoked["data"][0].keys()
    assert np.allclose(direct["data"][0]["embedding"], invoked["data"][0]["embedding"], atol=1e-6)
    chat_body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "encoding_format": "float"}
    assert http.post("/invocations", json=chat_body).json()["data"][0]["object"] == "embedding"


@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("prompt", ["Hello, my name is", [0, 0, 0, 0, 0]])
def test_top_logprobs_start_with_the_token_at_that_place(client, n, prompt):
    done = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0.0, echo=True, logprobs=n
    )
    lp = done.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for token, top, value in zip(lp.tokens[1:], lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True):
        # at most N + 1; fewer only where tokens decode alike (the tiny tokenizer's lone bytes all read as
        # U+FFFD and share one key, in vLLM's answer too)
        assert 1 <= len(top) <= n + 1 and (len(top) >= max(n, 1) or "\ufffd" in top)
        first = next(iter(top))
        assert first == token and top[first] == pytest.approx(value)
