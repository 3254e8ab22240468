"""The web chat page at `/`: static files shipped in this package (server/web/), no build step and
nothing fetched from another site; the page talks to this server's own OpenAI routes.

The page and its two files are served without the API key (there is nothing secret in them, and the
page is where the key is typed); every API call the page makes carries the key as a header, so the
same key, Host and Origin rules hold for it as for any client. A Content-Security-Policy lets the page
load scripts and styles from this server only and connect to nothing else.
"""

from __future__ import annotations

import functools
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

from .errors import APIError

__all__ = ["PAGE_PATHS", "index", "asset"]

_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
PAGE_PATHS = frozenset({"/", "/web/app.js", "/web/app.css"})  # served to anyone who may reach the server

_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new version of the package serves its new page at once
}


@functools.cache
def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath("web", name).read_bytes()


def _file(name: str) -> Response:
    return Response(_read(name), media_type=_TYPES[name], headers=_HEADERS)


async def index(request: Request) -> Response:
    """GET / (and HEAD /, which answers 200 without a body: clients probe a server that way)."""
    return _file("index.html")


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in _TYPES or name == "index.html":
        raise APIError(404, f"no route {request.method} {request.url.path}", code="not_found")
    return _file(name)
