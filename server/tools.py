"""Tools and structured output on the server: the OpenAI request fields checked into edgeinfer's
types (a 400 naming the field for anything malformed) and the response pieces (`message.tool_calls`,
streamed tool-call deltas). The chat itself is the library's one sequence (`engine.chat(...,
tools=...)`: the tools rendered into the prompt, the grammar, the calls parsed out of the events).

Request fields: `tools`, `tool_choice` ("auto", "none", "required", or {"type": "function",
"function": {"name": ...}}), `parallel_tool_calls`; assistant messages with `tool_calls` and
`role: "tool"` messages with `tool_call_id`; `response_format` {"type": "json_object"} (any JSON
object) or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (the schema
enforced by grammar whether `strict` is true or not: objects get their declared properties only);
and the extra field `grammar` (GBNF text). A schema or grammar cannot be combined with tools
unless `tool_choice` is "none".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import edgeinfer
from edgeinfer.engine.chat.template import normalize_messages
from edgeinfer.engine.chat.tools import normalize_tool_choice, normalize_tools

from .errors import APIError

__all__ = ["ToolFields", "parse_tool_fields", "parse_constraint", "chat_message", "tool_call_json", "ToolDeltas"]


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True)
class ToolFields:
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True

    @property
    def active(self) -> bool:
        """Whether tools are offered (and so parsed, and the output constrained where they are called)."""
        return bool(self.tools) and self.tool_choice != "none"


def parse_tool_fields(body: Mapping[str, Any]) -> ToolFields:
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise _bad("'functions' and 'function_call' are deprecated: use 'tools' and 'tool_choice'", "functions")
    try:
        tools = normalize_tools(body.get("tools"))
    except edgeinfer.InvalidOptionError as e:
        raise _bad(str(e), "tools") from None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    elif not tools and choice != "none":
        raise _bad("'tool_choice' needs 'tools'", "tool_choice")
    try:
        normalize_tool_choice(choice, tools)
    except edgeinfer.InvalidOptionError as e:
        raise _bad(str(e), "tool_choice") from None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return ToolFields(tools, choice, parallel)


def parse_constraint(body: Mapping[str, Any]) -> dict[str, Any]:
    """GenerateOptions keyword arguments (json_schema= or grammar=) from `response_format` and the
    extra field `grammar`."""
    out: dict[str, Any] = {}
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
            raise _bad("'response_format' must be an object with a 'type'", "response_format")
        kind = fmt["type"]
        if kind == "json_object":
            out["json_schema"] = {"type": "object"}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, Mapping):
                raise _bad("response_format 'json_schema' needs a 'json_schema' object with a 'schema'", "response_format")
            schema = spec.get("schema")
            if not isinstance(schema, Mapping):
                raise _bad("response_format.json_schema.schema must be a JSON schema object", "response_format")
            strict = spec.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise _bad("response_format.json_schema.strict must be a boolean", "response_format")
            name = spec.get("name")
            if name is not None and not isinstance(name, str):
                raise _bad("response_format.json_schema.name must be a string", "response_format")
            out["json_schema"] = dict(schema)
        elif kind != "text":
            raise _bad(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                       "response_format")
    grammar = body.get("grammar")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise _bad("'grammar' must be GBNF text (a non-empty string)", "grammar")
        if out:
            raise _bad("give either 'grammar' or a JSON response_format, not both", "grammar")
        out["grammar"] = grammar
    return out


def chat_message(m: Mapping[str, Any], i: int, content: str) -> dict[str, Any]:
    """One chat message as the engine takes it: role, content, and the tool fields that belong."""
    msg: dict[str, Any] = {"role": m["role"], "content": content}
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise _bad(f"messages[{i}].tool_calls must be a list, on an assistant message", "messages")
        msg["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None and (m["role"] == "tool" or key == "name"):
            msg[key] = m[key]
    try:
        normalize_messages([msg])
    except edgeinfer.InvalidOptionError as e:
        text = str(e)
        raise _bad(text.replace("messages[0]", f"messages[{i}]", 1) if text.startswith("messages[0]")
                   else f"messages[{i}]: {text}", "messages") from None
    return msg


def tool_call_json(call: edgeinfer.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ToolDeltas:
    """OpenAI's streamed `delta.tool_calls` entries: the first for a call carries its id, type and
    name; every one its index and a piece of the arguments."""

    def __init__(self) -> None:
        self._announced: set[int] = set()

    def entries(self, events: Sequence[edgeinfer.ToolCallEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if out and out[-1]["index"] == e.index:  # pieces of one call in one chunk: one entry
                out[-1]["function"]["arguments"] += e.arguments
                continue
            if e.index in self._announced and not e.arguments:
                continue  # (a call's last event may carry no new piece)
            entry: dict[str, Any] = {"index": e.index, "function": {"arguments": e.arguments}}
            if e.index not in self._announced:
                self._announced.add(e.index)
                entry = {"index": e.index, "id": e.id, "type": "function",
                         "function": {"name": e.name, "arguments": e.arguments}}
            out.append(entry)
        return out
