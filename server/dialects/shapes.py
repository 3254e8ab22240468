"""Each dialect's error body, and which headers carry its API key.

- OpenAI (chat, completions, Responses, every route that is not another dialect's):
  `{"error": {"message", "type", "param", "code"}}` (server/errors.py).
- Anthropic (`/v1/messages...`): `{"type": "error", "error": {"type", "message"}}`, the type named
  by the status as Anthropic names it; the key in `x-api-key` or `Authorization: Bearer`.
- Ollama (`/api/...` and `HEAD /`): `{"error": "message"}`.

Errors raised before a route runs (a refused Host or Origin, an unknown path) take the shape of
the dialect the path belongs to (`shape_for_path`), so each client reads its own error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response

from ..config import ServerConfig, check_credentials
from ..errors import APIError

__all__ = ["ErrorShape", "OPENAI", "ANTHROPIC", "OLLAMA", "shape_for_path", "anthropic_error_type"]

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "not_found_error", 409: "invalid_request_error",
                    413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def _anthropic(e: APIError) -> Response:
    body = {"type": "error", "error": {"type": anthropic_error_type(e.status), "message": e.message}}
    return JSONResponse(body, status_code=e.status, headers=e.headers or None)


def _ollama(e: APIError) -> Response:
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers or None)


@dataclass(frozen=True)
class ErrorShape:
    render: Callable[[APIError], Response]
    key_headers: tuple[str, ...] = ("authorization",)  # lower case; "authorization" carries "Bearer KEY"

    def authorized(self, config: ServerConfig, headers: Mapping[str, str]) -> bool:
        """Whether any of the dialect's key headers carries the server's key (always, without one)."""
        if not config.api_key:
            return True
        for name in self.key_headers:
            value = headers.get(name)
            if value is not None and check_credentials(config, value if name == "authorization" else f"Bearer {value}"):
                return True
        return False

    @property
    def key_hint(self) -> str:
        where = " or ".join("Authorization: Bearer KEY" if h == "authorization" else f"{h}: KEY"
                            for h in self.key_headers)
        return f"a valid API key is required ({where})"


OPENAI = ErrorShape(lambda e: e.response())
ANTHROPIC = ErrorShape(_anthropic, ("x-api-key", "authorization"))
OLLAMA = ErrorShape(_ollama)


def shape_for_path(path: str) -> ErrorShape:
    if path == "/api" or path.startswith("/api/"):
        return OLLAMA
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    return OPENAI
