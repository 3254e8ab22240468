"""`POST /slots/{id}?action=save|restore|erase`: a slot's KV cache saved to a file and back, as
llama-server does it (its --slot-save-path), with the same body and response shapes:

    save     {"filename": NAME}  -> {"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}
    restore  {"filename": NAME}  -> {"id_slot", "filename", "n_restored", "n_read", "timings": {"restore_ms"}}
    erase    (no body, or {})    -> {"id_slot", "n_erased"}

An extra body field `model` names the model whose slot it is (default: the server's default).

The files live in the store, `$EDGEINFER_HOME/slots/NAME`, and nowhere else: a name is 1-128
letters, digits, '.', '_' and '-', starting with a letter or digit, with no '..' (so no path
separator, no absolute path, no NUL, nothing hidden); a name that is a symbolic link, or that
resolves outside that folder, is refused. A restored file passes every check of
edgeinfer.engine.state.session first (this model's hash, its KV types, sizes, hash, layout): one that does
not is a 400 saying why, and the slot keeps what it had. The work runs on the engine's scheduler
thread between two steps, on an idle slot only: a slot that runs a request is a 409 (llama-server
defers the task instead; a client retries). The routes sit behind the API-key check like every
route but /health.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import edgeinfer
from edgeinfer.fsutil import is_inside

from .errors import APIError, from_library_error

__all__ = ["handle_slots", "check_filename", "slots_dir", "ACTIONS", "MAX_NAME"]

ACTIONS = ("save", "restore", "erase")
MAX_NAME = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


def check_filename(value: Any) -> str:
    """A slot file's name as the request gives it, or a 400 saying what a name may be."""
    if not isinstance(value, str):
        raise APIError(400, "'filename' must be a string", param="filename")
    if not 0 < len(value) <= MAX_NAME or not _NAME.match(value) or ".." in value:
        shown = value[:40].encode("unicode_escape").decode("ascii")
        raise APIError(400, f"invalid filename {shown!r}{'...' if len(value) > 40 else ''}: 1-{MAX_NAME} letters, "
                       "digits, '.', '_' or '-', starting with a letter or digit, without '..'",
                       code="invalid_filename", param="filename")
    return value


def slots_dir(engine: edgeinfer.BatchEngine) -> Path:
    """Where slot files live: `slots/` in the engine's store."""
    return engine.store.root / "slots"


def _slot_file(engine: edgeinfer.BatchEngine, name: str) -> Path:
    folder = slots_dir(engine)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if path.is_symlink() or not is_inside(path, folder):
        raise APIError(400, f"{name} is not a plain file of the slots folder", code="invalid_filename",
                       param="filename")
    return path


def _slot_id(text: str, engine: edgeinfer.BatchEngine) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= 4) or int(text) >= engine.parallel:
        raise APIError(400, f"Invalid slot ID: slots are 0..{engine.parallel - 1}", code="invalid_slot")
    return int(text)


@contextlib.asynccontextmanager
async def _engine(service: Any, model: str | None) -> AsyncIterator[edgeinfer.BatchEngine]:
    """The engine of the model a request names: a lease on it from the model service
    (server/routing.py) while the action runs, or the one engine of a single-model app."""
    engine = getattr(service, "engine", None)
    if isinstance(engine, edgeinfer.BatchEngine):
        service.check_model(model)
        yield engine
        return
    from .routing import acquire

    lease = await acquire(service.models, model, None)
    try:
        yield lease.engine
    finally:
        lease.release()


async def _body(service: Any, request: Request, action: str) -> Mapping[str, Any]:
    if action == "erase" and request.headers.get("content-length") in (None, "0"):
        ctype = request.headers.get("content-type", "")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise APIError(415, "a slot action must be sent with Content-Type: application/json",
                           code="unsupported_media_type")
        return {}
    body = await service.read_json(request)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = set(body) - {"filename", "model"}
    if unknown:
        raise APIError(400, f"unknown field {sorted(unknown)[0][:40]!r} (a slot action takes 'filename' and 'model')",
                       param=sorted(unknown)[0][:40])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model")
    return body


async def handle_slots(service: Any, request: Request) -> Response:
    """The route; `service` is the app's (its read_json, and its model service or engine)."""
    action = request.query_params.get("action", "")
    if action not in ACTIONS:
        raise APIError(400, f"Invalid action {action[:20]!r}: use ?action=save, restore or erase", code="invalid_action",
                       param="action")
    body = await _body(service, request, action)
    name = check_filename(body.get("filename")) if action != "erase" else None
    async with _engine(service, body.get("model")) as engine:
        slot = _slot_id(request.path_params.get("id_slot", ""), engine)
        try:
            if action == "erase":
                n = await run_in_threadpool(engine.erase_slot, slot)
                return JSONResponse({"id_slot": slot, "n_erased": n})
            assert name is not None
            path = _slot_file(engine, name)
            if action == "save":
                info = await run_in_threadpool(engine.save_slot, slot, path)
                return JSONResponse({"id_slot": slot, "filename": name, "n_saved": info.tokens,
                                     "n_written": info.bytes, "timings": {"save_ms": round(info.seconds * 1e3, 3)}})
            if not os.path.lexists(path):
                raise APIError(404, f"no saved slot named {name}", code="file_not_found", param="filename")
            result = await run_in_threadpool(engine.restore_slot, slot, path)
            if not result:
                raise APIError(400, f"Unable to restore slot: {result.reason}", code="invalid_slot_state",
                               param="filename")
            return JSONResponse({"id_slot": slot, "filename": name, "n_restored": result.tokens,
                                 "n_read": result.bytes, "timings": {"restore_ms": round(result.seconds * 1e3, 3)}})
        except edgeinfer.EngineBusyError as e:
            raise APIError(409, f"{e}: retry when it is done", code="slot_busy") from None
        except edgeinfer.DiskSpaceError as e:
            raise APIError(507, str(e), type="server_error", code="insufficient_storage") from None
        except edgeinfer.EngineClosedError:
            raise APIError(503, "the server is shutting down", type="server_error", code="unavailable") from None
        except edgeinfer.EdgeInferError as e:
            raise from_library_error(e) from None
