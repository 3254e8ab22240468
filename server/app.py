"""The Starlette application: OpenAI routes over edgeinfer's ModelService (a BatchEngine per model).

Each request is tokenized in a worker thread, queued on the engine, and its events are read
without blocking the event loop (the engine's scheduler thread calls back, the handler drains
with `poll()`). A client that disconnects — streaming or not, running or still queued — cancels
its request at once, which frees its slot at the engine's next step. A slow reader only fills its
own bounded event buffer (the engine pauses that request), never the others'; one that reads
nothing for --stall-timeout is disconnected (server/connection.py), which cancels it.

Each request is routed by its `model` (server/routing.py: loaded on first use, kept for its
keep_alive, evicted when idle to make room). At most `parallel + max_queue` generation requests
per model are in flight (that model's slots, and --max-queue waiting for them or for its load);
one more gets 503 with Retry-After. Every request leaves one access-log line (logger `edgeinfer_server.access`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import edgeinfer
from edgeinfer.service import ModelPlan, ModelService

from . import metrics as prom
from .browser import BrowserGuard
from .config import ServerConfig, check_credentials
from .dialects import dialect_routes
from .dialects.shapes import OPENAI, ErrorShape, shape_for_path
from .embeddings import handle_embeddings
from .errors import APIError, from_library_error
from .protocol import ParsedRequest, finish_reason, parse_chat, parse_completion
from .reply import OpenAIReply, Reply, ReplyContext, ReplyFactory
from .routing import acquire, keep_alive_field, model_field, models_body, on_disconnect, plan_for, ps_body, stop_model
from .slots import handle_slots
from .tools import prepare_chat
from . import webpage

__all__ = ["create_app", "check_json", "MAX_JSON_DEPTH"]

log = logging.getLogger(__name__)
access_log = logging.getLogger("edgeinfer_server.access")

MAX_JSON_DEPTH = 64  # objects and arrays inside each other (a json_schema rarely needs 20)
CLIENT_GONE = 499  # nginx's "client closed request": logged, never seen by the client


# -- the request body --------------------------------------------------------------------------


def check_json(value: Any) -> None:
    """Refuse what json.loads accepts but nothing downstream can use: text with lone surrogates
    ("\\ud800" is valid JSON but not Unicode: it cannot be encoded for the tokenizer), and
    nesting deeper than MAX_JSON_DEPTH. Iterative, so no depth can overflow the stack."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, str):
            _check_text(v, path)
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels",
                               code="invalid_json")
            if isinstance(v, dict):
                for k, item in v.items():
                    where = f"{path}.{k}" if path else k
                    _check_text(k, where)
                    stack.append((item, depth + 1, where))
            else:
                stack.extend((item, depth + 1, f"{path}[{i}]") for i, item in enumerate(v))


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


def _media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


# -- streaming ---------------------------------------------------------------------------------


class _EventStream(Response):
    """A stream of text pieces from an async iterator (server-sent events, or NDJSON lines).
    `on_close` runs however the response ends (finished, cancelled, or never started because the
    client was gone)."""

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None], media_type: str):
        self.chunks = chunks
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.media_type = media_type
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with contextlib.aclosing(self.chunks) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    # a client gone makes this return at once (uvicorn drops the bytes); the
                    # disconnect watcher has cancelled the request, so the events end soon
                    await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.on_close()


# -- the access log ----------------------------------------------------------------------------


class _Access:
    """What one request's access-log line says; the generation handlers add the stats."""

    __slots__ = ("status", "stats", "finish")

    def __init__(self) -> None:
        self.status = 0
        self.stats: edgeinfer.GenerationStats | None = None
        self.finish: str | None = None


def _printable(text: str, limit: int = 200) -> str:
    """A path as one token of a log line: spaces, control and invisible characters escaped."""
    out = "".join(c if c.isprintable() and c != " " else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                  for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


def access_line(scope: Scope, record: _Access, seconds: float) -> str:
    """`127.0.0.1:51234 POST /v1/chat/completions 200 stop prompt=25 completion=32 ttft=0.151s 48.3 tok/s 0.81s`"""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    parts = [who, scope.get("method", "-"), _printable(scope.get("path", "")), str(record.status or CLIENT_GONE)]
    s = record.stats
    if s is not None:
        parts += [record.finish or "-", f"prompt={s.prompt_tokens}", f"completion={s.generated_tokens}",
                  f"ttft={s.ttft_s:.3f}s", f"{s.decode_tok_s:.1f} tok/s"]
    parts.append(f"{seconds:.3f}s")
    return " ".join(parts)


class _AccessLog:
    """ASGI middleware: one line per request when it has ended (a stream: when its last event
    was sent), so that a line carries the request's tokens, time to first token and speed."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = _Access()
        scope["edgeinfer.access"] = record
        started = time.perf_counter()

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            access_log.info("%s", access_line(scope, record, time.perf_counter() - started))


def _note(request: Request, done: edgeinfer.DoneEvent) -> None:
    record = request.scope.get("edgeinfer.access")
    if record is not None:
        record.stats = done.stats
        record.finish = finish_reason(done.finish_reason)


# -- the service -------------------------------------------------------------------------------


class _Service:
    """The handlers, bound to one model service and one configuration."""

    def __init__(self, models: ModelService, config: ServerConfig):
        self.models = models
        self.config = config
        self.http = prom.HttpCounters()
        self.started = int(time.time())
        self.in_flight: dict[str, int] = {}  # by model: generation requests admitted and not yet over (event loop only)

    # -- plumbing --------------------------------------------------------------------------------
    def max_tokens_limit(self, plan: ModelPlan) -> int:
        return self.config.max_tokens_limit or plan.n_ctx_per_request

    async def read_json(self, request: Request) -> Any:
        ctype = request.headers.get("content-type", "")
        if _media_type(ctype) != "application/json":
            # A web page can POST text/plain, form or multipart bodies anywhere without asking;
            # application/json needs a CORS preflight first, which BrowserGuard answers.
            got = f"Content-Type {ctype[:60]!r}" if ctype else "no Content-Type"
            raise APIError(415, f"the request body must be JSON sent with Content-Type: application/json (got {got})",
                           code="unsupported_media_type")
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():  # ClientDisconnect: handled by the endpoint wrapper
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        try:
            value = json.loads(body)
        except RecursionError:
            raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels",
                           code="invalid_json") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        check_json(value)
        return value

    def admit(self, plan: ModelPlan) -> Callable[[], None]:
        """Count one more generation request in flight for the model, or refuse it with 503 when
        its queue is full; returns the (idempotent) release."""
        running, key = plan.parallel, plan.key
        if self.in_flight.get(key, 0) >= running + self.config.max_queue:
            raise APIError(503, f"the server is busy: {running} requests running on {plan.name} and "
                           f"{self.config.max_queue} waiting (--max-queue); retry later", type="server_error",
                           code="queue_full", headers={"Retry-After": "1"})
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight[key] -= 1
                if not self.in_flight[key]:
                    del self.in_flight[key]

        return release

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, request: Request, parsed: ParsedRequest, plan: ModelPlan, keep_alive: float | None,
                       reply: ReplyFactory = OpenAIReply) -> Response:
        """The one request path of every generation route; `reply` turns its events into the
        route's dialect (server/reply.py)."""
        started = time.perf_counter()
        admitted = self.admit(plan)
        try:
            lease = await acquire(self.models, parsed.model, keep_alive, request)
        except BaseException:
            admitted()
            raise

        def release() -> None:
            admitted()
            lease.release()

        engine = lease.engine
        loaded = time.perf_counter()
        try:
            options, tools = parsed.options, None
            if parsed.kind == "chat":
                tokens, options, tools = await run_in_threadpool(prepare_chat, engine, parsed.messages, options,
                                                                 parsed.tools)
            elif isinstance(parsed.prompt, str):
                tokens = await run_in_threadpool(engine.tokenize, parsed.prompt)
            else:
                tokens = list(parsed.prompt)
            loop = asyncio.get_running_loop()
            wake = asyncio.Event()
            # (the check compiles a grammar against the vocabulary: in a worker thread, as the parse)
            gen = await run_in_threadpool(lambda: engine.submit(tokens, options, logprobs=parsed.logprobs,
                                                                notify=lambda: loop.call_soon_threadsafe(wake.set)))
            if tools is not None:  # content and tool calls parsed out of the text
                gen = tools.wrap(gen)
        except edgeinfer.EdgeInferError as e:
            release()
            if engine.closed:
                what = "the server is shutting down" if self.models.closed else f"{engine.name} was unloaded"
                raise APIError(503, what, type="server_error", code="unavailable",
                               headers={"Retry-After": "1"}) from None
            if isinstance(e, edgeinfer.GrammarError):  # the request's constraint can never be met
                field = "tools" if tools is not None and parsed.options.grammar is None and \
                    parsed.options.json_schema is None else "grammar" if parsed.options.grammar is not None \
                    else "response_format"
                raise APIError(400, str(e), param=field) from None
            raise from_library_error(e) from None
        except BaseException:
            release()
            raise
        answer = reply(ReplyContext(parsed, engine.name, engine.token_bytes, len(tokens), loaded - started, started))
        if parsed.stream:
            def close() -> None:
                gen.close()  # a client gone mid-stream cancels the request: its slot is free at the next step
                release()

            return _EventStream(self._stream(request, gen, wake, answer), close, answer.media_type)
        watcher = asyncio.create_task(on_disconnect(request, gen.cancel))
        try:  # the lease is held until the response is built (logprobs read the model's vocabulary)
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
            _note(request, done)
            try:
                return answer.whole(tokens_seen, done)
            except edgeinfer.EngineClosedError:  # stopped (edgeinfer stop) before its logprobs were read
                raise APIError(503, f"{engine.name} was unloaded while this request ran", type="server_error",
                               code="unavailable", headers={"Retry-After": "1"}) from None
        finally:
            release()

    async def _stream(self, request: Request, gen, wake: asyncio.Event, reply: Reply) -> AsyncIterator[str]:
        watcher = asyncio.create_task(on_disconnect(request, gen.cancel))
        try:
            for piece in reply.opening():
                yield piece
            async for batch in _events(gen, wake, self.config.keepalive_s):
                if not batch:
                    keepalive = reply.keepalive()
                    if keepalive:
                        yield keepalive
                    continue
                for piece in reply.events(batch):
                    yield piece
                done = next((e for e in batch if isinstance(e, edgeinfer.DoneEvent)), None)
                if done is not None:
                    _note(request, done)
                    for piece in reply.closing(done):
                        yield piece
        except edgeinfer.EdgeInferError as e:
            for piece in reply.failure(APIError(500, str(e), type="server_error")):
                yield piece
        finally:
            watcher.cancel()

    # -- routes ----------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        plan = await plan_for(self.models, model_field(body))  # the model's context and speculation
        keep_alive = keep_alive_field(body)
        # (a schema or grammar is compiled and checked while parsing: in a worker thread, not on the event loop)
        parsed = await run_in_threadpool(parse_chat, body, self.max_tokens_limit(plan), plan.speculation)
        return await self.generate(request, parsed, plan, keep_alive)

    async def completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        plan = await plan_for(self.models, model_field(body))
        keep_alive = keep_alive_field(body)
        parsed = await run_in_threadpool(parse_completion, body, self.max_tokens_limit(plan), plan.speculation)
        return await self.generate(request, parsed, plan, keep_alive)

    async def models_list(self, request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(models_body, self.models, self.started))

    async def health(self, request: Request) -> Response:
        # Liveness for anyone (load balancers, probes); the rest only with the key, when there is one.
        if not check_credentials(self.config, request.headers.get("authorization")):
            return JSONResponse({"status": "ok"})
        held = await run_in_threadpool(self.models.ps)
        default = await run_in_threadpool(lambda: self.models.plan(None) if self.models.default_name else None)
        return JSONResponse({
            "status": "ok", "model": default.name if default else None, "slots": default.parallel if default else 0,
            "slots_busy": sum(s.slots_busy for s in held), "queue_depth": sum(s.queue_depth for s in held),
            "calibrating": any(s.calibrating for s in held),
            "models": [{"model": s.name, "state": s.state, "slots": s.parallel, "slots_busy": s.slots_busy,
                        "queue_depth": s.queue_depth, "calibrating": s.calibrating} for s in held]})

    async def metrics(self, request: Request) -> Response:
        engines = [(e.name, e.metrics()) for e in self.models.engines()]
        text = prom.render(engines, self.http.snapshot(), prom.ServiceGauges.of(self.models))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def ps(self, request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(ps_body, self.models))

    async def stop(self, request: Request) -> Response:
        body = await self.read_json(request)
        return JSONResponse(await run_in_threadpool(stop_model, self.models, body))


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




def create_app(models: ModelService | edgeinfer.BatchEngine, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving the models of `models` (which the caller owns and closes); a
    BatchEngine is served as the default model of a service adopting it (others load beside it)."""
    config = (config or ServerConfig()).validate()
    if isinstance(models, edgeinfer.BatchEngine):
        models = ModelService.adopt(models)
    service = _Service(models, config)
    open_paths = {"/health", *webpage.PAGE_PATHS}  # the chat page asks for the key itself

    def endpoint(name: str, handler, shape: ErrorShape = OPENAI):
        """A route's handler behind the key check, with its errors in its dialect's shape."""
        async def run(request: Request) -> Response:
            try:
                if request.url.path not in open_paths and not shape.authorized(config, request.headers):
                    raise APIError(401, shape.key_hint, code="invalid_api_key")
                response = await handler(request)
            except APIError as e:
                response = shape.render(e)
            except ClientDisconnect:  # gone while sending its body or waiting for its model: nobody to answer
                log.debug("%s: the client disconnected before its answer began", name)
                response = Response(status_code=CLIENT_GONE)
            except Exception:  # the server keeps serving; the client gets a 500 object
                log.exception("%s failed", name)
                response = shape.render(APIError(500, "internal server error", type="server_error"))
            service.http.count(name, response.status_code)
            return response

        return run

    routes = [
        Route("/", endpoint("page", webpage.index), methods=["GET"]),  # (and HEAD)
        Route("/web/{name}", endpoint("page", webpage.asset), methods=["GET"]),
        Route("/v1/chat/completions", endpoint("chat_completions", service.chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint("completions", service.completions), methods=["POST"]),
        Route("/v1/embeddings", endpoint("embeddings", lambda request: handle_embeddings(service, request)),
              methods=["POST"]),
        Route("/v1/models", endpoint("models", service.models_list), methods=["GET"]),
        Route("/health", endpoint("health", service.health), methods=["GET"]),
        Route("/metrics", endpoint("metrics", service.metrics), methods=["GET"]),
        Route("/slots/{id_slot}", endpoint("slots", lambda request: handle_slots(service, request)), methods=["POST"]),
        Route("/edgeinfer/ps", endpoint("ps", service.ps), methods=["GET"]),
        Route("/edgeinfer/stop", endpoint("stop", service.stop), methods=["POST"]),
        *dialect_routes(service, endpoint),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return shape_for_path(request.url.path).render(APIError(
            status, f"no route {request.method} {request.url.path}",
            code="not_found" if status == 404 else "method_not_allowed"))

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found},
                     middleware=[Middleware(_AccessLog),
                                 Middleware(BrowserGuard, config=config,
                                            render=lambda path, e: shape_for_path(path).render(e))])
