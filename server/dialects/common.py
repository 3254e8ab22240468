"""What the three dialects share: strict field checks that name the dialect's own fields, the
hand-over to the OpenAI parser (every dialect's request becomes the body `/v1/chat/completions`
or `/v1/completions` takes, parsed by server/protocol.py, so there is one set of rules and one
request path), and pieces of their replies (ids, the matched stop string, tool arguments).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import edgeinfer
from edgeinfer.service import ModelPlan

from ..errors import APIError
from ..protocol import ParsedRequest, parse_chat, parse_completion

__all__ = ["bad", "check_object", "check_fields", "text_field", "bool_field", "int_field", "number_field",
           "list_field", "flat_tools", "Translated", "parse_translated", "renamed_error", "stop_matched",
           "tool_arguments", "new_id", "now_s", "MAX_ITEMS", "cancelled_error"]

MAX_ITEMS = 4096  # messages, items or content blocks in one request: far more than any context holds


def bad(message: str, param: str | None = None, status: int = 400) -> APIError:
    return APIError(status, message, param=param)


def check_object(body: Any, what: str = "the request body") -> Mapping[str, Any]:
    """`body` if it is an object; else a 400 (whose param is the top field of a quoted `what`, "'text.format'")."""
    if not isinstance(body, Mapping):
        raise bad(f"{what} must be a JSON object", what.strip("'").split(".")[0] if what.startswith("'") else None)
    return body


def check_fields(obj: Mapping[str, Any], known: frozenset[str] | set[str], where: str) -> None:
    """A 400 naming the first field of `obj` that `known` does not hold (`where`: e.g. "/v1/messages")."""
    unknown = sorted(k for k in obj if k not in known)
    if unknown:
        shown = unknown[0][:60]
        raise bad(f"unknown field {shown!r} in {where} (known: {', '.join(sorted(known))})", shown)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def text_field(obj: Mapping[str, Any], name: str, *, required: bool = False, empty: bool = True,
               where: str = "") -> str | None:
    v = obj.get(name)
    if v is None:
        if required:
            raise bad(f"'{where}{name}' is required", name)
        return None
    if not isinstance(v, str) or (not empty and not v):
        raise bad(f"'{where}{name}' must be a {'' if empty else 'non-empty '}string, got {_kind(v)}", name)
    return v


def bool_field(obj: Mapping[str, Any], name: str, default: bool | None = None, where: str = "") -> bool | None:
    v = obj.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{where}{name}' must be true or false, got {_kind(v)}", name)
    return v


def _ranged(obj: Mapping[str, Any], name: str, lo: float, hi: float, where: str, integer: bool) -> Any:
    v = obj.get(name)
    if v is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind) or (not integer and math.isnan(v)) or not lo <= v <= hi:
        bounds = f"[{lo}, {hi}]" if integer else f"[{lo:g}, {hi:g}]"
        raise bad(f"'{where}{name}' must be {'an integer' if integer else 'a number'} in {bounds}, "
                  f"got {json.dumps(v)[:40]}", name)
    return v if integer else float(v)


def int_field(obj: Mapping[str, Any], name: str, lo: int, hi: int, where: str = "") -> int | None:
    return _ranged(obj, name, lo, hi, where, integer=True)


def number_field(obj: Mapping[str, Any], name: str, lo: float, hi: float, where: str = "") -> float | None:
    return _ranged(obj, name, lo, hi, where, integer=False)


def list_field(obj: Mapping[str, Any], name: str, *, limit: int = MAX_ITEMS, where: str = "") -> list[Any] | None:
    v = obj.get(name)
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad(f"'{where}{name}' must be a list, got {_kind(v)}", name)
    if len(v) > limit:
        raise bad(f"'{where}{name}' has {len(v)} items, more than the {limit} a request may have", name)
    return v


def flat_tools(value: list[Any] | None, types: tuple[str | None, ...], schema: str) -> list[dict[str, Any]] | None:
    """Tool definitions written flat (Responses' {type, name, description, parameters, strict},
    Anthropic's {name, description, input_schema}) as the chat's function tools."""
    if value is None:
        return None
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, Mapping):
            raise bad(f"tools[{i}] must be an object", "tools")
        if tool.get("type") not in types:
            raise bad(f"tools[{i}]: tool type {str(tool.get('type'))[:40]!r} is not supported (function tools only: "
                      "this server runs no tools of its own)", "tools")
        check_fields(tool, {"type", "name", "description", schema, "strict", "cache_control"}, f"tools[{i}]")
        fn = {"name": tool.get("name")}
        for key, name in (("description", "description"), (schema, "parameters"), ("strict", "strict")):
            if tool.get(key) is not None:
                fn[name] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


@dataclass
class Translated:
    """A dialect's request as the OpenAI body it means (`kind` chat or completion), and what its
    reply needs beside it."""

    kind: str  # "chat" | "completion"
    body: dict[str, Any]
    names: Mapping[str, str] = field(default_factory=dict)  # OpenAI field -> the dialect's, for errors
    extra: dict[str, Any] = field(default_factory=dict)  # the dialect's own (echoed fields, stop strings, ...)
    adjust: Callable[[ParsedRequest, ModelPlan], ParsedRequest] | None = None  # what the OpenAI body cannot say

    @property
    def model(self) -> str | None:
        return self.body.get("model")


def renamed_error(e: APIError, names: Mapping[str, str]) -> APIError:
    """`e` with the OpenAI field names it mentions replaced by the dialect's."""
    message, param = e.message, e.param
    for openai_name, ours in names.items():
        message = message.replace(f"'{openai_name}'", f"'{ours}'")
        if param == openai_name:
            param = ours
    return APIError(e.status, message, type=e.type, param=param, code=e.code, headers=e.headers)


def parse_translated(t: Translated, plan: ModelPlan, max_tokens_limit: int) -> ParsedRequest:
    """The OpenAI parser's ParsedRequest for a translated body; its errors name the dialect's fields."""
    try:
        if t.kind == "chat":
            parsed = parse_chat(t.body, max_tokens_limit, plan.speculation)
        else:
            parsed = parse_completion(t.body, max_tokens_limit, plan.speculation)
        return t.adjust(parsed, plan) if t.adjust is not None else parsed
    except APIError as e:
        raise renamed_error(e, t.names) from None


def stop_matched(done: edgeinfer.DoneEvent, stops: Sequence[str], token_bytes: Callable[[int], bytes]) -> str | None:
    """The stop string that ended a generation (finish "stop"): the one its tokens' text holds right
    after the text it returned (the engine cuts the text before the stop string)."""
    if done.finish_reason != "stop" or not stops:
        return None
    if len(stops) == 1:
        return stops[0]
    try:
        full = b"".join(token_bytes(t) for t in done.tokens).decode("utf-8", errors="replace")
    except edgeinfer.EdgeInferError:  # the model was unloaded meanwhile: the reason stays, unnamed
        return None
    at = full.find(done.text) + len(done.text) if done.text else 0
    hits = [(full.find(s, at), s) for s in stops if full.find(s, at) >= 0]
    return min(hits)[1] if hits else None


def tool_arguments(call: edgeinfer.ToolCall) -> dict[str, Any]:
    """A call's arguments as an object (the tool grammar makes them a JSON object that parses)."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def now_s() -> int:
    return int(time.time())


def cancelled_error(model: str) -> APIError:
    """A generation cancelled on the server's side (shutdown, or `edgeinfer stop`): the dialects
    without a "cancelled" finish reason answer it as an error the client may retry."""
    return APIError(503, f"the request was cancelled: {model} was stopped or the server is shutting down",
                    type="server_error", code="cancelled", headers={"Retry-After": "1"})
