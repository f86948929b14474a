"""What every route outside generation shares: an APIError raised anywhere becomes its JSON answer."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from . import errors
from .errors import APIError
from .served_model import _error_response

log = logging.getLogger(__name__)

_Route = Callable[[Any, Request], Awaitable[Response]]


def answers_api_errors(route: _Route) -> _Route:
    """For routes outside generation: an APIError raised anywhere in `route` becomes its JSON answer."""

    @functools.wraps(route)
    async def answer(self: Any, request: Request | None = None) -> Response:
        # request None: a route the seed's API awaits in Python (available_inference)
        try:
            return await route(self, request)
        except APIError as e:
            return _error_response(e)
        except Exception as e:  # never a plain-text 500 (and a reset kept-alive connection)
            err = errors.from_exception(e)
            if err.status >= 500:
                log.exception("%s failed", request.url.path if request is not None else route.__name__)
            return _error_response(err)

    return answer
