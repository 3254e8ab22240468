"""How one generation's events become what a client reads: one `Reply` per request, made by the
route's dialect (OpenAI's chat and completions here; Responses, Anthropic Messages and Ollama in
server/dialects/). The request path is the same for every dialect (server/app.py's `generate`:
admit, lease, tokenize, submit, drain); only the reply differs:

- streamed, as text pieces written in order (SSE events, or NDJSON lines for Ollama): `opening()`
  before the first event, `events(batch)` per batch, `closing(done)` after the last, `failure(e)`
  when the engine fails mid-stream, `keepalive()` while a queued request waits;
- whole, as one `Response` from every token event and the DoneEvent (`whole`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import JSONResponse, Response

import edgeinfer

from .errors import APIError
from .protocol import ParsedRequest, Responder

__all__ = ["Reply", "ReplyContext", "ReplyFactory", "OpenAIReply", "sse"]


@dataclass(frozen=True)
class ReplyContext:
    """What a reply may need besides the events: the request, the model, its vocabulary."""

    parsed: ParsedRequest
    model: str  # the name responses give the model
    token_bytes: Callable[[int], bytes]  # a token id's bytes (logprobs, matched stop strings)
    prompt_tokens: int  # the prompt's length, known before the first event
    load_s: float  # how long the request waited for its model (loaded on first use)
    started: float  # time.perf_counter() when the request arrived


class Reply(Protocol):
    media_type: str

    def opening(self) -> list[str]: ...

    def events(self, batch: Sequence[Any]) -> list[str]: ...

    def closing(self, done: edgeinfer.DoneEvent) -> list[str]: ...

    def failure(self, error: APIError) -> list[str]: ...

    def keepalive(self) -> str | None: ...

    def whole(self, events: list[edgeinfer.TokenEvent], done: edgeinfer.DoneEvent) -> Response: ...


ReplyFactory = Callable[[ReplyContext], Reply]


def sse(obj: Any, event: str | None = None) -> str:
    """One server-sent event: `data: JSON` (after `event: NAME` when named)."""
    data = f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
    return f"event: {event}\n{data}" if event else data


class OpenAIReply:
    """Chat completions and completions: chunks as `data:` events ending with `data: [DONE]`."""

    media_type = "text/event-stream"

    def __init__(self, context: ReplyContext):
        self.responder = Responder(context.parsed, context.model, context.token_bytes)

    def opening(self) -> list[str]:
        first = self.responder.first_chunk()
        return [] if first is None else [sse(first)]

    def events(self, batch: Sequence[Any]) -> list[str]:
        return [sse(chunk) for chunk in self.responder.delta_chunks(batch)]

    def closing(self, done: edgeinfer.DoneEvent) -> list[str]:
        return [*(sse(chunk) for chunk in self.responder.last_chunks(done)), "data: [DONE]\n\n"]

    def failure(self, error: APIError) -> list[str]:
        return [sse(error.body())]

    def keepalive(self) -> str | None:
        return ": keepalive\n\n"

    def whole(self, events: list[edgeinfer.TokenEvent], done: edgeinfer.DoneEvent) -> Response:
        return JSONResponse(self.responder.complete(events, done))
