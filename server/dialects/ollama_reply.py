"""The Ollama reply of `/api/chat` and `/api/generate`: NDJSON lines, or one object.

Each streamed line is `{"model", "created_at", "message": {"role": "assistant", "content"}, "done":
false}` (`"response"` instead of `"message"` for /api/generate); a tool call is one line whose
message carries `tool_calls: [{"function": {"name", "arguments": {...}}}]` when the call is
complete (as Ollama streams them). The last line has `"done": true`, `done_reason` (stop, length)
and Ollama's counters: total_duration, load_duration, prompt_eval_count, prompt_eval_duration,
eval_count, eval_duration (nanoseconds). A failure mid-stream is a line `{"error": "..."}`, which
Ollama's clients raise; a request cancelled on the server's side (shutdown, `edgeinfer stop`) is
one too (a 503 when not streamed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from starlette.responses import JSONResponse, Response

import edgeinfer

from ..errors import APIError
from ..reply import ReplyContext
from .common import cancelled_error, tool_arguments
from .shapes import OLLAMA

__all__ = ["OllamaReply", "created_at", "NDJSON"]

NDJSON = "application/x-ndjson"


def created_at() -> str:
    """Ollama's timestamp: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class OllamaReply:
    media_type = NDJSON

    def __init__(self, context: ReplyContext, kind: str):
        self.context = context
        self.kind = kind  # "chat" | "generate"

    def _head(self) -> dict[str, Any]:
        return {"model": self.context.model, "created_at": created_at()}

    def _piece(self, content: str, calls: Sequence[edgeinfer.ToolCall] = ()) -> dict[str, Any]:
        if self.kind == "generate":
            return {"response": content}
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"function": {"name": c.name, "arguments": tool_arguments(c)}} for c in calls]
        return {"message": message}

    def _final(self, done: edgeinfer.DoneEvent, content: str, calls: Sequence[edgeinfer.ToolCall]) -> dict[str, Any]:
        s = done.stats
        return {**self._head(), **self._piece(content, calls), "done": True,
                "done_reason": "length" if done.finish_reason == "length" else "stop",
                "total_duration": _ns(time.perf_counter() - self.context.started),
                "load_duration": _ns(self.context.load_s), "prompt_eval_count": s.prompt_tokens,
                "prompt_eval_duration": _ns(s.prefill_s), "eval_count": s.generated_tokens,
                "eval_duration": _ns(s.decode_s), "edgeinfer": s.to_dict()}

    # -- streaming -------------------------------------------------------------------------------
    def opening(self) -> list[str]:
        return []

    def events(self, batch: Sequence[Any]) -> list[str]:
        out: list[str] = []
        text = ""
        for e in [*batch, None]:
            if isinstance(e, edgeinfer.TokenEvent):
                text += e.text
                continue
            if text:  # a run of tokens: one line
                out.append(_line({**self._head(), **self._piece(text), "done": False}))
                text = ""
            if isinstance(e, edgeinfer.ToolCallEvent) and e.call is not None:
                out.append(_line({**self._head(), **self._piece("", [e.call]), "done": False}))
        return out

    def closing(self, done: edgeinfer.DoneEvent) -> list[str]:
        if done.finish_reason == "cancelled":
            return self.failure(cancelled_error(self.context.model))
        return [_line(self._final(done, "", ()))]

    def failure(self, error: APIError) -> list[str]:
        return [_line({"error": error.message})]

    def keepalive(self) -> str | None:
        return None  # a blank line would not parse as JSON in Ollama's clients

    # -- whole -----------------------------------------------------------------------------------
    def whole(self, events: list[edgeinfer.TokenEvent], done: edgeinfer.DoneEvent) -> Response:
        if done.finish_reason == "cancelled":
            return OLLAMA.render(cancelled_error(self.context.model))
        return JSONResponse(self._final(done, "".join(e.text for e in events), done.tool_calls))
