"""The tokenizer routes: /v1/count_tokens (the seed's), vLLM's /tokenize, /detokenize and /tokenizer_info."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import errors
from .messages import check_generation_prompt, messages_to_dicts, render_chat
from .route_helpers import answers_api_errors
from .schemas import CountTokenRequest, DetokenizeRequest, TokenizeRequest
from .served_model import ServedModel
from .structured_outputs import parse_tools

# tokenizer_config keys that are file paths on the server, not configuration
_PATH_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "special_tokens_map_file")


def _tokenizer(entry: ServedModel) -> Any:
    if entry.processor is None:
        raise errors.invalid_request("This model has no tokenizer.", param="model")
    return entry.processor


def _jsonable(value: Any) -> Any:
    """Tokenizer config values as JSON: AddedToken -> its text, tuples -> lists, other objects -> str."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "content") and isinstance(value.content, str):
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in value]
    return str(value)


def tokenizer_config(processor: Any) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's configuration (what tokenizer_config.json holds), its class
    and chat template, without server file paths."""
    config = dict(getattr(processor, "init_kwargs", None) or {})
    for key in _PATH_KEYS:
        config.pop(key, None)
    config = _jsonable(config)
    config["tokenizer_class"] = type(processor).__name__
    template = getattr(processor, "chat_template", None)
    if isinstance(template, str) and template.strip():
        config["chat_template"] = template
    return config


class TokenRoutes:
    """Tokens in and out of the model's tokenizer. A mixin of vSurgeApiServer."""

    async def _model_request(self, request: Request, schema: type) -> tuple[Any, ServedModel]:
        """Authorize, then read the body as `schema` and look up the model it names."""
        from .body import validate

        self._check_auth(request)
        req = validate(schema, await self._json(request))
        return req, self._model(req.model)

    @answers_api_errors
    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/count_tokens (the seed's): {"model", "conversation": str | messages} -> {"model", "count"}."""
        req, entry = await self._model_request(request, CountTokenRequest)
        if isinstance(req.conversation, str):
            conv: Any = req.conversation
        else:
            conv = messages_to_dicts(req.conversation, param="conversation")
        try:
            count = await asyncio.to_thread(entry.surge.count_tokens, conv)
        except ValueError as e:
            raise errors.invalid_request(str(e), param="conversation") from None
        return JSONResponse({"model": entry.name, "count": count})

    @answers_api_errors
    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize: {"model", "prompt"} or {"model", "messages", "tools"?} ->
        {"count", "max_model_len", "tokens", "token_strs"}."""
        req, entry = await self._model_request(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise errors.invalid_request("Send exactly one of 'prompt' or 'messages'.", param="prompt")
        if req.chat_template is not None:
            raise errors.unsupported_field("chat_template", "the model's own chat template is used")
        processor = _tokenizer(entry)
        if req.messages is not None:
            check_generation_prompt(req.add_generation_prompt, req.continue_final_message)
            tools = parse_tools(req.tools, None, None)
            text = render_chat(
                processor,
                messages_to_dicts(req.messages),
                add_generation_prompt=req.add_generation_prompt is not False,
                continue_final_message=bool(req.continue_final_message),
                chat_template_kwargs=req.chat_template_kwargs,
                tools=tools.template_tools if tools is not None else None,
                oai_like_processor=getattr(self, "oai_like_processor", True),
            )
        else:
            if req.tools is not None:
                raise errors.invalid_request("'tools' needs 'messages'.", param="tools")
            text = req.prompt or ""
        if req.add_special_tokens is None:
            # Same rule the engine uses, so /tokenize counts what generation will see.
            tokens = await asyncio.to_thread(entry.surge.tokenize, text) if text else []
        else:
            tokens = list(processor.encode(text, add_special_tokens=req.add_special_tokens))
        strs = list(processor.convert_ids_to_tokens(tokens)) if req.return_token_strs else None
        return JSONResponse(
            {"count": len(tokens), "max_model_len": entry.max_length, "tokens": tokens, "token_strs": strs}
        )

    @answers_api_errors
    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize: {"model", "tokens"} -> {"prompt"}."""
        req, entry = await self._model_request(request, DetokenizeRequest)
        processor = _tokenizer(entry)
        limit = len(processor)
        bad = next((t for t in req.tokens if not (0 <= t < limit)), None)
        if bad is not None:
            raise errors.invalid_request(
                f"Token id {bad} in 'tokens' is out of vocabulary: the tokenizer has {limit} tokens.",
                param="tokens",
            )
        return JSONResponse({"prompt": processor.decode(req.tokens)})

    @answers_api_errors
    async def tokenizer_info(self, request: Request) -> Response:
        """GET /tokenizer_info[?model=NAME]: the tokenizer's configuration (vLLM's route)."""
        self._check_auth(request)
        entry = self._model(request.query_params.get("model"))
        return JSONResponse(tokenizer_config(_tokenizer(entry)))
