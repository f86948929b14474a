"""OpenAI-shaped errors: one exception type the routes raise, and the mapping from engine exceptions.

Every error body is `{"error": {"message", "type", "param", "code"}}`. The HTTP status decides which
exception the official `openai` client raises (400 BadRequestError, 401 AuthenticationError, 404
NotFoundError, 429 RateLimitError, 5xx InternalServerError), so the status is the contract; `type` and
`code` follow the strings OpenAI itself sends.
"""

from __future__ import annotations

import json
from typing import Any

from vsurge.contracts.request import (
    EngineUnavailableError,
    PromptTooLongError,
    QueueFullError,
    RequestFailedError,
)
from vsurge.contracts.sampling_params import InvalidSamplingParams

# Seconds a client should wait before retrying a 429 / 503; small because slots free up quickly.
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered to the client; `status` is the HTTP status, the rest goes in the body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_bytes(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported_field(param: str, detail: str = "") -> APIError:
    # Refused rather than ignored: a client that asks for tools or a JSON schema must not silently get
    # free text back.
    extra = f" ({detail})" if detail else ""
    return APIError(
        400, f"{param} is not supported by this server{extra}", param=param, code="unsupported_parameter"
    )


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        param="model",
        code="model_not_found",
    )


def unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect or missing API key. Send it as `Authorization: Bearer <key>`.",
        type="invalid_request_error",
        code="invalid_api_key",
    )


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")


def queue_full(detail: str = "") -> APIError:
    msg = "The server is at capacity: the request queue is full. Retry after a short wait."
    if detail:
        msg = f"{msg} ({detail})"
    return APIError(
        429,
        msg,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def not_ready(reason: str) -> APIError:
    return APIError(
        503,
        f"The server is not ready: {reason}.",
        type="service_unavailable",
        code="not_ready",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def engine_unavailable(detail: str) -> APIError:
    # A process of a multi-host engine is gone: this replica restarts; the router retries elsewhere.
    return APIError(
        503,
        f"The engine is unavailable: {detail}. Retry after a short wait.",
        type="server_error",
        code="engine_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def internal(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def from_exception(exc: BaseException) -> APIError:
    """Map an exception raised by parsing or by vSurge to the APIError the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidSamplingParams):
        return invalid_request(str(exc), param=exc.param)
    if isinstance(exc, PromptTooLongError):
        return invalid_request(str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return queue_full(str(exc))
    if isinstance(exc, EngineUnavailableError):
        return engine_unavailable(str(exc))
    if isinstance(exc, RequestFailedError):
        # The engine rejected or lost this one request; the server itself is fine.
        return APIError(
            500, f"The request failed in the engine: {exc}", type="server_error", code="request_failed"
        )
    if isinstance(exc, ValueError):
        # vSurge raises ValueError for input it cannot use (e.g. token ids out of range): a client error.
        return invalid_request(str(exc))
    return internal(f"Internal error: {type(exc).__name__}")
