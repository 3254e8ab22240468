"""The OpenAI Responses reply: the `response` object, and its streamed semantic events.

A stream goes `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, for a message `response.content_part.added`,
`response.output_text.delta`... `response.output_text.done`, `response.content_part.done`, for a
function call `response.function_call_arguments.delta`... `...done`, then
`response.output_item.done`; and ends with `response.completed` (or `response.incomplete` when
`max_output_tokens` cut it, `response.failed` when the engine failed or the request was cancelled).
Every event carries its `sequence_number`, as OpenAI's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from starlette.responses import JSONResponse, Response

import edgeinfer

from ..errors import APIError
from ..reply import ReplyContext, sse
from .common import cancelled_error, new_id, now_s

__all__ = ["ResponsesReply", "output_messages"]


def _usage(stats: edgeinfer.GenerationStats) -> dict[str, Any]:
    return {"input_tokens": stats.prompt_tokens, "input_tokens_details": {"cached_tokens": stats.cached_tokens},
            "output_tokens": stats.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
        else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_messages(output: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a later turn continues from."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                       "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ResponsesReply:
    media_type = "text/event-stream"

    def __init__(self, context: ReplyContext, echo: dict[str, Any],
                 on_done: Callable[[str, list[dict[str, Any]]], None] | None = None):
        self.context = context
        self.echo = echo  # the request's fields the response object repeats
        self.on_done = on_done  # (response id, output items): kept for previous_response_id
        self.id = new_id("resp_")
        self.created = now_s()
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.text_item: dict[str, Any] | None = None  # the message being streamed: {"id", "index", "text"}
        self.calls: dict[int, dict[str, Any]] = {}  # call index -> {"id", "index", "call_id", "name", "arguments"}

    # -- the response object ---------------------------------------------------------------------
    def response(self, status: str, done: edgeinfer.DoneEvent | None = None, error: APIError | None = None,
                 output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.context.model, "output": self.output if output is None else output,
            "error": None if error is None else {"code": "server_error", "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **self.echo, "usage": None if done is None else _usage(done.stats),
        }
        if done is not None:
            obj["completed_at"] = now_s()
            obj["edgeinfer"] = done.stats.to_dict()
        return obj

    def _event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    # -- streaming -------------------------------------------------------------------------------
    def opening(self) -> list[str]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def _open_text(self) -> list[str]:
        item = {"id": new_id("msg_"), "index": len(self.output), "text": ""}
        self.text_item = item
        return [self._event("response.output_item.added", output_index=item["index"],
                            item=_message_item(item["id"], "", "in_progress")),
                self._event("response.content_part.added", item_id=item["id"], output_index=item["index"],
                            content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                   "logprobs": []})]

    def _close_text(self) -> list[str]:
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        done = _message_item(item["id"], item["text"], "completed")
        self.output.append(done)
        where = {"item_id": item["id"], "output_index": item["index"], "content_index": 0}
        return [self._event("response.output_text.done", **where, text=item["text"], logprobs=[]),
                self._event("response.content_part.done", **where, part=done["content"][0]),
                self._event("response.output_item.done", output_index=item["index"], item=done)]

    def events(self, batch: Sequence[Any]) -> list[str]:
        out: list[str] = []
        for e in batch:
            if isinstance(e, edgeinfer.TokenEvent) and e.text:
                if self.text_item is None:
                    out += self._open_text()
                self.text_item["text"] += e.text
                out.append(self._event("response.output_text.delta", item_id=self.text_item["id"],
                                       output_index=self.text_item["index"], content_index=0, delta=e.text,
                                       logprobs=[]))
            elif isinstance(e, edgeinfer.ToolCallEvent):
                out += self._call_event(e)
        return out

    def _call_event(self, e: edgeinfer.ToolCallEvent) -> list[str]:
        out: list[str] = []
        call = self.calls.get(e.index)
        if call is None:
            out += self._close_text()
            call = {"id": new_id("fc_"), "index": len(self.output) + len(self.calls), "call_id": e.id,
                    "name": e.name, "arguments": ""}
            self.calls[e.index] = call
            out.append(self._event("response.output_item.added", output_index=call["index"],
                                   item=_call_item(call["id"], e.id, e.name, "", "in_progress")))
        if e.arguments:
            call["arguments"] += e.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=call["id"],
                                   output_index=call["index"], delta=e.arguments))
        if e.call is not None:
            del self.calls[e.index]
            item = _call_item(call["id"], call["call_id"], call["name"], e.call.arguments, "completed")
            self.output.append(item)
            out += [self._event("response.function_call_arguments.done", item_id=call["id"],
                                output_index=call["index"], arguments=e.call.arguments),
                    self._event("response.output_item.done", output_index=call["index"], item=item)]
        return out

    def _close_calls(self) -> list[str]:
        """Calls cut off by max_output_tokens: closed as incomplete (not in the response's output,
        as the whole response's is only the calls the model finished)."""
        out = []
        for call in self.calls.values():
            item = _call_item(call["id"], call["call_id"], call["name"], call["arguments"], "incomplete")
            out += [self._event("response.function_call_arguments.done", item_id=call["id"],
                                output_index=call["index"], arguments=call["arguments"]),
                    self._event("response.output_item.done", output_index=call["index"], item=item)]
        self.calls.clear()
        return out

    def closing(self, done: edgeinfer.DoneEvent) -> list[str]:
        out = self._close_text() + self._close_calls()
        if done.finish_reason == "cancelled":
            return out + self.failure(cancelled_error(self.context.model))
        if not self.output:  # nothing was said: one empty message, as OpenAI's
            out += self._open_text() + self._close_text()
        status = "incomplete" if done.finish_reason == "length" else "completed"
        if self.on_done is not None:
            self.on_done(self.id, self.output)
        return out + [self._event(f"response.{status}", response=self.response(status, done))]

    def failure(self, error: APIError) -> list[str]:
        return [self._event("response.failed", response=self.response("failed", error=error))]

    def keepalive(self) -> str | None:
        return ": keepalive\n\n"

    # -- whole -----------------------------------------------------------------------------------
    def whole(self, events: list[edgeinfer.TokenEvent], done: edgeinfer.DoneEvent) -> Response:
        if done.finish_reason == "cancelled":
            e = cancelled_error(self.context.model)
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        text = "".join(e.text for e in events)
        output: list[dict[str, Any]] = []
        if text or not done.tool_calls:
            output.append(_message_item(new_id("msg_"), text, "completed"))
        output += [_call_item(new_id("fc_"), c.id, c.name, c.arguments, "completed") for c in done.tool_calls]
        self.output = output
        if self.on_done is not None:
            self.on_done(self.id, output)
        status = "incomplete" if done.finish_reason == "length" else "completed"
        return JSONResponse(self.response(status, done))
