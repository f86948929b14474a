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

from .errors import invalid_request, unsupported_field
from .prompts import check_truncation, truncate_ids
from .sampling_fields import out_of_vocabulary
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


def _flag(data: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = data.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise invalid_request(f"Invalid type for '{key}': expected {kind.__name__}.", param=key)
    return value


def parse_embeddings(data: dict[str, Any], *, vocab_size: int | None, max_length: int) -> EmbeddingPlan:
    """A /v1/embeddings or /pooling body -> an EmbeddingPlan (raises APIError naming the field)."""
    if data.get("messages") is not None:
        raise unsupported_field("messages", "send the text to embed as 'input'")
    raw = data.get("input")
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
    return EmbeddingPlan(
        data.get("model"), inputs, encoding, pooling, _flag(data, "normalize", bool, True), dims, truncate
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


def embeddings_response(
    kind: str, model: str, vecs: np.ndarray, encoding: str, prompt_tokens: int
) -> dict[str, Any]:
    """OpenAI's embedding list, or vLLM's /pooling list (`object: pooling`, the vector under `data`)."""
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    if kind == "embedding":
        data = [
            {"object": "embedding", "index": i, "embedding": encode(v, encoding)} for i, v in enumerate(vecs)
        ]
        return {"object": "list", "data": data, "model": model, "usage": usage}
    data = [{"object": "pooling", "index": i, "data": encode(v, encoding)} for i, v in enumerate(vecs)]
    return {
        "id": new_id("pool"),
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

    async def _pool(self, request: Request, kind: str) -> Response:
        call = self._call(request)
        try:
            call.admit()
            data = await self._json(request)
            entry = self._model(data.get("model") if isinstance(data.get("model"), str) else None)
            call.model = entry.name
            plan = parse_embeddings(data, vocab_size=entry.vocab_size, max_length=entry.max_length)
            if entry.parent is not None:  # the pooling program runs the base weights: no adapter's
                raise unsupported_field("model", f"'{entry.name}' is a LoRA adapter; embeddings use base models")
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
            ids = await asyncio.to_thread(token_inputs, plan, entry.surge.tokenize, pooler.max_tokens)
            vecs = await asyncio.to_thread(pooler.pool, ids, plan.pooling, plan.normalize)
            tokens = sum(len(x) for x in ids)
            body = embeddings_response(kind, entry.name, vecs, plan.encoding, tokens)
            call.close(200, response_model=entry.name, input_tokens=tokens)
            return Response(dumps(body), media_type="application/json")
        except Exception as exc:
            return call.fail(exc)
