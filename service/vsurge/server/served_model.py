"""The served model and the small protocol the server needs from an engine (vSurge implements it)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from starlette.responses import Response

from vsurge.contracts.request import GenerationRequest, ReturnSample

from .errors import APIError
from .logprob_shapes import TokenDecoder

log = logging.getLogger(__name__)


@runtime_checkable
class ServedEngine(Protocol):
    """What the server needs from an engine (vSurge implements it): no reaching into drivers."""

    @property
    def processor(self) -> Any: ...

    @property
    def max_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def live(self) -> bool: ...

    def tokenize(self, text: str) -> list[int]: ...

    def count_tokens(self, text_or_conversation: str | list) -> int: ...

    def complete(self, request: GenerationRequest) -> AsyncIterator[list[ReturnSample]]: ...

    def metrics(self) -> Any: ...

    def compile(self, progress: Callable[[str], None] | None = None) -> float: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class ServedModel:
    """One served model: the engine and what the routes need from it, looked up once."""

    name: str
    surge: ServedEngine
    processor: Any
    max_length: int
    vocab_size: int | None
    decode: TokenDecoder
    created: int = field(default_factory=lambda: int(time.time()))
    load_seconds: float | None = None
    # where the weights came from (vLLM's model card `root`: the path or hub id); the name when unknown
    root: str | None = None
    # a LoRA adapter's entry (lora_routes.py): the base model's name (None: a base model)
    parent: str | None = None


def _vocab_size(surge: ServedEngine) -> int | None:
    # The model's embedding rows bound valid ids; the tokenizer may know fewer (padded vocabularies).
    size = getattr(surge, "vocab_size", None)
    if size is not None:
        return int(size)
    processor = getattr(surge, "processor", None)
    return len(processor) if processor is not None else None


def _decode(entry: ServedModel, ids: list[int]) -> str:
    return entry.processor.decode(ids) if entry.processor is not None else ""


def public_root(source: str | None) -> str | None:
    """A model source fit to show on the model card: a URI without user info, query or fragment (where
    credentials or signed tokens could hide); paths and hub ids as given."""
    if not source or "://" not in source:
        return source
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(source)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _model_card(m: ServedModel) -> dict[str, Any]:
    """OpenAI's model object with vLLM's fields (root, parent, max_model_len, permission)."""
    return {
        "id": m.name,
        "object": "model",
        "created": m.created,
        "owned_by": "vsurge",
        "root": m.root or m.name,
        "parent": m.parent,
        "max_model_len": m.max_length,
        "permission": [
            {
                "id": f"modelperm-{m.name}",
                "object": "model_permission",
                "created": m.created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def _error_response(err: APIError) -> Response:
    return Response(
        err.body_bytes(), status_code=err.status, media_type="application/json", headers=err.headers
    )
