"""The seed's ``oai_like_processor``: a multimodal processor's chat template reads each message's content as
OpenAI's list of typed parts (``[{"type": "text", "text": ...}]``), where a tokenizer's reads a string."""

from __future__ import annotations

from typing import Any

__all__ = ["as_content_parts", "wants_content_parts"]


def wants_content_parts(processor: Any, oai_like_processor: bool) -> bool:
    """True for a transformers ProcessorMixin (checked by name: transformers need not be imported) when
    ``oai_like_processor`` is set."""
    return oai_like_processor and any(c.__name__ == "ProcessorMixin" for c in type(processor).__mro__)


def as_content_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each string content as one text part (an empty string as no parts)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            m = {**m, "content": [{"type": "text", "text": content}] if content else []}
        out.append(m)
    return out
