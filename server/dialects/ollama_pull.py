"""`POST /api/pull` {"model"}: `edgeinfer.pull` into the server's store, with Ollama's progress lines.

Names: Ollama's `hf.co/OWNER/REPO[:QUANT]` (and `huggingface.co/...`) is a Hugging Face repo, as
Ollama reads it; `OWNER/REPO[:QUANT]` too (edgeinfer's own pull spec); the tag `latest` (Ollama's
default) is the repo's default quant. A name without an owner (`llama3.2:1b`) is Ollama's own
library, which edgeinfer cannot reach: a 400 says how to name a Hub repo instead. A safetensors
repo is converted and quantized as `edgeinfer pull` does (`balanced` profile).

The lines (NDJSON unless `"stream": false`, then only the last): `{"status": "pulling manifest"}`,
per file `{"status": "pulling <12 hex>", "digest": "sha256:<hex>", "total", "completed"}`,
`{"status": "verifying sha256 digest"}`, the conversion/registration stages as their messages,
`{"status": "writing manifest"}`, `{"status": "success"}`; a failure is `{"error": "..."}`. The pull
runs in a worker thread; a client that disconnects cancels it (the partial download is kept and
resumed by the next pull). At most MAX_PULLS run at once (then 503).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import edgeinfer

from ..errors import APIError
from .common import bad, bool_field, check_fields, check_object, text_field
from .ollama_reply import NDJSON

__all__ = ["pull_spec", "PullRoute", "MAX_PULLS"]

MAX_PULLS = 2


def pull_spec(name: str) -> str:
    """The `edgeinfer.pull` spec of an Ollama model name (a 400 for names of Ollama's library)."""
    s = name.strip()
    lowered = s.lower()
    for prefix in ("https://", "http://"):
        if lowered.startswith(prefix):
            s, lowered = s[len(prefix):], lowered[len(prefix):]
    if lowered.startswith(("registry.ollama.ai/", "ollama.com/")) or "/" not in s:
        raise bad(f"{name[:100]!r} is a model of Ollama's library, which edgeinfer does not reach: name a Hugging "
                  "Face repo, e.g. hf.co/bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M", "model")
    if s.endswith(":latest"):
        s = s[: -len(":latest")]
    return s


class _Lines:
    """Ollama's progress lines of one pull's events: the files' progress under their digests, then
    "verifying sha256 digest" once the downloads are over (edgeinfer checked each file's hash as it
    arrived), the stages, "writing manifest", "success"."""

    def __init__(self) -> None:
        self.digests: dict[str, str] = {}
        self.verified = False

    def of(self, event: Any) -> list[dict[str, Any]]:
        if isinstance(event, edgeinfer.PullPlan):
            self.digests.update({f.path: f.sha256 or f.blob_id or "" for f in event.files})
            return [{"status": "pulling manifest"}]
        if isinstance(event, edgeinfer.DownloadProgress):
            digest = self.digests.get(event.file, "")
            completed = event.total if event.status in ("cached", "done") else event.done
            return [{"status": f"pulling {digest[:12] or event.file}", "digest": f"sha256:{digest}" if digest else "",
                     "total": event.total, "completed": completed}]
        if isinstance(event, edgeinfer.PullStage):
            out = [] if self.verified else [{"status": "verifying sha256 digest"}]
            self.verified = True
            if event.stage == "register":
                return out + [{"status": "writing manifest"}]
            return out + [{"status": "success"} if event.stage == "done" else {"status": event.message}]
        return []  # conversion and quantization progress: their stages say enough


def _error(e: BaseException) -> APIError:
    if isinstance(e, edgeinfer.ModelNotFoundError):
        return APIError(404, str(e))
    if isinstance(e, (edgeinfer.InvalidOptionError, edgeinfer.InvalidModelError)):
        return APIError(400, str(e))
    if isinstance(e, edgeinfer.AuthenticationError):
        return APIError(403, f"the Hub refused the download: {e}")
    if isinstance(e, (edgeinfer.OfflineError, edgeinfer.IntegrityError, edgeinfer.HubError)):
        return APIError(502, str(e))
    if isinstance(e, edgeinfer.DiskSpaceError):
        return APIError(507, str(e))
    return APIError(500, str(e) if isinstance(e, edgeinfer.EdgeInferError) else "internal server error")


class PullRoute:
    """The route, with the count of pulls running (event loop only)."""

    def __init__(self, service: Any):
        self.service = service
        self.running = 0

    async def __call__(self, request: Request) -> Response:
        body = check_object(await self.service.read_json(request))
        check_fields(body, {"model", "name", "insecure", "stream"}, "/api/pull")
        name = text_field(body, "model") or text_field(body, "name")
        if not name:
            raise bad("'model' is required", "model")
        spec = pull_spec(name)
        stream = bool_field(body, "stream", default=True)
        bool_field(body, "insecure")  # (TLS is the Hub client's: nothing to relax)
        if self.running >= MAX_PULLS:
            raise APIError(503, f"{MAX_PULLS} pulls are running on this server: retry later",
                           headers={"Retry-After": "5"})
        self.running += 1
        lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        statuses = _Lines()

        def progress(event: Any) -> None:
            for line in statuses.of(event):
                loop.call_soon_threadsafe(lines.put_nowait, line)

        async def run() -> None:
            try:
                await run_in_threadpool(edgeinfer.pull, spec, store=self.service.models.store, on_progress=progress,
                                        cancel=cancel)
            finally:
                self.running -= 1
                lines.put_nowait(None)

        task = asyncio.create_task(run())
        if not stream:
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                cancel.set()
                raise
            except BaseException as e:  # noqa: BLE001 - every failure is answered
                raise _error(e) from None
            return JSONResponse({"status": "success"})
        return StreamingResponse(self._lines(task, lines, cancel), media_type=NDJSON)

    @staticmethod
    async def _lines(task: asyncio.Task, lines: asyncio.Queue, cancel: threading.Event) -> AsyncIterator[str]:
        try:
            while (line := await lines.get()) is not None:
                yield json.dumps(line) + "\n"
            try:
                await task
            except BaseException as e:  # noqa: BLE001 - the failure ends the stream as Ollama's do
                yield json.dumps({"error": _error(e).message}) + "\n"
        finally:
            cancel.set()  # a client gone (or done): the worker stops between chunks
