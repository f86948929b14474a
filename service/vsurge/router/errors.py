"""OpenAI-shaped error responses of the router.

The body is `{"error": {"message", "type", "param", "code"}}`, like the server's (the router does not
import the server package: it runs without JAX). The HTTP status decides what the `openai` client raises
(400 BadRequestError, 404 NotFoundError, 503 InternalServerError, which it retries), so the status is the
contract; `type` and `code` follow the strings OpenAI sends.
"""

from __future__ import annotations

from starlette.responses import JSONResponse


def error_response(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    retry_after: float | None = None,
) -> JSONResponse:
    """A JSON error answer; `retry_after` (seconds) adds the Retry-After header, rounded up."""
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(-(-retry_after // 1))))
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def model_not_found(model: str) -> JSONResponse:
    return error_response(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return error_response(400, message, param=param, code=code)


def unavailable(message: str, code: str, retry_after: float) -> JSONResponse:
    # 503 with Retry-After: the openai client (and most HTTP clients) retry these after the delay.
    return error_response(503, message, type_="server_error", code=code, retry_after=retry_after)


def model_not_found_for_tenant(model: str) -> JSONResponse:
    # The same answer whether the model is unknown or only not allowed: a tenant learns nothing about
    # models outside its list.
    return error_response(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def unauthorized(missing: bool) -> JSONResponse:
    """401 as OpenAI words it; never echoes the key."""
    if missing:
        message = (
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
        response = error_response(401, message, code=None)
    else:
        response = error_response(401, "Incorrect API key provided.", code="invalid_api_key")
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def rate_limited(message: str, limit: str, retry_after: float, headers: dict[str, str]) -> JSONResponse:
    """429 with Retry-After; `type` is the limit hit (requests or tokens), as OpenAI sends it."""
    response = error_response(429, message, type_=limit, code="rate_limit_exceeded", retry_after=retry_after)
    for k, v in headers.items():
        response.headers[k] = v
    return response
