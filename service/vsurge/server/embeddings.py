"""/v1/embeddings (OpenAI) and /pooling (vLLM): request parsing and response shaping (pure functions), and
the thin routes over the model's pooling program (engines/pooling.py).

A decoder LLM's embedding is its final hidden state after the final norm, pooled over the input: the last
token's by default (what the model has read the whole input by), the mean with `pooling_type: "mean"`;
L2-normalized unless `normalize: false`. Vectors are the model's hidden size: `dimensions` other than that
is refused, since the model was not trained to be truncated (no Matryoshka).
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from .body import validate
from .errors import invalid_request, unsupported_field
from .messages import messages_to_dicts, render_chat
from .prompts import check_truncation, truncate_ids
from .sampling_fields import out_of_vocabulary
from .schemas import ChatCompletionRequest
from .wire import dumps, new_id

# Most inputs one request may carry (OpenAI allows 2048; each is a row of a pooling batch).
MAX_INPUTS = 2048
ENCODINGS = ("float", "base64")
POOLING_TYPES = ("last", "mean")


@dataclass
class EmbeddingPlan:
    model: str | None
    inputs: list[str | list[int]]
    encoding: str = "float"
    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    truncate: int | None = None
    # vLLM's chat embeddings: a conversation rendered with the chat template is the one input
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None


def _flag(data: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = data.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise invalid_request(f"Invalid type for '{key}': expected {kind.__name__}.", param=key)
    return value


def parse_embeddings(data: dict[str, Any], *, vocab_size: int | None, max_length: int) -> EmbeddingPlan:
    """A /v1/embeddings or /pooling body -> an EmbeddingPlan (raises APIError naming the field)."""
    messages = data.get("messages")
    if messages is not None and data.get("input") is not None:
        raise invalid_request("Send 'input' or 'messages', not both.", param="messages")
    raw = data.get("input") if messages is None else "rendered from messages"
    if raw is None:
        raise invalid_request("Missing required parameter: 'input'.", param="input")
    if isinstance(raw, str):
        inputs: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        inputs = [list(raw)]
    elif isinstance(raw, list):
        inputs = list(raw)
    else:
        raise invalid_request(
            "Invalid type for 'input': expected a string, an array of strings or of token ids.", param="input"
        )
    if not inputs:
        raise invalid_request("'input' must not be empty.", param="input")
    if len(inputs) > MAX_INPUTS:
        raise invalid_request(
            f"'input' may hold at most {MAX_INPUTS} inputs, got {len(inputs)}.", param="input"
        )
    for i, x in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(x, str):
            if not x:
                raise invalid_request(f"'{where}' must not be empty.", param="input")
            continue
        if (
            not isinstance(x, list)
            or not x
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        ):
            raise invalid_request(
                f"Invalid value for '{where}': expected a string or a non-empty array of token ids.",
                param="input",
            )
        bad = next((t for t in x if vocab_size and not (0 <= t < vocab_size)), None)
        if bad is not None:
            raise out_of_vocabulary(f"'{where}'", bad, vocab_size, "input")
    encoding = _flag(data, "encoding_format", str, "float")
    if encoding not in ENCODINGS:
        raise invalid_request(
            f"Invalid value for 'encoding_format': {encoding!r}; expected 'float' or 'base64'.",
            param="encoding_format",
        )
    pooling = _flag(data, "pooling_type", str, "last").lower()
    if pooling not in POOLING_TYPES:
        raise invalid_request(
            f"Invalid value for 'pooling_type': {pooling!r}; expected 'last' or 'mean'.", param="pooling_type"
        )
    dims = _flag(data, "dimensions", int, None)
    truncate = check_truncation(_flag(data, "truncate_prompt_tokens", int, None), max_length)
    specials = _flag(data, "add_special_tokens", bool, None)
    if messages is not None and specials is None:
        specials = False  # the template wrote the special tokens (vLLM's default for chat input)
    return EmbeddingPlan(
        data.get("model"),
        inputs,
        encoding,
        pooling,
        _flag(data, "normalize", bool, True),
        dims,
        truncate,
        messages,
        specials,
    )


def token_inputs(plan: EmbeddingPlan, tokenize: Any, max_tokens: int) -> list[list[int]]:
    """Every input as token ids (text through the engine's own rule, BOS included), truncated as asked,
    checked against the longest input a pooling program takes."""
    out = []
    for i, x in enumerate(plan.inputs):
        ids = truncate_ids(tokenize(x) if isinstance(x, str) else list(x), plan.truncate, "left")
        if not ids:
            raise invalid_request(f"'input[{i}]' has no tokens.", param="input")
        if len(ids) > max_tokens:
            where = "input" if len(plan.inputs) == 1 else f"input[{i}]"
            raise invalid_request(
                f"'{where}' has {len(ids)} tokens; this model embeds at most {max_tokens} "
                "(set truncate_prompt_tokens to cut it).",
                param="input",
                code="context_length_exceeded",
            )
        out.append(ids)
    return out


def encode(vec: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":  # float32 little-endian bytes, as OpenAI's clients decode them
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return [float(v) for v in vec]


def render_messages(plan: EmbeddingPlan, processor: Any, oai_like_processor: bool) -> None:
    """vLLM's chat embeddings: the conversation, rendered as a chat prompt, becomes the one input."""
    if plan.messages is None:
        return
    req = validate(ChatCompletionRequest, {"messages": plan.messages})
    text = render_chat(processor, messages_to_dicts(req.messages), oai_like_processor=oai_like_processor)
    plan.inputs = [text]


def embeddings_response(
    kind: str, model: str, vecs: np.ndarray, encoding: str, prompt_tokens: int
) -> dict[str, Any]:
    """OpenAI's embedding list, or vLLM's /pooling list (`object: pooling`, the vector under `data`)."""
    # vLLM's usage (completion_tokens 0) and id / created beside OpenAI's fields
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}
    if kind == "embedding":
        data = [
            {"object": "embedding", "index": i, "embedding": encode(v, encoding)} for i, v in enumerate(vecs)
        ]
    else:
        data = [{"object": "pooling", "index": i, "data": encode(v, encoding)} for i, v in enumerate(vecs)]
    return {
        "id": new_id("embd" if kind == "embedding" else "pool"),
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage,
    }


class EmbeddingRoutes:
    """A mixin of vSurgeApiServer: POST /v1/embeddings and /pooling."""

    async def embeddings(self, request: Request) -> Response:
        return await self._pool(request, "embedding")

    async def pooling(self, request: Request) -> Response:
        return await self._pool(request, "pooling")

    async def _pool(self, request: Request, kind: str, data: dict[str, Any] | None = None) -> Response:
        """``data``: the body, when /invocations has read it already."""
        call = self._call(request)
        try:
            call.admit()
            if data is None:
                data = await self._json(request)
            entry = self._model(data.get("model") if isinstance(data.get("model"), str) else None)
            call.model = entry.name
            plan = parse_embeddings(data, vocab_size=entry.vocab_size, max_length=entry.max_length)
            if entry.parent is not None:  # the pooling program runs the base weights: no adapter's
                raise unsupported_field(
                    "model", f"'{entry.name}' is a LoRA adapter; embeddings use base models"
                )
            if not hasattr(entry.surge, "pooler"):
                raise unsupported_field("model", "this engine serves no embeddings")
            try:
                pooler = entry.surge.pooler()
            except NotImplementedError as e:
                raise unsupported_field("model", str(e)) from None
            if plan.dimensions is not None and plan.dimensions != pooler.dim:
                raise unsupported_field(
                    "dimensions",
                    f"this model's embeddings have {pooler.dim} dimensions and cannot be shortened",
                )
            call.start_span("embeddings", entry, None)
            render_messages(plan, entry.processor, getattr(self, "oai_like_processor", True))
            tokenize = entry.surge.tokenize
            if plan.add_special_tokens is not None and entry.processor is not None:
                flag = plan.add_special_tokens
                tokenize = lambda text: list(entry.processor.encode(text, add_special_tokens=flag))  # noqa: E731
            ids = await asyncio.to_thread(token_inputs, plan, tokenize, pooler.max_tokens)
            vecs = await asyncio.to_thread(pooler.pool, ids, plan.pooling, plan.normalize)
            tokens = sum(len(x) for x in ids)
            body = embeddings_response(kind, entry.name, vecs, plan.encoding, tokens)
            call.close(200, response_model=entry.name, input_tokens=tokens)
            return Response(dumps(body), media_type="application/json")
        except Exception as exc:
            return call.fail(exc)
