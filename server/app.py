"""The Starlette application: OpenAI routes over a BatchEngine.

Each request is tokenized in a worker thread, queued on the engine, and its events are read
without blocking the event loop (the engine's scheduler thread calls back, the handler drains
with `poll()`). A client that disconnects — streaming or not, running or still queued — cancels
its request at once, which frees its slot at the engine's next step. A slow reader only fills its
own bounded event buffer (the engine pauses that request), never the others'.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import edgeinfer

from . import metrics as prom
from .config import ServerConfig, check_credentials
from .errors import APIError, from_library_error
from .protocol import ParsedRequest, Responder, parse_chat, parse_completion

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def _error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class _Service:
    """The handlers, bound to one engine and one configuration."""

    def __init__(self, engine: edgeinfer.BatchEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.http = prom.HttpCounters()
        self.started = int(time.time())
        path = engine.path
        self.names = {engine.name, path.name, path.stem}
        if ":" in engine.name:
            self.names.add(engine.name.partition(":")[0])

    # -- plumbing --------------------------------------------------------------------------------
    @property
    def max_tokens_limit(self) -> int:
        return self.config.max_tokens_limit or self.engine.n_ctx

    async def read_json(self, request: Request) -> Any:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def check_model(self, model: str | None) -> None:
        if model is None or model in self.names:
            return
        known = {m.ref for m in self.engine.store.list()}
        if model in known:
            raise APIError(404, f"model {model!r} is in the store but this server serves {self.engine.name!r}",
                           code="model_not_found", param="model")
        raise APIError(404, f"the model {model!r} does not exist (this server serves {self.engine.name!r})",
                       code="model_not_found", param="model")

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, request: Request, parsed: ParsedRequest) -> Response:
        self.check_model(parsed.model)
        engine = self.engine
        try:
            if parsed.kind == "chat":
                tokens = await run_in_threadpool(engine.chat_tokens, list(parsed.messages))
            elif isinstance(parsed.prompt, str):
                tokens = await run_in_threadpool(engine.tokenize, parsed.prompt)
            else:
                tokens = list(parsed.prompt)
            loop = asyncio.get_running_loop()
            wake = asyncio.Event()
            gen = engine.submit(tokens, parsed.options, logprobs=parsed.logprobs,
                                notify=lambda: loop.call_soon_threadsafe(wake.set))
        except edgeinfer.EdgeInferError as e:
            if engine.closed:
                raise APIError(503, "the server is shutting down", type="server_error", code="unavailable") from None
            raise from_library_error(e) from None
        responder = Responder(parsed, engine.name, engine.token_bytes)
        if parsed.stream:
            return StreamingResponse(self._stream(request, gen, wake, responder), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(_cancel_on_disconnect(request, gen))
        try:
            tokens_seen: list[edgeinfer.TokenEvent] = []
            done = None
            async for batch in _events(gen, wake, None):
                for e in batch:
                    if isinstance(e, edgeinfer.DoneEvent):
                        done = e
                    elif isinstance(e, edgeinfer.TokenEvent):
                        tokens_seen.append(e)
        except edgeinfer.EdgeInferError as e:
            raise APIError(500, str(e), type="server_error") from None
        finally:
            watcher.cancel()
            gen.close()
        assert done is not None
        return JSONResponse(responder.complete(tokens_seen, done))

    async def _stream(self, request: Request, gen, wake: asyncio.Event, responder: Responder) -> AsyncIterator[str]:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, gen))
        try:
            first = responder.first_chunk()
            if first is not None:
                yield _sse(first)
            async for batch in _events(gen, wake, self.config.keepalive_s):
                if not batch:
                    yield ": keepalive\n\n"
                    continue
                tokens = [e for e in batch if isinstance(e, edgeinfer.TokenEvent)]
                if tokens:
                    chunk = responder.delta_chunk(tokens)
                    if chunk is not None:
                        yield _sse(chunk)
                done = next((e for e in batch if isinstance(e, edgeinfer.DoneEvent)), None)
                if done is not None:
                    for chunk in responder.last_chunks(done):
                        yield _sse(chunk)
                    yield "data: [DONE]\n\n"
        except edgeinfer.EdgeInferError as e:
            yield _sse(APIError(500, str(e), type="server_error").body())
        finally:
            watcher.cancel()
            gen.close()  # a client gone mid-stream cancels the request: its slot is free at the next step

    # -- routes ----------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        return await self.generate(request, parse_chat(body, self.max_tokens_limit, self.config.default_speculation))

    async def completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        return await self.generate(request, parse_completion(body, self.max_tokens_limit,
                                                             self.config.default_speculation))

    async def models(self, request: Request) -> Response:
        engine = self.engine
        data = [{"id": engine.name, "object": "model", "created": self.started, "owned_by": "edgeinfer",
                 "edgeinfer": {"loaded": True, "parallel": engine.parallel, "n_ctx_per_request": engine.n_ctx}}]
        for m in await run_in_threadpool(engine.store.list):
            if m.ref != engine.name:
                data.append({"id": m.ref, "object": "model", "created": self.started, "owned_by": "edgeinfer",
                             "edgeinfer": {"loaded": False}})
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        m = self.engine.metrics()
        return JSONResponse({"status": "ok", "model": self.engine.name, "slots_busy": m.active,
                             "slots": self.engine.parallel, "queue_depth": m.queue_depth})

    async def metrics(self, request: Request) -> Response:
        text = prom.render(self.engine.name, self.engine.metrics(), self.http.snapshot())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def _events(gen, wake: asyncio.Event, keepalive_s: float | None) -> AsyncIterator[list]:
    """Batches of a generation's events as they arrive; an empty batch after `keepalive_s`
    seconds without any (for SSE keep-alive lines)."""
    while True:
        wake.clear()  # before polling: a notification that lands after the poll is kept
        batch = gen.poll()
        if batch:
            yield batch
        if gen.finished:
            return
        if not batch:
            try:
                await asyncio.wait_for(wake.wait(), keepalive_s)
            except TimeoutError:
                yield []


async def _cancel_on_disconnect(request: Request, gen) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.cancel()
            return


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine: edgeinfer.BatchEngine, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving `engine` (which the caller owns and closes)."""
    config = (config or ServerConfig()).validate()
    service = _Service(engine, config)
    open_paths = {"/health"}

    def endpoint(name: str, handler):
        async def run(request: Request) -> Response:
            try:
                if request.url.path not in open_paths and not check_credentials(
                        config, request.headers.get("authorization")):
                    raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                   code="invalid_api_key")
                response = await handler(request)
            except APIError as e:
                response = _error_response(e)
            except Exception:  # the server keeps serving; the client gets a 500 object
                log.exception("%s failed", name)
                response = _error_response(APIError(500, "internal server error", type="server_error"))
            service.http.count(name, response.status_code)
            return response

        return run

    routes = [
        Route("/v1/chat/completions", endpoint("chat_completions", service.chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint("completions", service.completions), methods=["POST"]),
        Route("/v1/models", endpoint("models", service.models), methods=["GET"]),
        Route("/health", endpoint("health", service.health), methods=["GET"]),
        Route("/metrics", endpoint("metrics", service.metrics), methods=["GET"]),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return _error_response(APIError(status, f"no route {request.method} {request.url.path}",
                                        code="not_found" if status == 404 else "method_not_allowed"))

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
