"""The Anthropic Messages reply: the `message` object, and its streamed events.

A stream goes `message_start` (the message with no content, and the prompt's input_tokens),
`ping`, then per content block `content_block_start`, `content_block_delta` (`text_delta` pieces
for text, `input_json_delta` pieces of a tool_use block's input), `content_block_stop`; then
`message_delta` (stop_reason, stop_sequence, usage) and `message_stop`. While a queued request
waits, `ping` events keep the connection alive. A failure mid-stream is an `error` event.

stop_reason: end_turn (the model ended), stop_sequence (with the one that matched), max_tokens,
tool_use. A request cancelled on the server's side (shutdown, `edgeinfer stop`) has no stop
reason in Anthropic's vocabulary: it is an `overloaded_error` (503 when not streamed) to retry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse, Response

import edgeinfer

from ..errors import APIError
from ..reply import ReplyContext, sse
from .common import cancelled_error, new_id, stop_matched, tool_arguments
from .shapes import ANTHROPIC, anthropic_error_type

__all__ = ["AnthropicReply", "STOP_REASONS"]

STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicReply:
    media_type = "text/event-stream"

    def __init__(self, context: ReplyContext, stops: Sequence[str]):
        self.context = context
        self.stops = tuple(stops)
        self.id = new_id("msg_")
        self.index = -1  # the open content block's index (-1: none yet)
        self.open: str | None = None  # "text" | "tool_use" | None
        self.tool_index = -1  # the engine's index of the call whose tool_use block is open

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
                 output_tokens: int, done: edgeinfer.DoneEvent | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.context.model,
               "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
               "usage": {**self._input_usage(done), "output_tokens": output_tokens}}
        if done is not None:
            out["edgeinfer"] = done.stats.to_dict()
        return out

    def _input_usage(self, done: edgeinfer.DoneEvent | None) -> dict[str, int]:
        """Anthropic counts the prompt's tokens read from the cache apart from the others."""
        cached = done.stats.cached_tokens if done is not None else 0
        prompt = done.stats.prompt_tokens if done is not None else self.context.prompt_tokens
        return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def _stop(self, done: edgeinfer.DoneEvent) -> tuple[str, str | None]:
        reason = STOP_REASONS.get(done.finish_reason, "end_turn")
        matched = stop_matched(done, self.stops, self.context.token_bytes) if reason == "stop_sequence" else None
        return ("stop_sequence", matched) if matched is not None else (
            "end_turn" if reason == "stop_sequence" else reason, None)

    # -- streaming -------------------------------------------------------------------------------
    def opening(self) -> list[str]:
        return [sse({"type": "message_start", "message": self._message([], None, None, 0)}, "message_start"),
                sse({"type": "ping"}, "ping")]

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [sse({"type": "content_block_start", "index": self.index, "content_block": block},
                          "content_block_start")]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def events(self, batch: Sequence[Any]) -> list[str]:
        out: list[str] = []
        for e in batch:
            if isinstance(e, edgeinfer.TokenEvent) and e.text:
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, edgeinfer.ToolCallEvent):
                if self.open != "tool_use" or self.tool_index != e.index:
                    out += self._start({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
                    self.tool_index = e.index
                if e.arguments:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": e.arguments}))
                if e.call is not None:
                    out += self._close()
        return out

    def closing(self, done: edgeinfer.DoneEvent) -> list[str]:
        out = self._close()
        if done.finish_reason == "cancelled":
            return out + self.failure(cancelled_error(self.context.model))
        reason, matched = self._stop(done)
        usage = {**self._input_usage(done), "output_tokens": done.stats.generated_tokens}
        return out + [sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": matched},
                           "usage": usage}, "message_delta"),
                      sse({"type": "message_stop"}, "message_stop")]

    def failure(self, error: APIError) -> list[str]:
        body = {"type": "error", "error": {"type": anthropic_error_type(error.status), "message": error.message}}
        return [sse(body, "error")]

    def keepalive(self) -> str | None:
        return sse({"type": "ping"}, "ping")

    # -- whole -----------------------------------------------------------------------------------
    def whole(self, events: list[edgeinfer.TokenEvent], done: edgeinfer.DoneEvent) -> Response:
        if done.finish_reason == "cancelled":
            return ANTHROPIC.render(cancelled_error(self.context.model))
        text = "".join(e.text for e in events)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not done.tool_calls else []
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_arguments(c)}
                    for c in done.tool_calls]
        reason, matched = self._stop(done)
        return JSONResponse(self._message(content, reason, matched, done.stats.generated_tokens, done))
