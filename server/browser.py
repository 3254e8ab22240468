"""What a web page may do with the server: the Host and Origin checks, and CORS.

A keyless server on 127.0.0.1 is reachable from every page the user's browser opens. Two attacks
follow, and both are refused here, before any route runs:

- DNS rebinding: a page at http://evil.example:8080 re-points its own name at 127.0.0.1 and reads
  the answers as same-origin. Its requests carry `Host: evil.example:8080`, so a Host that is not
  localhost, *.localhost, an IP address, the bound name or one of `allowed_hosts` gets 403.
- Cross-site requests (CSRF): a page may POST to any address without asking; the browser then
  sends `Origin`. A request whose Origin is not this server's own and not in `cors_origins` gets
  403 (and the POST routes also insist on `Content-Type: application/json`, which a page can only
  send after a CORS preflight). Allowed origins get proper CORS answers: preflights (OPTIONS with
  Access-Control-Request-Method) are answered here, other responses carry Access-Control-Allow-Origin.

Requests without an Origin header (curl, SDKs, servers) are not affected by the Origin check.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .config import ServerConfig, host_allowed, normalize_origin
from .errors import APIError

__all__ = ["BrowserGuard"]

_ALLOW_METHODS = "GET, HEAD, POST, DELETE, OPTIONS"  # DELETE: Ollama's /api/delete
_PREFLIGHT_MAX_AGE = "600"
_EXPOSE = "Retry-After"


def same_origin(origin: str, host: str | None) -> bool:
    """Whether a page at `origin` is this server itself (plain HTTP: scheme http, same host:port)."""
    return host is not None and normalize_origin(origin) == "http://" + host.strip().lower()


class BrowserGuard:
    """ASGI middleware: the Host and Origin checks, CORS preflights and headers."""

    def __init__(self, app: ASGIApp, config: ServerConfig,
                 render: Callable[[str, APIError], Response] | None = None):
        self.app = app
        self.config = config
        self.render = render or (lambda path, error: error.response())  # (path, error): the path's dialect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not host_allowed(self.config, host):
            name = host.strip()
            await self._refuse(scope, receive, send, APIError(
                403, f"the Host {name!r} is not allowed (a page that rebinds its DNS name to this machine sends "
                f"its own name; start the server with --allowed-hosts {name.rsplit(':', 1)[0]} to accept it)",
                code="host_not_allowed"))
            return
        origin = headers.get("origin")
        if origin is None or same_origin(origin, host):
            await self.app(scope, receive, send)
            return
        if not self.config.origin_allowed(origin):
            await self._refuse(scope, receive, send, APIError(
                403, f"cross-origin requests from {origin} are not allowed (start the server with "
                f"--cors-origins {origin} to let that page use the API)", code="origin_not_allowed"))
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(origin, headers, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + [
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"access-control-expose-headers", _EXPOSE.encode()),
                    (b"vary", b"Origin"),
                ]
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, origin: str, headers: Headers, send: Send) -> None:
        out = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-methods", _ALLOW_METHODS.encode()),
            (b"access-control-max-age", _PREFLIGHT_MAX_AGE.encode()),
            (b"vary", b"Origin, Access-Control-Request-Headers"),
            (b"content-length", b"0"),
        ]
        asked = headers.get("access-control-request-headers")
        if asked:  # Authorization, Content-Type, and whatever else an SDK adds (x-stainless-*, ...)
            out.append((b"access-control-allow-headers", asked.encode("latin-1")))
        if headers.get("access-control-request-private-network") == "true":  # Chrome's Private Network Access
            out.append((b"access-control-allow-private-network", b"true"))
        await send({"type": "http.response.start", "status": 204, "headers": out})
        await send({"type": "http.response.body", "body": b""})

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
        await self.render(scope.get("path", ""), error)(scope, receive, send)
