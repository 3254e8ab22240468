"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}` with the status."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

import edgeinfer

__all__ = ["APIError", "from_library_error"]


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status == 401:
            self.headers.setdefault("WWW-Authenticate", "Bearer")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def from_library_error(e: edgeinfer.EdgeInferError) -> APIError:
    """The status and code of an edgeinfer error raised while starting a request."""
    if isinstance(e, edgeinfer.ContextLengthError):
        return APIError(400, str(e), code="context_length_exceeded", param="messages")
    if isinstance(e, edgeinfer.ModelNotFoundError):
        return APIError(404, str(e), code="model_not_found", param="model")
    if isinstance(e, (edgeinfer.InvalidOptionError, edgeinfer.InvalidModelError)):
        return APIError(400, str(e))
    return APIError(500, str(e), type="server_error")
