"""The routes beside generation and tokens: models, probes, health, load and metrics."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vsurge.version import __version__

from . import errors
from .errors import APIError
from .lifecycle import READY
from .load_report import load_report
from .lora_routes import listed_adapters
from .metrics import CONTENT_TYPE
from .route_helpers import answers_api_errors
from .served_model import _error_response, _model_card

log = logging.getLogger(__name__)


class InfoRoutes:
    """Models, probes, load and metrics. A mixin of vSurgeApiServer."""

    @answers_api_errors
    async def available_inference(self, request: Request | None = None) -> Response:
        """GET /v1/models (called in Python without a request, as the seed's is: no auth to check)."""
        if request is not None:
            self._check_auth(request)
        models = [*self.models.values(), *listed_adapters(self.models)]  # adapters: parent = their base
        return JSONResponse({"object": "list", "data": [_model_card(m) for m in models]})

    @answers_api_errors
    async def get_model(self, request: Request) -> Response:
        """GET /v1/models/{id}."""
        self._check_auth(request)
        return JSONResponse(_model_card(self._model(request.path_params["model_id"])))

    async def liveness(self, request: Request | None = None) -> Response:
        """GET /liveness: the process and its event loop answer; fails only if an engine died while serving."""
        dead = self._dead_engines()
        if dead:
            return JSONResponse({"status": "dead", "engines": dead}, status_code=503)
        return JSONResponse({"status": "alive"})

    async def readiness(self, request: Request | None = None) -> Response:
        """GET /readiness: 200 only when compiled, started and not draining."""
        if self.state == READY and self.stop_announced:
            return _error_response(errors.not_ready(self.stop_announced))
        if self.state == READY and not self._dead_engines():
            return JSONResponse({"status": "ready"})
        return _error_response(errors.not_ready(self.state_reason or self.state))

    async def ping(self, request: Request) -> Response:
        """GET|POST /ping: SageMaker's health check (with /invocations): readiness's answer."""
        return await self.readiness(request)

    async def version(self, request: Request) -> Response:
        """GET /version: {"version"} (vLLM's route)."""
        return JSONResponse({"version": __version__})

    async def health(self, request: Request) -> Response:
        """GET /health: state and per-model slot figures, for humans and dashboards."""
        models = {}
        for name, entry in self.models.items():
            try:
                m = entry.surge.metrics()
                models[name] = {
                    "slots_used": m.slots_used,
                    "slots_total": m.slots_total,
                    "requests_waiting": m.requests_waiting,
                    "max_length": entry.max_length,
                }
            except Exception as e:
                models[name] = {"error": type(e).__name__}
        dead = self._dead_engines()
        status = "dead" if dead else self.state
        return JSONResponse(
            {"status": status, "in_flight": self.in_flight, "models": models},
            status_code=503 if dead else 200,
        )

    async def load(self, request: Request) -> Response:
        """GET /load: the router's view of this replica (load_report.py): vLLM's server_load (requests in flight)
        plus waiting / running requests, free decode slots and KV use, per model and in total. Host
        counters only; no authentication, like the probes (it reveals no request content)."""
        metrics = {}
        for name, entry in self.models.items():
            try:
                metrics[name] = entry.surge.metrics()
            except Exception as e:  # an engine that cannot answer is reported, not a 500
                metrics[name] = e
        return JSONResponse(load_report(self.state, self.in_flight, metrics))

    async def metrics_route(self, request: Request) -> Response:
        """GET /metrics on the main port (when the metrics port is -1)."""
        if not self.metrics_on_main_port:
            where = "served on the metrics port" if getattr(self, "metrics_enabled", True) else "disabled"
            return _error_response(APIError(404, f"Metrics are {where}.", code="unknown_route"))
        data = await asyncio.to_thread(self.metrics.render)
        return Response(data, media_type=CONTENT_TYPE)
