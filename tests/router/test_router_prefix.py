"""Prompt prefixes as chained block hashes (pure): shared leading blocks <-> shared leading hashes, the
same structure as the paged engine's page keys, and a chat that extends another renders to a text that
extends the other's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vsurge.router.prefix import block_hashes, chat_text, prompt_bytes, request_hashes, token_bytes

text_st = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
message_st = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": text_st},
    optional={"name": st.sampled_from(["ana", "bo"])},
)


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=200), b=st.binary(max_size=200), block=st.integers(1, 32))
def test_shared_leading_blocks_are_shared_leading_hashes(a: bytes, b: bytes, block: int) -> None:
    ha, hb = block_hashes(a, block), block_hashes(b, block)
    assert len(ha) == len(a) // block and len(hb) == len(b) // block
    for k in range(min(len(ha), len(hb))):
        same_prefix = a[: (k + 1) * block] == b[: (k + 1) * block]
        assert (ha[k] == hb[k]) == same_prefix


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=300), block=st.integers(1, 16), limit=st.integers(0, 30))
def test_limit_and_seed(data: bytes, block: int, limit: int) -> None:
    full = block_hashes(data, block)
    assert block_hashes(data, block, limit=limit) == full[:limit]
    other = block_hashes(data, block, seed="another-model")
    assert all(x != y for x, y in zip(full, other, strict=True))  # models never share a key


def test_token_prompts_share_router_keys_exactly_when_they_share_engine_pages() -> None:
    """The router's hash of a token-id prompt, with blocks of 4 x page_size bytes, splits where the paged
    engine's page keys split (engines/paged/paging.page_hashes)."""
    from vsurge.engines.paged.paging import page_hashes

    page = 4
    base = list(range(40))
    for cut in range(0, 41, 3):
        other = base[:cut] + [999] * (40 - cut)
        engine_same = [x == y for x, y in zip(page_hashes(base, page), page_hashes(other, page), strict=True)]
        ours = zip(
            block_hashes(token_bytes(base), 4 * page), block_hashes(token_bytes(other), 4 * page), strict=True
        )
        assert [x == y for x, y in ours] == engine_same
    assert token_bytes([1, -1, 2**31]) == bytes([1, 0, 0, 0, 255, 255, 255, 255, 0, 0, 0, 128])


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(message_st, max_size=6), more=st.lists(message_st, max_size=4))
def test_a_conversation_that_goes_on_renders_to_a_longer_prefix(messages: list, more: list) -> None:
    short, long = chat_text(messages), chat_text(messages + more)
    assert long.startswith(short)
    if more:
        assert len(long) > len(short)


def test_what_is_hashed_for_each_route() -> None:
    msgs = [{"role": "system", "content": "S" * 50}, {"role": "user", "content": "hi"}]
    chat = prompt_bytes("/v1/chat/completions", {"messages": msgs})
    assert chat is not None and chat.startswith(b"<|system|>" + b"S" * 50)
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = prompt_bytes("/v1/chat/completions", {"messages": msgs, "tools": tools})
    assert with_tools is not None and with_tools.startswith(b"<|tools|>") and with_tools.endswith(chat)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert prompt_bytes("/v1/chat/completions", {"messages": parts}) == b"<|user|>ab\n"
    assert prompt_bytes("/v1/completions", {"prompt": "héllo"}) == "héllo".encode()
    assert prompt_bytes("/v1/completions", {"prompt": [5, 6]}) == token_bytes([5, 6])
    assert prompt_bytes("/v1/completions", {"prompt": ["first", "second"]}) == b"first"
    assert prompt_bytes("/v1/completions", {"prompt": [[1, 2], [3]]}) == token_bytes([1, 2])
    # Nothing to share: no prefill routes, empty or malformed prompts.
    assert prompt_bytes("/tokenize", {"prompt": "x"}) is None
    assert prompt_bytes("/v1/chat/completions", {"messages": "nope"}) is None
    assert prompt_bytes("/v1/completions", {"prompt": 7}) is None
    assert prompt_bytes("/v1/completions", {"prompt": [True, False]}) is None
    assert request_hashes("/v1/completions", {"prompt": "abc"}, "m", block=8) == []
    assert len(request_hashes("/v1/completions", {"prompt": "a" * 20}, "m", block=8)) == 2


@settings(max_examples=100, deadline=None)
@given(
    payload=st.dictionaries(
        st.sampled_from(["messages", "prompt", "tools"]),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=5),
            lambda inner: (
                st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
            ),
            max_leaves=10,
        ),
    )
)
def test_any_json_body_is_hashed_or_skipped_never_raises(payload: dict) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        out = prompt_bytes(path, payload)
        assert out is None or isinstance(out, bytes)
