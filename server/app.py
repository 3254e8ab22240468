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
import logging
import threading
import time
from dataclasses import replace
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import edgeinfer
from edgeinfer.service import ModelPlan, ModelService

from . import metrics as prom
from .body import MAX_JSON_DEPTH, PARSE_ON_LOOP, check_json, parse_json, read_body
from .browser import BrowserGuard
from .config import ServerConfig, check_credentials, key_scope
from .dialects import dialect_routes
from .dialects.shapes import OPENAI, ErrorShape, shape_for_path
from .embeddings import handle_embeddings
from .errors import APIError, from_library_error
from .finite_json import JSONResponse
from .protocol import ParsedRequest, finish_reason, parse_chat, parse_completion
from .reply import OpenAIReply, Reply, ReplyContext, ReplyFactory
from .routing import acquire, keep_alive_field, model_field, models_body, on_disconnect, plan_for, ps_body, stop_model
from .slots import handle_slots
from . import webpage
from .work import WorkPool

__all__ = ["create_app", "check_json", "MAX_JSON_DEPTH", "WORK_THREADS"]

log = logging.getLogger(__name__)
access_log = logging.getLogger("edgeinfer_server.access")

CLIENT_GONE = 499  # nginx's "client closed request": logged, never seen by the client
WORK_THREADS = 2  # threads of each worker pool (server/work.py): prompts and bodies, embeddings


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


def _constraint_field(parsed: Any) -> str:
    """The request field a constraint error names: its tools, grammar or response_format."""
    options = parsed.options
    if parsed.kind == "chat" and parsed.tools.active and options.grammar is None and options.json_schema is None:
        return "tools"
    return "grammar" if options.grammar is not None else "response_format"


def _failure(e: edgeinfer.EdgeInferError, constraint: str) -> APIError:
    """A request that failed while generating: its grammar's budget exhausted (llguidance's per-step
    limits) is the client's constraint, a 400 naming it; anything else a 500."""
    if isinstance(e, edgeinfer.GrammarError):
        return APIError(400, str(e), param=constraint)
    return APIError(500, str(e), type="server_error")


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
        # by (model, kind): generation or embeddings requests admitted and not yet over (event loop only)
        self.in_flight: dict[tuple[str, str], int] = {}
        # CPU-heavy steps off the event loop (server/work.py): bodies, templates, tokenizing, starting
        # a generation (as many waiting as there are connections); embeddings calls (--max-queue)
        self.prepare = WorkPool("prepare", WORK_THREADS, config.max_connections, config.work_timeout_s)
        self.embedding = WorkPool("embedding", WORK_THREADS, config.max_queue, config.work_timeout_s)

    # -- plumbing --------------------------------------------------------------------------------
    def cancel_all(self) -> None:
        """Cancel everything running: every model's requests, the pools' jobs (shutdown, after the
        grace: an embeddings call stops at its next decode)."""
        self.models.cancel_all()
        self.prepare.cancel_all()
        self.embedding.cancel_all()

    def max_tokens_limit(self, plan: ModelPlan) -> int:
        return self.config.max_tokens_limit or plan.n_ctx_per_request

    async def read_json(self, request: Request) -> Any:
        body = await read_body(request, self.config.max_body_bytes)
        if len(body) <= PARSE_ON_LOOP:
            return parse_json(body)
        return await self.prepare.run(lambda cancel: parse_json(body), "request bodies")

    def admit(self, plan: ModelPlan, kind: str = "generation") -> Callable[[], None]:
        """Count one more request of `kind` (generation: the model's slots; embeddings: one at a
        time, its embedder's context) in flight for the model, or refuse it with 503 when its
        --max-queue waiting places are taken; returns the (idempotent) release."""
        running = plan.parallel if kind == "generation" else 1
        key = (plan.key, kind)
        if self.in_flight.get(key, 0) >= running + self.config.max_queue:
            what = "requests running" if kind == "generation" else "embeddings request running"
            raise APIError(503, f"the server is busy: {running} {what} on {plan.name} and "
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
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify() -> None:
            loop.call_soon_threadsafe(wake.set)

        def start(cancel: threading.Event) -> Any:
            """(in the prepare pool: rendering, tokenizing and compiling a grammar take time) The
            generation started; a chat through the library's one chat sequence (tools rendered,
            grammar, calls parsed)."""
            options = parsed.options
            scope = key_scope(request.headers)  # one memory of earlier answers per API key
            if options.speculation.memory_scope != scope:
                options = replace(options, speculation=replace(options.speculation, memory_scope=scope))
            if parsed.kind == "chat":
                fields = parsed.tools
                return engine.chat(list(parsed.messages), options, tools=fields.tools or None,
                                   tool_choice=fields.tool_choice, parallel_tool_calls=fields.parallel_tool_calls,
                                   logprobs=parsed.logprobs, notify=notify)
            return engine.generate(parsed.prompt, options, logprobs=parsed.logprobs, notify=notify)

        try:
            gen = await self.prepare.run(start, "prompts", abandoned=lambda started: started.close())
        except edgeinfer.EdgeInferError as e:
            release()
            if engine.closed:
                what = "the server is shutting down" if self.models.closed else f"{engine.name} was unloaded"
                raise APIError(503, what, type="server_error", code="unavailable",
                               headers={"Retry-After": "1"}) from None
            if isinstance(e, edgeinfer.GrammarError):  # the request's constraint can never be met
                raise APIError(400, str(e), param=_constraint_field(parsed)) from None
            if isinstance(e, edgeinfer.ContextLengthError):  # the prompt's own field, by route
                raise APIError(400, str(e), code="context_length_exceeded",
                               param="messages" if parsed.kind == "chat" else "prompt") from None
            raise from_library_error(e) from None
        except BaseException:
            release()
            raise
        answer = reply(ReplyContext(parsed, engine.name, engine.token_bytes, len(gen.prompt_tokens), loaded - started,
                                    started))
        if parsed.stream:
            def close() -> None:
                gen.close()  # a client gone mid-stream cancels the request: its slot is free at the next step
                release()

            return _EventStream(self._stream(request, gen, wake, answer, _constraint_field(parsed)), close,
                                answer.media_type)
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
                raise _failure(e, _constraint_field(parsed)) from None
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

    async def _stream(self, request: Request, gen, wake: asyncio.Event, reply: Reply,
                      constraint: str) -> AsyncIterator[str]:
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
            for piece in reply.failure(_failure(e, constraint)):
                yield piece
        except APIError as e:  # an event that cannot be written (a NaN: finite_json): the stream ends with it
            gen.cancel()
            for piece in reply.failure(e):
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
        # On the event loop, with no worker thread: it answers while every thread is busy (the
        # service's locks guard bookkeeping only).
        health = self.models.health()
        status, code = ("ok", 200) if health.ok else ("degraded", 503)
        if not check_credentials(self.config, request.headers.get("authorization")):
            return JSONResponse({"status": status}, status_code=code)
        held = self.models.ps()
        default = next((s for s in held if s.path == self.models.default_key), None)
        name, slots = (default.name, default.parallel) if default is not None else (None, 0)
        if default is None and self.models.default_key is not None:  # not loaded now: its plan (a stat)
            plan = await run_in_threadpool(self.models.plan, None)
            name, slots = plan.name, plan.parallel
        return JSONResponse({
            "status": status, "model": name, "slots": slots,
            "slots_busy": sum(s.slots_busy for s in held), "queue_depth": sum(s.queue_depth for s in held),
            "calibrating": any(s.calibrating for s in held),
            **({"problems": list(health.problems)} if health.problems else {}),
            "models": [{"model": s.name, "state": s.state, "slots": s.parallel, "slots_busy": s.slots_busy,
                        "queue_depth": s.queue_depth, "calibrating": s.calibrating} for s in held]},
            status_code=code)

    async def metrics(self, request: Request) -> Response:
        engines = [(e.name, e.metrics()) for e in self.models.engines()]
        text = prom.render(engines, self.http.snapshot(), prom.ServiceGauges.of(self.models))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def ps(self, request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(ps_body, self.models))

    async def stop(self, request: Request) -> Response:
        body = await self.read_json(request)
        result = await run_in_threadpool(stop_model, self.models, body)  # DEFAULT_STOP_TIMEOUT at most
        return JSONResponse(result, status_code=200 if result["stopped"] else 202)


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

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found},
                    middleware=[Middleware(_AccessLog),
                                Middleware(BrowserGuard, config=config,
                                           render=lambda path, e: shape_for_path(path).render(e))])
    app.state.cancel_all = service.cancel_all  # at shutdown, after the grace (server/run.py)
    return app
