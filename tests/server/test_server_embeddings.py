"""/v1/embeddings and vLLM's /pooling through the real server and the official `openai` client, on the suite's
tiny random checkpoint: the pooled vector equals transformers' final hidden state (after the final norm)
for the same checkpoint in float32 (last token, and mean), normalized; float and base64 encodings agree; a
batch of strings and token arrays is answered in order, each row as if alone (padding and packing change
nothing); `dimensions` other than the hidden size, and other bad input, are 400s naming the field."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

TEXTS = ["Hello world, this is a test", "short", "another sentence that is a little bit longer than that"]


@pytest.fixture(scope="module")
def hf_hidden(tiny_dir):
    """transformers' final hidden states ([T, H] float32) of token ids, for the suite's checkpoint."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[-1][0].numpy()

    return hidden


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


def test_parity_with_transformers_last_and_mean(client, http, surge, hf_hidden):
    ids = [surge.tokenize(t) for t in TEXTS]
    r = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    assert r.usage.prompt_tokens == sum(len(x) for x in ids)
    for d, x in zip(r.data, ids, strict=True):
        v = np.asarray(d.embedding, np.float32)
        assert abs(np.linalg.norm(v) - 1) < 1e-5
        assert _cos(v, hf_hidden(x)[-1]) > 0.9999
    mean = http.post(
        "/v1/embeddings",
        json={"model": "tiny", "input": TEXTS[0], "pooling_type": "mean", "normalize": False},
    ).json()["data"][0]["embedding"]
    want = hf_hidden(ids[0]).mean(axis=0)
    assert _cos(np.asarray(mean), want) > 0.9999
    assert np.allclose(np.asarray(mean), want, atol=1e-4)  # unnormalized: the very values


def test_token_arrays_base64_and_batch_order(client, surge):
    ids = [surge.tokenize(t) for t in TEXTS]
    floats = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    b64 = client.embeddings.create(model="tiny", input=ids, encoding_format="base64")
    for f, b in zip(floats.data, b64.data, strict=True):  # asked for base64, the client hands it over as is
        vec = np.frombuffer(base64.b64decode(b.embedding), "<f4")
        assert np.allclose(np.asarray(f.embedding, np.float32), vec, atol=1e-6)
    # the client's default (no encoding_format): it asks for base64 and decodes it itself
    default = client.embeddings.create(model="tiny", input=ids)
    assert np.allclose(default.data[0].embedding, floats.data[0].embedding, atol=1e-6)
    # one at a time == in a batch (rows are padded and packed differently)
    alone = client.embeddings.create(model="tiny", input=ids[2], encoding_format="float").data[0].embedding
    assert np.allclose(alone, floats.data[2].embedding, atol=1e-5)


def test_pooling_route_vllm_shape(http):
    r = http.post("/pooling", json={"model": "tiny", "input": ["a b", "c"]}).json()
    assert r["object"] == "list" and r["id"].startswith("pool-")
    assert [d["object"] for d in r["data"]] == ["pooling", "pooling"] and len(r["data"][0]["data"]) > 8


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "dimensions": 3}, "dimensions"),
        ({"input": []}, "input"),
        ({}, "input"),
        ({"input": [""]}, "input"),
        ({"input": [[1, 2], [10**9]]}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "pooling_type": "cls"}, "pooling_type"),
        ({"input": "word " * 300}, "input"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "x", "normalize": "yes"}, "normalize"),
    ],
)
def test_bad_input_is_400_naming_the_field(http, body, param):
    r = http.post("/v1/embeddings", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_dimensions_of_the_hidden_size_and_truncation(client, http, surge):
    pooler = surge.pooler()
    dim = pooler.dim
    # a batch never holds more tokens than one prefill of the largest bucket (what a decode step may wait on)
    assert all(t * rows <= max(pooler.buckets) for t, rows in pooler.rows.items())
    # the prefill buckets' powers of two and the largest: each is the whole model, compiled at start
    lengths = surge._engine.prefill_lengths
    assert pooler.buckets[-1] == max(lengths) and set(pooler.buckets) <= set(lengths)
    assert all(t & (t - 1) == 0 for t in pooler.buckets[:-1])
    r = client.embeddings.create(model="tiny", input="x", dimensions=dim, encoding_format="float")
    assert len(r.data[0].embedding) == dim
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny", input="x", dimensions=dim - 1)
    long = "word " * 300
    cut = http.post(
        "/v1/embeddings", json={"model": "tiny", "input": long, "truncate_prompt_tokens": 20}
    ).json()
    assert cut["usage"]["prompt_tokens"] == 20


def test_counted_and_traced(client, http, span_exporter):
    client.embeddings.create(model="tiny", input="count me")
    assert 'route="/v1/embeddings",status="200"' in http.get("/metrics").text
    assert any(s.name == "embeddings tiny" for s in span_exporter.get_finished_spans())


def test_what_vllm_embedding_tests_read(client, http, surge):
    """vLLM's own embedding tests (tests/entrypoints/openai/embedding_tests), their checks restated: id,
    created, completion_tokens 0, token counts of token-id inputs, truncation, chat `messages` equal to the
    rendered prompt embedded without added special tokens, and normalize."""
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": [[4, 5, 7, 9, 20], [15, 29]]}).json()
    assert r["id"].startswith("embd-") and isinstance(r["created"], int)
    assert r["usage"] == {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}
    messages = [
        {"role": "user", "content": "The cat sat."},
        {"role": "assistant", "content": "A feline rested."},
    ]
    chat = http.post("/v1/embeddings", json={"model": "tiny", "messages": messages}).json()
    prompt = surge.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    plain = client.embeddings.create(
        model="tiny", input=prompt, encoding_format="float", extra_body={"add_special_tokens": False}
    )
    assert chat["usage"] == plain.usage.model_dump()
    assert np.allclose(chat["data"][0]["embedding"], plain.data[0].embedding, atol=1e-6)
    both = http.post("/v1/embeddings", json={"model": "tiny", "messages": messages, "input": "x"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "messages"
    bad = http.post("/v1/embeddings", json={"model": "tiny", "messages": [{"content": "no role"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("messages")


def test_the_paged_engine_pools_the_same(tiny_dir, surge, hf_hidden):
    """The pooling program reads only the engine's weights: the odriver's engine gives the same vectors."""
    from server_helpers import make_odriver_surge

    paged = make_odriver_surge(tiny_dir)
    try:
        ids = [surge.tokenize(t) for t in TEXTS]
        vecs = paged.pooler().pool(ids, "last")
        for v, x in zip(vecs, ids, strict=True):
            assert _cos(v, hf_hidden(x)[-1]) > 0.9999
    finally:
        paged.stop()
