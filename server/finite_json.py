"""JSON that never carries NaN or infinity: every JSON text the server writes — whole responses,
server-sent events, NDJSON lines — goes through `dumps` (json.dumps with allow_nan=False), and
`JSONResponse` renders with it. Python's json writes a bare `NaN` otherwise (no client parses it),
and Starlette's JSONResponse raised a ValueError that became a bare 500. A value that is not a
finite number (a model whose state or weights hold NaN: its logprobs) is one clear error instead,
naming where it is: a 500 `non_finite_value` for a whole response, the dialect's error event for
a stream.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.responses import JSONResponse as _StarletteJSON

from .errors import APIError

__all__ = ["JSONResponse", "dumps", "non_finite_path"]


def non_finite_path(value: Any) -> str | None:
    """Where the first float of `value` that is not finite is (`choices[0].logprobs`), or None."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return path or "the value"
        if isinstance(v, dict):
            stack.extend((item, f"{path}.{k}" if path else str(k)) for k, item in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(v))
    return None


def dumps(value: Any, **kw: Any) -> str:
    """json.dumps(value) with allow_nan=False: APIError 500 (code non_finite_value) naming where a
    NaN or an infinity is, instead of writing it."""
    try:
        return json.dumps(value, allow_nan=False, **kw)
    except ValueError:
        where = non_finite_path(value)
        if where is None:
            raise
        raise APIError(500, f"the reply would hold a number that is not finite (NaN or infinity) at {where[:120]}: "
                       "the model's state or weights are broken", type="server_error",
                       code="non_finite_value") from None


class JSONResponse(_StarletteJSON):
    """Starlette's JSONResponse, rendered by `dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
