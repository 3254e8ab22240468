"""A request's JSON body: read within --max-body, parsed, and refused (one 400 naming the field)
where json.loads accepts what nothing downstream can use.

Parsing costs time that grows with the body (a 1 MiB array of numbers: about 0.1 s to parse and,
walked naively, 1 s to check on a busy 2-core machine), so the app parses bodies larger than
PARSE_ON_LOOP in its worker pool, and the check walks only containers and text (a number costs
one type test).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from .errors import APIError

__all__ = ["MAX_JSON_DEPTH", "PARSE_ON_LOOP", "check_json", "parse_json", "read_body", "media_type"]

MAX_JSON_DEPTH = 64  # objects and arrays inside each other (a json_schema rarely needs 20)
PARSE_ON_LOOP = 64 << 10  # bytes of JSON parsed on the event loop (more: in a worker thread)


def media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


async def read_body(request: Request, limit: int) -> bytes:
    """The body of a JSON request, at most `limit` bytes (415 for another media type, 413 beyond)."""
    ctype = request.headers.get("content-type", "")
    if media_type(ctype) != "application/json":
        # A web page can POST text/plain, form or multipart bodies anywhere without asking;
        # application/json needs a CORS preflight first, which BrowserGuard answers.
        got = f"Content-Type {ctype[:60]!r}" if ctype else "no Content-Type"
        raise APIError(415, f"the request body must be JSON sent with Content-Type: application/json (got {got})",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():  # ClientDisconnect: handled by the endpoint wrapper
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    return bytes(body)


def parse_json(body: bytes) -> Any:
    """The body's value, checked (check_json); APIError 400 otherwise."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    check_json(value)
    return value


def check_json(value: Any) -> None:
    """Refuse what json.loads accepts but nothing downstream can use: text with lone surrogates
    ("\\ud800" is valid JSON but not Unicode: it cannot be encoded for the tokenizer), and
    nesting deeper than MAX_JSON_DEPTH. Iterative, so no depth can overflow the stack; the path of
    a bad text is named in the error (found again by a second walk, only then)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and not _encodes(v):
                _raise_for_text(value)
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels",
                           code="invalid_json")
        if isinstance(v, dict):
            for k in v:
                if not k.isascii() and not _encodes(k):
                    _raise_for_text(value)
            items = v.values()
        else:
            items = v
        for item in items:
            t = type(item)
            if t is str:
                if not item.isascii() and not _encodes(item):
                    _raise_for_text(value)
            elif t is dict or t is list:
                stack.append((item, depth + 1))


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _raise_for_text(value: Any) -> None:
    """The 400 for a text of `value` that is not Unicode, naming where it is."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            _check_text(v, path)
        elif isinstance(v, dict):
            for k, item in v.items():
                where = f"{path}.{k}" if path else k
                _check_text(k, where)
                stack.append((item, where))
        elif isinstance(v, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(v))
    raise APIError(400, "the request body holds text that is not valid Unicode", code="invalid_json")


def _check_text(s: str, where: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        shown = where[:80] or "the body"
        raise APIError(400, f"{shown} contains a lone surrogate (U+{ord(s[e.start]):04X}): "
                       "text must be valid Unicode", code="invalid_json",
                       param=where.split(".")[0].split("[")[0] or None) from None
