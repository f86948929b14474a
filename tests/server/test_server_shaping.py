"""Response shaping as pure functions: OpenAI's shapes, SSE framing, logprobs without -inf."""

from __future__ import annotations

import dataclasses
import json

from vsurge.contracts.request import ReturnSample, TokenLogprob
from vsurge.server.shaping import (
    SSE_DONE,
    ChunkWriter,
    Collector,
    Extras,
    chat_response,
    completion_response,
    token_id_string,
)


def decode(token_id: int) -> str:
    return {1: "Hel", 2: "lo", 3: "!", 4: "é"}.get(token_id, "?")


def frames(raw: bytes) -> list[dict]:
    out = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: ")
        out.append(json.loads(block[6:]))
    return out


def samples():
    lp = [
        TokenLogprob(1, -0.5, [(1, -0.5), (2, float("-inf"))]),
        TokenLogprob(2, -1.0, [(2, -1.0), (3, -2.0)]),
    ]
    return [
        [ReturnSample("Hel", [1], index=0, num_generated_tokens=1, num_prompt_tokens=5, logprobs=lp[:1])],
        [
            ReturnSample(
                "lo",
                [2],
                index=0,
                finish_reason="length",
                num_generated_tokens=2,
                num_prompt_tokens=5,
                logprobs=lp[1:],
            )
        ],
    ]


def test_chat_response_shape():
    col = Collector(1)
    for s in samples():
        col.add(s)
    obj = chat_response("chatcmpl-1", 7, "m", col.choices, col.prompt_tokens, decode, with_logprobs=True)
    assert obj["object"] == "chat.completion" and obj["model"] == "m" and obj["created"] == 7
    (choice,) = obj["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": "Hello",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning_content": None,
        "reasoning": None,
        "tool_calls": None,
    }
    # vLLM's fields are present, null when not asked: clients read them as attributes
    assert choice["token_ids"] is None and choice["stop_reason"] is None
    assert obj["prompt_token_ids"] is None and obj["prompt_logprobs"] is None and "service_tier" in obj
    assert choice["finish_reason"] == "length"
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == ["Hel", "lo"]
    assert entries[0]["bytes"] == list(b"Hel")
    assert entries[0]["top_logprobs"][1]["logprob"] == -9999.0  # -inf is not JSON
    assert obj["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    json.dumps(obj, allow_nan=False)


def test_completion_response_with_echo_and_offsets():
    col = Collector(1)
    for s in samples():
        col.add(s)
    obj = completion_response(
        "cmpl-1", 7, "m", col.choices, 5, decode, with_logprobs=True, with_top=True, echo_prefixes=["Say: "]
    )
    (choice,) = obj["choices"]
    assert obj["object"] == "text_completion"
    assert choice["text"] == "Say: Hello"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["Hel", "lo"] and lp["text_offset"] == [5, 8]
    assert lp["top_logprobs"][0] == {"Hel": -0.5, "lo": -9999.0}


def test_completion_top_logprobs_hold_the_sampled_token():
    # OpenAI: logprobs=N gives up to N + 1 entries, the sampled token among them; logprobs=0 gives it alone
    col = Collector(1)
    col.add(
        [
            ReturnSample(
                "lo", [2], index=0, num_generated_tokens=1, logprobs=[TokenLogprob(2, -1.5, [(1, -0.2)])]
            )
        ]
    )
    obj = completion_response("c", 1, "m", col.choices, 1, decode, with_logprobs=True)
    assert obj["choices"][0]["logprobs"]["top_logprobs"] == [{"Hel": -0.2, "lo": -1.5}]
    col = Collector(1)
    col.add([ReturnSample("lo", [2], index=0, num_generated_tokens=1, logprobs=[TokenLogprob(2, -1.5, [])])])
    obj = completion_response("c", 1, "m", col.choices, 1, decode, with_logprobs=True)
    assert obj["choices"][0]["logprobs"]["top_logprobs"] == [{"lo": -1.5}]
    assert obj["choices"][0]["logprobs"]["token_logprobs"] == [-1.5]


def test_echo_logprobs_and_prompt_logprobs_entries():
    prompt_lps = [None, TokenLogprob(2, -0.7, [(1, -0.1)], rank=3)]
    first = ReturnSample(
        "!",
        [3],
        index=0,
        num_generated_tokens=1,
        num_prompt_tokens=2,
        logprobs=[TokenLogprob(3, -0.3, [(3, -0.3)])],
        prompt_token_ids=[1, 2],
        prompt_logprobs=prompt_lps,
        num_cached_tokens=1,
    )
    col = Collector(1)
    col.add([first])
    obj = completion_response(
        "c",
        1,
        "m",
        col.choices,
        2,
        decode,
        with_logprobs=True,
        echo_prefixes=["Hello"],
        collectors=[col],
        extras=Extras(return_token_ids=True, prompt_logprobs=True, cached_tokens=col.cached_tokens),
    )
    (choice,) = obj["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == "Hello!"
    assert lp["tokens"] == ["Hel", "lo", "!"]
    assert lp["token_logprobs"] == [None, -0.7, -0.3]
    assert lp["top_logprobs"] == [None, {"Hel": -0.1, "lo": -0.7}, {"!": -0.3}]
    assert lp["text_offset"] == [0, 3, 5]
    assert choice["prompt_logprobs"] == [
        None,
        {
            "1": {"logprob": -0.1, "rank": 1, "decoded_token": "Hel"},
            "2": {"logprob": -0.7, "rank": 3, "decoded_token": "lo"},
        },
    ]
    assert choice["prompt_token_ids"] == [1, 2] and choice["token_ids"] == [3]
    assert obj["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_chat_stream_frames_and_usage():
    w = ChunkWriter(
        operation="chat",
        response_id="chatcmpl-1",
        created=7,
        model="m",
        decode=decode,
        with_logprobs=False,
        with_top=False,
        include_usage=True,
    )
    raw = w.role_frames([0]) + b"".join(w.frames(s) for s in samples()) + w.usage_frame() + SSE_DONE
    assert raw.endswith(b"data: [DONE]\n\n")
    objs = frames(raw[: -len(SSE_DONE)])
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [o["choices"][0]["delta"].get("content") for o in objs[1:3]] == ["Hel", "lo"]
    assert objs[2]["choices"][0]["finish_reason"] == "length"
    assert all(o["object"] == "chat.completion.chunk" and o["usage"] is None for o in objs[:-1])
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["total_tokens"] == 7


def test_empty_deltas_are_skipped_and_completion_chunks():
    w = ChunkWriter(
        operation="text_completion",
        response_id="cmpl-1",
        created=7,
        model="m",
        decode=decode,
        with_logprobs=False,
        with_top=False,
        include_usage=False,
    )
    held = [ReturnSample("", [4], index=0, num_generated_tokens=1)]  # half a character held back
    assert w.frames(held) == b""
    out = frames(w.frames([ReturnSample("é", [4], index=0, finish_reason="stop", num_generated_tokens=2)]))
    assert out[0]["object"] == "text_completion" and out[0]["choices"][0]["text"] == "é"
    assert "usage" not in out[0]
    assert w.usage_frame() == b""


def test_completion_fields_are_null_unless_asked_and_stop_reason_names_the_stop_token():
    col = Collector(1)
    col.add([ReturnSample("!", [3], index=0, finish_reason="stop", num_generated_tokens=1)])
    obj = completion_response("c", 1, "m", col.choices, 1, decode, with_logprobs=False, collectors=[col])
    (choice,) = obj["choices"]
    for key in ("token_ids", "prompt_token_ids", "prompt_logprobs", "stop_reason", "logprobs"):
        assert key in choice and choice[key] is None, key
    obj = completion_response(
        "c",
        1,
        "m",
        col.choices,
        1,
        decode,
        False,
        collectors=[col],
        extras=Extras(stop_token_ids=frozenset({3})),
    )
    assert obj["choices"][0]["stop_reason"] == 3  # ended on a client stop token: vLLM names it


def test_chat_stream_first_chunk_carries_prompt_ids_and_every_delta_has_content():
    w = ChunkWriter(
        operation="chat",
        response_id="chatcmpl-1",
        created=7,
        model="m",
        decode=token_id_string,
        with_logprobs=True,
        with_top=True,
        include_usage=False,
        extras=Extras(return_token_ids=True, tokens_as_ids=True, echo="Sure, "),
    )
    first, second = samples()
    first = [dataclasses.replace(first[0], prompt_token_ids=[7, 8])]
    objs = frames(w.role_frames([0], first[0]) + w.frames(first) + w.frames(second))
    assert objs[0]["prompt_token_ids"] == [7, 8]  # the role chunk, the first of the stream
    assert all("prompt_token_ids" not in o for o in objs[1:])
    assert objs[1]["choices"][0]["delta"] == {"content": "Sure, "}  # chat echo follows the role chunk
    assert [o["choices"][0]["delta"]["content"] for o in objs[2:]] == ["Hel", "lo"]
    entry = objs[2]["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:1" and entry["bytes"] is None  # return_tokens_as_token_ids
    assert objs[2]["choices"][0]["token_ids"] == [1]
    assert objs[3]["choices"][0]["finish_reason"] == "length" and objs[3]["choices"][0]["stop_reason"] is None
