"""Requests routed by their `model` through edgeinfer's ModelService, and the admin routes.

Every generation or embeddings request names a model (or none: the server's default); the service
resolves the name, loads the model on first use (in a worker thread: the event loop never waits
for a load) and hands out a lease on its engine, released when the response has ended. The extra
body field `keep_alive` (seconds, or "30s" / "5m" / "1h"; 0 unloads the model after the request,
a negative value keeps it for ever) sets how long the model stays once idle, as Ollama's.

Admin routes (behind the same API-key check as every route but /health, and the same Host and
Origin checks): `GET /edgeinfer/ps` lists the models held, with their estimated memory by part,
slots, idle time and expiry, beside the server process's own resident memory; `POST
/edgeinfer/stop` with {"model": NAME} unloads one now, cancelling its running requests.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

import edgeinfer
from edgeinfer.service import Lease, ModelNotLoadedError, ModelPlan, ModelService, ModelTooLargeError, NoRoomError, \
    parse_duration

from .errors import APIError, from_library_error

__all__ = ["keep_alive_field", "model_field", "plan_for", "acquire", "on_disconnect", "models_body", "ps_body",
           "stop_model", "process_memory"]


def model_field(body: Any) -> str | None:
    model = body.get("model") if isinstance(body, Mapping) else None
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model")
    return model


def keep_alive_field(body: Any) -> float | None:
    """The extra field `keep_alive`: seconds (a number or a duration text), None when absent."""
    value = body.get("keep_alive") if isinstance(body, Mapping) else None
    if value is None:
        return None
    try:
        return parse_duration(value, "'keep_alive'")
    except edgeinfer.InvalidOptionError as e:
        raise APIError(400, str(e), param="keep_alive") from None


async def plan_for(service: ModelService, model: str | None) -> ModelPlan:
    """The model a request names, sized (404 for a name that is no model)."""
    try:
        return await run_in_threadpool(service.plan, model)
    except edgeinfer.ModelNotFoundError as e:
        raise APIError(404, str(e), code="model_not_found", param="model") from None
    except edgeinfer.EdgeInferError as e:
        raise from_library_error(e) from None


async def on_disconnect(request: Request, then: Callable[[], None]) -> None:
    """Call `then` once the client of `request` (whose body was read) has disconnected; run it as a
    task and cancel the task when the answer no longer needs it."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            then()
            return


async def acquire(service: ModelService, model: str | None, keep_alive: float | None,
                  request: Request | None = None) -> Lease:
    """A lease on the named model, loaded first if need be (in a worker thread). A client of
    `request` that disconnects meanwhile cancels its wait — for room, for the model's load — and
    a load no other request waits for (ClientDisconnect: nobody to answer)."""
    cancel = threading.Event()
    watcher = asyncio.create_task(on_disconnect(request, cancel.set)) if request is not None else None
    try:
        return await run_in_threadpool(lambda: service.acquire(model, keep_alive=keep_alive, cancel=cancel))
    except edgeinfer.Cancelled:
        raise ClientDisconnect() from None
    except ModelTooLargeError as e:
        raise APIError(400, str(e), code="model_too_large", param="model") from None
    except NoRoomError as e:
        raise APIError(503, str(e), type="server_error", code="no_room", headers={"Retry-After": "1"}) from None
    except edgeinfer.ModelNotFoundError as e:
        raise APIError(404, str(e), code="model_not_found", param="model") from None
    except edgeinfer.EngineClosedError:
        raise APIError(503, "the server is shutting down", type="server_error", code="unavailable") from None
    except edgeinfer.EdgeInferError as e:
        raise APIError(500, f"could not load {model or 'the default model'}: {e}", type="server_error",
                       code="model_load_failed") from None
    finally:
        if watcher is not None:
            watcher.cancel()


def models_body(service: ModelService, created: int) -> dict[str, Any]:
    """/v1/models: every model a request may name; the loaded ones with their slots and context."""
    data = []
    for entry in service.catalog():
        info: dict[str, Any] = {"loaded": entry.status is not None and entry.status.state == "ready"}
        if entry.status is not None:
            s = entry.status
            info.update(state=s.state, parallel=s.parallel, n_ctx=s.n_ctx, n_ctx_per_request=s.n_ctx_per_request,
                        speculation=s.speculation)
        if entry.aliases:
            info["aliases"] = list(entry.aliases)
        data.append({"id": entry.name, "object": "model", "created": created, "owned_by": "edgeinfer",
                     "edgeinfer": info})
    return {"object": "list", "data": data}


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """Resident memory of a process from /proc/PID/status, in bytes: rss, anon (heap, KV cache,
    compute buffers), file (mapped files: the weights); {} where there is no /proc."""
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in keys:
                    out[keys[name]] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def ps_body(service: ModelService) -> dict[str, Any]:
    """/edgeinfer/ps: what the server holds, and what it may hold."""
    models = [s.to_dict() for s in service.ps()]
    return {"models": models, "budget": service.budget, "reserved": service.reserved,
            "max_loaded": service.options.max_loaded, "keep_alive": service.options.keep_alive,
            "process": {"pid": os.getpid(), **process_memory()}, "time": time.time()}


def stop_model(service: ModelService, body: Any) -> dict[str, Any]:
    """/edgeinfer/stop (in a worker thread): unload {"model": NAME} now."""
    if not isinstance(body, Mapping):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - {"model"})
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r} for /edgeinfer/stop (known: model)", param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' must be the name of a loaded model", param="model")
    try:
        result = service.stop(model)
    except ModelNotLoadedError as e:
        raise APIError(404, str(e), code="model_not_loaded", param="model") from None
    except edgeinfer.EdgeInferError as e:
        raise from_library_error(e) from None
    return {"model": result.name, "stopped": True, "cancelled": result.cancelled}
