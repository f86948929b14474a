"""Upstreams on a Unix-domain socket: `unix:///run/vsurge.sock` in a static config (a `vsurge serve --uds`
in the same pod or host).

The router keeps every upstream as a base URL it appends routes to, so a socket upstream becomes one:
``http+unix://<socket path, percent-encoded>``. The path is encoded whole (``/`` as ``%2f``) and so are
capital letters, because httpx lowercases a URL's host: ``/run/vsurge.sock`` reads
``http+unix://%2frun%2fvsurge.sock``. `UnixSocketTransport`, mounted on ``http+unix://`` in the router's
clients, decodes the host back to the path and sends the request over that socket as plain HTTP/1.1.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

import httpx

SCHEME = "http+unix"


def socket_upstream(path: str) -> str:
    """The base URL of the server listening on the Unix socket at ``path``."""
    if not path.startswith("/"):
        raise ValueError(f"a Unix socket upstream needs an absolute path, got {path!r}")
    # httpx lowercases the host: capitals are escaped too, and escapes survive it
    encoded = "".join(f"%{ord(c):02x}" if "A" <= c <= "Z" else quote(c, safe="").lower() for c in path)
    return f"{SCHEME}://{encoded}"


def socket_path(host: str) -> str:
    """The socket path a ``http+unix://`` host names (the inverse of `socket_upstream`)."""
    return unquote(host)


class UnixSocketTransport(httpx.AsyncBaseTransport):
    """Sends each ``http+unix://`` request over the socket its host names; one pooled transport per socket."""

    def __init__(self, **transport_kw: object) -> None:
        self._kw = transport_kw
        self._transports: dict[str, httpx.AsyncHTTPTransport] = {}

    def _for(self, path: str) -> httpx.AsyncHTTPTransport:
        transport = self._transports.get(path)
        if transport is None:
            transport = self._transports[path] = httpx.AsyncHTTPTransport(uds=path, **self._kw)  # type: ignore[arg-type]
        return transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = socket_path(request.url.host)
        # the connection is the socket; the URL's host only has to be one HTTP accepts
        request.url = request.url.copy_with(scheme="http", host="localhost")
        request.headers["Host"] = "localhost"
        return await self._for(path).handle_async_request(request)

    async def aclose(self) -> None:
        for transport in self._transports.values():
            await transport.aclose()
        self._transports.clear()


def mounts(**transport_kw: object) -> dict[str, httpx.AsyncBaseTransport]:
    """The ``mounts=`` of a router client that also reaches socket upstreams (``transport_kw``: the
    pool's, e.g. ``limits=``, as the client's own transport has them)."""
    return {f"{SCHEME}://": UnixSocketTransport(**transport_kw)}


def pool() -> dict[str, object]:
    """A router client's ``limits=`` and ``mounts=``: no cap on connections, 256 kept alive for 30 s, on TCP
    and on every socket upstream alike."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=30)
    return {"limits": limits, "mounts": mounts(limits=limits)}
