"""vSurgeApiServer: the OpenAI-compatible HTTP server (Starlette on uvicorn), its metrics and tracing."""

from .app import vSurgeApiServer
from .runner import RunningServer, start

__all__ = ["RunningServer", "start", "vSurgeApiServer"]
