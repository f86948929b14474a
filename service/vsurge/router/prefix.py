"""Prompt prefixes as chained block hashes, the key of prefix-cache-aware routing (pure).

The paged engine keys its KV pages by chained hashes of `page_size` tokens (`engines/paged/paging.page_hashes`:
key i names tokens[: (i + 1) * page_size] exactly). The router does the same over the prompt as the chat
template sees it, without tokenizing: hash i names the prompt's first (i + 1) blocks, each `block` bytes
long, chained with blake2b (128 bits). Two requests share their first k hashes exactly when they share
their first k blocks, which is when the engine can reuse the pages that hold them.

Why bytes, not tokens: tokenizing in the router needs every model's tokenizer in the router process (the
router runs beside no weights and may serve hundreds of models) or a round trip to a pod per request. A
shared text prefix is a shared token prefix up to the last token boundary before the divergence, so
routing by text blocks sends requests to the pod holding the same pages; a block of 256 bytes is about
one 64-token page of English (about four bytes per token).

The text is a canonical rendering of the request in the order a chat template lays it out: the tools (a
template puts them in the system section), then each message's role, name and content. It is not the
model's template (the router does not have it), only a function of the same inputs with the same prefix
structure: a conversation that extends another one renders to a text that extends the other's text. A
token-id prompt (`/v1/completions` with `prompt: [ids]`) is hashed as its int32 little-endian bytes, the
bytes `page_hashes` hashes. The model name seeds the chain: two models (or a base model and its LoRA
adapter, whose KV differ) never share a key.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

ROOT = b"vsurge-router-prefix-v1"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def block_hashes(data: bytes, block: int, *, seed: str = "", limit: int | None = None) -> list[bytes]:
    """Chained keys of the full `block`-byte blocks of `data`: key i names data[: (i + 1) * block].

    `seed` (the model name) starts the chain; `limit` caps how many blocks are hashed (a very long prompt
    costs no more than its first `limit` blocks).
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    count = len(data) // block
    if limit is not None:
        count = min(count, max(0, limit))
    parent = hashlib.blake2b(ROOT + seed.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    out: list[bytes] = []
    view = memoryview(data)
    for i in range(count):
        parent = hashlib.blake2b(parent + view[i * block : (i + 1) * block], digest_size=16).digest()
        out.append(parent)
    return out


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _content_text(content: Any) -> str:
    """A message's content as text: a string as is, parts in order (text as is, other parts as JSON)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            else:
                pieces.append(_json(part))
        return "".join(pieces)
    return _json(content)


def chat_text(messages: Sequence[Any], tools: Any = None) -> str:
    """The canonical rendering of a chat request (see the module docstring)."""
    parts: list[str] = []
    if tools:
        parts.append("<|tools|>" + _json(tools) + "\n")
    for m in messages:
        if not isinstance(m, Mapping):
            parts.append("<|?|>" + _json(m) + "\n")
            continue
        head = f"<|{m.get('role', '')}"
        if m.get("name"):
            head += f"|{m['name']}"
        text = _content_text(m.get("content"))
        for key in ("tool_calls", "tool_call_id", "reasoning_content"):
            if m.get(key):
                text += f"<|{key}|>" + (m[key] if isinstance(m[key], str) else _json(m[key]))
        parts.append(head + "|>" + text + "\n")
    return "".join(parts)


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def token_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as the engine hashes them: int32, little-endian (ids outside int32 wrap, as numpy's)."""
    return struct.pack(f"<{len(ids)}i", *(((t + 2**31) % 2**32) - 2**31 for t in ids))


def prompt_bytes(path: str, payload: Mapping[str, Any]) -> bytes | None:
    """The bytes whose blocks identify this request's prompt prefix, or None when it has none to share.

    Chat: the canonical rendering of `tools` + `messages`. Completions: `prompt` as UTF-8, or token ids as
    int32 bytes; for a batch (a list of prompts) its first prompt. Other routes (tokenize, count_tokens)
    do no prefill: None.
    """
    if path == CHAT_PATH:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        return chat_text(messages, payload.get("tools")).encode("utf-8", "surrogatepass")
    if path == COMPLETIONS_PATH:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and not _token_ids(prompt):
            prompt = prompt[0]  # a batch: its first prompt decides
        if isinstance(prompt, str):
            return prompt.encode("utf-8", "surrogatepass")
        if _token_ids(prompt):
            return token_bytes(prompt)
    return None


def request_hashes(
    path: str, payload: Mapping[str, Any], model: str, block: int, limit: int | None = None
) -> list[bytes]:
    """The chained block hashes of one request's prompt (empty: nothing to route by)."""
    data = prompt_bytes(path, payload)
    if not data:
        return []
    return block_hashes(data, block, seed=model, limit=limit)
