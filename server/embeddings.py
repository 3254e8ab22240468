"""`POST /v1/embeddings`: OpenAI's embeddings request over the engine's `embed`.

The OpenAI shape: `input` is a string, a list of strings, a list of token ids (one input) or a
list of token-id lists; `encoding_format` float (default) or base64 (little-endian float32, what
the `openai` client asks for unless told otherwise); `dimensions` shortens the vectors where the
model declares Matryoshka training; `usage` counts the tokens embedded. Extra fields (edgeinfer's):
`pooling` (mean | cls | last: needed for a model that declares none), `normalize` (true/false:
overrides the model's rule), `prompt_name` (a prompt the model declares, e.g. Qwen3-Embedding's
"query" instruction), `truncate` (cut inputs longer than the context instead of a 400) and
`keep_alive` (as for generation: server/routing.py). The request is routed by its `model`.
Parsing is strict: an unknown field, a wrong type or an empty input is a 400 that names it.

The vectors are computed in a worker thread (the engine's embedder serializes calls on a context
of its own, beside the generation slots); a client that disconnects cancels its request between
two decodes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

import edgeinfer

from .errors import APIError, from_library_error
from .routing import acquire, keep_alive_field, on_disconnect

__all__ = ["EmbeddingsRequest", "parse_embeddings", "embeddings_body", "handle_embeddings", "run_embeddings",
           "MAX_INPUTS"]

MAX_INPUTS = 2048  # inputs per request, as OpenAI's API
_FIELDS = {"input", "model", "encoding_format", "dimensions", "user", "pooling", "normalize", "prompt_name", "truncate",
           "keep_alive"}
_CLIENT_GONE = 499


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    options: edgeinfer.EmbedOptions
    base64: bool


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _token_ids(value: list[Any], where: str) -> tuple[int, ...]:
    if not value:
        raise _bad(f"{where} is an empty list of token ids", "input")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise _bad(f"{where} must hold integers (token ids), got {type(t).__name__} {t!r}", "input")
    return tuple(value)


def _inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise _bad(f"'input' must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                   f"got {type(value).__name__}", "input")
    if not value:
        raise _bad("'input' is an empty list", "input")
    if len(value) > MAX_INPUTS:
        raise _bad(f"'input' has {len(value)} items, more than the {MAX_INPUTS} one request may embed", "input")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return (_token_ids(value, "'input'"),)  # one input given as token ids
    out: list[str | tuple[int, ...]] = []
    for i, v in enumerate(value):
        if isinstance(v, str):
            if not v:
                raise _bad(f"'input[{i}]' is an empty string", "input")
            out.append(v)
        elif isinstance(v, list):
            out.append(_token_ids(v, f"'input[{i}]'"))
        else:
            raise _bad(f"'input[{i}]' must be a string or a list of token ids, got {type(v).__name__}", "input")
    return tuple(out)


def parse_embeddings(body: Any) -> EmbeddingsRequest:
    """The request body as library types; APIError (400) naming the field otherwise."""
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise _bad(f"unknown field {unknown[0]!r} for /v1/embeddings (known: {', '.join(sorted(_FIELDS))})", unknown[0])
    if "input" not in body:
        raise _bad("'input' is required", "input")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise _bad(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    for name in ("normalize", "truncate"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise _bad(f"'{name}' must be true or false, got {body[name]!r}", name)
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise _bad(f"'dimensions' must be a positive integer, got {dims!r}", "dimensions")
    for name in ("pooling", "prompt_name"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(f"'{name}' must be a string, got {body[name]!r}", name)
    options = edgeinfer.EmbedOptions(pooling=body.get("pooling"), normalize=body.get("normalize"), dimensions=dims,
                                     truncate=bool(body.get("truncate") or False), prompt_name=body.get("prompt_name"))
    try:
        options.validate()
    except edgeinfer.InvalidOptionError as e:
        raise _bad(str(e)) from None
    return EmbeddingsRequest(model, _inputs(body["input"]), options, fmt == "base64")


def embeddings_body(result: Any, model: str, as_base64: bool) -> bytes:
    """The response JSON (OpenAI's list of embedding objects with usage), encoded."""
    vectors = result.vectors
    if as_base64:
        items = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        items = vectors.tolist()
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(items)]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return json.dumps({"object": "list", "data": data, "model": model, "usage": usage}).encode()


async def handle_embeddings(service: Any, request: Request) -> Response:
    """The route: `service` is the app's (its read_json and its model service, `models`)."""
    body = await service.read_json(request)
    parsed = parse_embeddings(body)
    keep_alive = keep_alive_field(body)
    return await run_embeddings(service, request, parsed, keep_alive,
                                lambda result, model, load_s: embeddings_body(result, model, parsed.base64))


async def run_embeddings(service: Any, request: Request, parsed: EmbeddingsRequest, keep_alive: float | None,
                         body: Callable[[edgeinfer.EmbeddingResult, str, float], bytes]) -> Response:
    """The one embeddings path (OpenAI's route and Ollama's): the model leased, the vectors computed
    in a worker thread, `body(result, model name, seconds waiting for the model)` encoded there too."""
    started = time.perf_counter()
    lease = await acquire(service.models, parsed.model, keep_alive, request)
    load_s = time.perf_counter() - started
    engine = lease.engine
    cancel = threading.Event()
    watcher = asyncio.create_task(on_disconnect(request, cancel.set))
    inputs = [x if isinstance(x, str) else list(x) for x in parsed.inputs]
    try:
        result = await run_in_threadpool(lambda: engine.embed(inputs, parsed.options, cancel=cancel))
        content = await run_in_threadpool(body, result, engine.name, load_s)
    except edgeinfer.Cancelled:
        return Response(status_code=_CLIENT_GONE)
    except edgeinfer.ContextLengthError as e:
        raise APIError(400, str(e), code="context_length_exceeded", param="input") from None
    except edgeinfer.EngineClosedError:
        raise APIError(503, "the server is shutting down", type="server_error", code="unavailable") from None
    except edgeinfer.EdgeInferError as e:
        raise from_library_error(e) from None
    finally:
        watcher.cancel()
        lease.release()
    return Response(content, media_type="application/json")
