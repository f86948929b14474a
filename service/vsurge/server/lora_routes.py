"""LoRA adapters on the server: a request's `model` may name an adapter of a served model, /v1/models
lists adapters with `parent` = their base, and vLLM's routes load and unload adapters at run time.

POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter {"lora_name"} are
vLLM's routes and bodies, and the server's only run-time mutations: its admin routes. They answer only when
the server was started with --enable-lora-runtime-updates (404 otherwise). With an admin key
(--admin-key / VSURGE_ADMIN_KEY) they need `Authorization: Bearer <admin key>` and nothing else opens them
(the API key, a tenant's key: 401), so a key that reaches the model pod to generate cannot change what it
serves. Without one, the explicit flag is the opt-in: the API key guards them, as every route (and, with no
API key either, nothing does: vLLM's behaviour, said by a warning at start). An adapter unloaded while
requests use it stops being listed and accepted at once, and leaves the device when those requests have
ended (drivers/lora_adapters.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from . import errors
from .errors import APIError
from .route_helpers import answers_api_errors
from .served_model import ServedModel, _error_response, public_root

log = logging.getLogger(__name__)


class AdapterSurge:
    """A served model's engine as one adapter's: every request it completes carries the adapter."""

    def __init__(self, surge: Any, adapter: str):
        self._surge = surge
        self.adapter = adapter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._surge, name)

    async def complete(self, request: Any) -> AsyncIterator[Any]:
        from vsurge.drivers.lora_adapters import UnknownAdapterError

        request.adapter = self.adapter
        try:
            async for item in self._surge.complete(request):
                yield item
        except UnknownAdapterError:  # unloaded between the lookup and the submission
            raise errors.model_not_found(self.adapter) from None


def adapters_of(entry: ServedModel) -> Any:
    """The LoRA adapters of a served model's driver (drivers/lora_adapters.py), or None."""
    return getattr(entry.surge, "lora", None)


def adapter_entry(entry: ServedModel, name: str) -> ServedModel:
    """The served model as adapter ``name`` of it: its card (parent = the base) and its engine view."""
    lora = adapters_of(entry)
    root = public_root(lora.source(name)) if lora is not None else None
    return dataclasses.replace(
        entry, name=name, surge=AdapterSurge(entry.surge, name), parent=entry.name, root=root
    )


def find_adapter(models: dict[str, ServedModel], name: str) -> ServedModel | None:
    """The adapter named ``name`` of any served model, as its own entry; None if no model serves it."""
    for entry in models.values():
        lora = adapters_of(entry)
        if lora is not None and name in lora.names():
            return adapter_entry(entry, name)
    return None


def listed_adapters(models: dict[str, ServedModel]) -> list[ServedModel]:
    """Every adapter of every served model, in the order they were added."""
    out = []
    for entry in models.values():
        lora = adapters_of(entry)
        for name in lora.names() if lora is not None else ():
            out.append(adapter_entry(entry, name))
    return out


class LoraRoutes:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter. A mixin of vSurgeApiServer."""

    lora_runtime_updates: bool = False
    admin_key: str | None = None

    def _check_admin(self, request: Request) -> None:
        """The admin routes' key: the admin key alone where one is set, else the API key (`_check_auth`)."""
        if self.admin_key is None:
            self._check_auth(request)
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # constant time, as the API key's check; a wrong scheme fails the same way
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.admin_key.encode()
        ):
            raise APIError(
                401,
                "This route needs the server's admin key. Send it as `Authorization: Bearer <admin key>`.",
                type="invalid_request_error",
                code="invalid_admin_key",
            )

    def _say_how_admin_routes_are_guarded(self) -> None:
        if self.lora_runtime_updates and self.admin_key is None:
            log.warning(
                "runtime LoRA updates are on without an admin key: POST /v1/load_lora_adapter and "
                "/v1/unload_lora_adapter answer to %s; set VSURGE_ADMIN_KEY",
                "the API key" if getattr(self, "api_key", None) else "anyone who reaches this port",
            )

    def _lora_target(self) -> Any:
        """The adapters of the first served model that has a bank."""
        for entry in self.models.values():
            lora = adapters_of(entry)
            if lora is not None:
                return entry, lora
        raise APIError(400, "No served model has a LoRA adapter bank.", code="lora_not_enabled")

    async def _lora_body(self, request: Request, fields: tuple[str, ...]) -> dict[str, str]:
        self._check_admin(request)
        if not self.lora_runtime_updates:
            raise APIError(
                404,
                "Loading LoRA adapters at run time is off; start the server with --enable-lora-runtime-updates.",
                code="unknown_route",
            )
        data = await self._json(request)
        for f in fields:
            if not isinstance(data.get(f), str) or not data[f]:
                raise errors.invalid_request(f"{f} must be a non-empty string", param=f)
        return data

    @answers_api_errors
    async def load_lora_adapter(self, request: Request) -> Response:
        """POST /v1/load_lora_adapter: read, check and serve an adapter (vLLM's route and answer)."""
        data = await self._lora_body(request, ("lora_name", "lora_path"))
        name, path = data["lora_name"], data["lora_path"]
        entry, lora = self._lora_target()
        if name in self.models or name == entry.name:
            raise errors.invalid_request(f"{name!r} is a served model's name", param="lora_name")
        try:
            await asyncio.to_thread(lora.add, name, path)
        except (ValueError, OSError) as e:  # the adapter, its source or its name: the client's to fix
            raise errors.invalid_request(str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @answers_api_errors
    async def unload_lora_adapter(self, request: Request) -> Response:
        """POST /v1/unload_lora_adapter: stop serving an adapter (its running requests finish first)."""
        from vsurge.drivers.lora_adapters import UnknownAdapterError

        data = await self._lora_body(request, ("lora_name",))
        name = data["lora_name"]
        _, lora = self._lora_target()
        try:
            lora.remove(name)
        except UnknownAdapterError:
            return _error_response(errors.model_not_found(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
