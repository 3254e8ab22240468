"""`POST /slots/{id}?action=save|restore|erase`: a slot's KV cache saved to a file and back, as
llama-server does it (its --slot-save-path), with the same body and response shapes:

    save     {"filename": NAME}  -> {"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}
    restore  {"filename": NAME}  -> {"id_slot", "filename", "n_restored", "n_read", "timings": {"restore_ms"}}
    erase    (no body, or {})    -> {"id_slot", "n_erased"}

An extra body field `model` names the model whose slot it is (default: the server's default).

As llama-server, the actions are off (501) unless the operator gives a folder: `--slot-save-path
DIR` (or serve.toml's [slots] path). The files live there, `DIR/NAME`, and nowhere else: a name
is 1-128 letters, digits, '.', '_' and '-', starting with a letter or digit, with no '..' (so no
path separator, no absolute path, no NUL, nothing hidden); a name that is a symbolic link, a
directory or another file that is not a regular one, or that resolves outside that folder, is a
400 (and the engine opens a file only as a regular one, O_NOFOLLOW | O_NONBLOCK then fstat: a
FIFO put there cannot block its scheduler). The folder's regular files may take `--slot-quota`
bytes together: a save that could pass it is refused before anything is written (507). A restored
file passes every check of edgeinfer.engine.state.session first (this model's hash, its KV types,
sizes, hash, layout, K/V values that are finite numbers): one that does not is a 400 saying why,
and the slot keeps what it had. The work runs on the engine's scheduler thread between two steps,
on an idle slot only: a slot that runs a request is a 409 (llama-server defers the task instead; a
client retries). The routes sit behind the API-key check like every route but /health.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import threading
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

import edgeinfer
from edgeinfer.fsutil import is_inside

from .errors import APIError, from_library_error
from .finite_json import JSONResponse

__all__ = ["handle_slots", "check_filename", "slots_used", "ACTIONS", "MAX_NAME"]

ACTIONS = ("save", "restore", "erase")
MAX_NAME = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_SAVING = threading.Lock()  # a save's quota check and its write, one save at a time


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


def slots_used(folder: Path) -> int:
    """Bytes the regular files of the slot folder take (temporary ones of a save included)."""
    used = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                used += st.st_size
    return used


def _slot_file(folder: Path, name: str, *, saving: bool) -> Path:
    path = folder / name
    try:
        mode: int | None = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if (mode is not None and stat.S_ISLNK(mode)) or not is_inside(path, folder):
        raise APIError(400, f"{name} is not a plain file of the slots folder", code="invalid_filename",
                       param="filename")
    if saving and mode is not None and not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise APIError(400, f"{name} is {kind} in the slots folder: a slot is saved only as a regular file",
                       code="invalid_filename", param="filename")
    return path


def _save(engine: edgeinfer.BatchEngine, slot: int, path: Path, quota: int) -> Any:
    """(in a worker thread) The save, refused before writing when it could pass the quota."""
    with _SAVING:
        used = slots_used(path.parent)
        kept = path.stat().st_size if path.is_file() and not path.is_symlink() else 0  # replaced by the save
        room = quota - (used - kept)
        try:
            return engine.save_slot(slot, path, max_bytes=room)
        except edgeinfer.DiskSpaceError as e:
            if room < shutil.disk_usage(path.parent).free:  # the quota said no, not the disk
                raise APIError(507, f"{e}: the slot folder's files take {used / 1e6:.1f} MB of its "
                               f"{quota / 1e6:.1f} MB (--slot-quota); erase some or raise it", type="server_error",
                               code="insufficient_storage") from None
            raise


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
    """The route; `service` is the app's (its read_json and config, and its model service or engine)."""
    folder = service.config.slot_save_path
    if folder is None:  # llama-server's answer, and its flag
        raise APIError(501, "this server does not save slots: start it with --slot-save-path DIR (or [slots] path in "
                       "serve.toml)", type="not_supported_error", code="not_supported")
    folder = Path(folder)
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
            path = _slot_file(folder, name, saving=action == "save")
            if action == "save":
                info = await run_in_threadpool(_save, engine, slot, path, service.config.slot_quota)
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
