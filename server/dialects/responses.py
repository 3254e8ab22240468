"""`POST /v1/responses`: OpenAI's Responses API over the chat request path.

The request becomes the chat-completions body it means: `instructions` the system message,
`input` (a string, or items: messages with `input_text`/`output_text` parts, `function_call` and
`function_call_output` items) the messages, `tools` (function tools, flat as Responses writes them)
and `tool_choice` the chat's, `text.format` (json_schema / json_object) the `response_format`,
`max_output_tokens` the `max_tokens`; `temperature`, `top_p`, `parallel_tool_calls` as they are,
and the chat route's extra fields (`top_k`, `min_p`, `seed`, `keep_alive`, `speculation`).

`store` / `previous_response_id` are supported: a stored response (every one unless `store` is
false, as OpenAI's default) keeps its conversation — input and output as chat messages, without
its `instructions`, which a follow-up does not inherit (as OpenAI's) — in memory, in a bounded
store (server/dialects/response_store.py) that only the same API key reads back. A server restart
forgets them; `GET /v1/responses/{id}` is not served.

Refused with a 400 that names them: hosted tools (web search, file search, computer use, ...: the
server runs no tools), images, files and audio in the input (no multimodal models), `reasoning`,
`background`, `conversation`, `prompt` templates, `include`, logprobs, `truncation: "auto"`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from ..errors import APIError
from ..routing import keep_alive_field, plan_for
from .common import (MAX_ITEMS, Translated, bad, bool_field, check_fields, check_object, flat_tools, int_field,
                     list_field, parse_translated, renamed_error, text_field)
from .response_store import ResponseStore
from .responses_reply import ResponsesReply, output_messages

__all__ = ["translate_responses", "handle_responses", "owner_of"]

_WHERE = "/v1/responses"
_PASSED = {"model", "stream", "temperature", "top_p", "parallel_tool_calls",  # as the chat route reads them
           "top_k", "min_p", "seed", "keep_alive", "speculation"}  # (the chat route's extra fields)
_ACCEPTED = {"metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier", "stream_options",
             "store"}  # read or echoed; they change nothing in the answer
_OWN = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "previous_response_id",
        "truncation", "include", "top_logprobs", "reasoning", "background", "max_tool_calls"}
_UNSUPPORTED = {
    "reasoning": "reasoning is not supported (the models served here have no reasoning effort to set)",
    "background": "background responses are not supported (stream, or wait for the answer)",
    "include": "'include' is not supported (no logprobs, reasoning or tool outputs to add)",
    "top_logprobs": "logprobs are not supported on /v1/responses (use /v1/chat/completions with 'logprobs')",
    "max_tool_calls": "'max_tool_calls' is not supported (use parallel_tool_calls: false for one call)",
}
_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "response_format": "text.format", "messages": "input"}


def owner_of(request: Request) -> str:
    """Whose stored responses a request may read: a digest of the key it presented."""
    key = request.headers.get("authorization") or ""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def _parts_text(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of content parts", "input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad(f"{where}.content[{j}]: {kind} is not supported (the models served here read text only)",
                      "input")
        else:
            raise bad(f"{where}.content[{j}] must be an input_text or output_text part with a 'text'", "input")
    return "".join(out)


def _tool_output(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return _parts_text(value, where, "tool")
    raise bad(f"{where}.output must be a string or a list of input_text parts", "input")


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: consecutive function calls become one assistant message's tool_calls."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad("'input' must be a string or a list of input items", "input")
    if len(value) > MAX_ITEMS:
        raise bad(f"'input' has {len(value)} items, more than the {MAX_ITEMS} a request may have", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}.role must be user, assistant, system or developer, got {str(role)[:40]!r}",
                          "input")
            text = _parts_text(item.get("content"), where, role)
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                text_field(item, name, required=True, where=f"{where}.")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            text_field(item, "call_id", required=True, where=f"{where}.")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _tool_output(item.get("output"), where)})
        elif kind in ("reasoning", "item_reference"):
            raise bad(f"{where}: {kind} items are not supported (no reasoning models; refer to an earlier "
                      "response with previous_response_id)", "input")
        else:
            raise bad(f"{where}: item type {str(kind)[:40]!r} is not supported (message, function_call, "
                      "function_call_output)", "input")
    return messages


def _tool_choice(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    kind = value.get("type") if isinstance(value, Mapping) else type(value).__name__
    raise bad(f"'tool_choice' must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}, "
              f"not {str(kind)[:40]!r}", "tool_choice")


def _text_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    text = check_object(value, "'text'")
    check_fields(text, {"format", "verbosity"}, "'text'")
    if text.get("verbosity") not in (None, "medium"):
        raise bad("'text.verbosity' is not supported (the model's answer is as long as it is)", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    fmt = check_object(fmt, "'text.format'")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        check_fields(fmt, {"type", "name", "schema", "strict", "description"}, "'text.format'")
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad(f"'text.format.type' must be text, json_object or json_schema, got {str(kind)[:40]!r}", "text")


def translate_responses(body: Any, history: list[dict[str, Any]] | None = None) -> Translated:
    """The chat body a Responses request means; `history`: its previous response's conversation."""
    body = check_object(body)
    check_fields(body, _PASSED | _ACCEPTED | _OWN, _WHERE)
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, False, [], 0, {}):
            raise bad(why, name)
    text_field(body, "model", required=True, empty=False)
    if body.get("truncation") not in (None, "disabled"):
        raise bad("'truncation' must be 'disabled' (a conversation longer than the context is a 400, never cut)",
                  "truncation")
    if body.get("input") is None:
        raise bad("'input' is required", "input")
    instructions = text_field(body, "instructions")
    conversation = [*(history or []), *input_messages(body["input"])]
    if not conversation:
        raise bad("'input' is empty", "input")
    out: dict[str, Any] = {k: body[k] for k in _PASSED if body.get(k) is not None}
    out["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    limit = int_field(body, "max_output_tokens", 1, 1 << 31)
    if limit is not None:
        out["max_tokens"] = limit
    tools = flat_tools(list_field(body, "tools"), ("function",), "parameters")
    if tools:
        out["tools"] = tools
    if body.get("tool_choice") is not None and tools:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    elif body.get("tool_choice") not in (None, "auto", "none"):
        raise bad("'tool_choice' needs 'tools'", "tool_choice")
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    store = bool_field(body, "store", default=True)
    for name in ("metadata", "stream_options"):
        if body.get(name) is not None and not isinstance(body[name], Mapping):
            raise bad(f"'{name}' must be an object", name)
    echo = {
        "instructions": instructions, "max_output_tokens": limit, "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "previous_response_id": body.get("previous_response_id"), "store": store,
        "metadata": body.get("metadata") or {}, "user": body.get("user"), "truncation": "disabled",
    }
    return Translated("chat", out, _NAMES, {"echo": echo, "store": store, "conversation": conversation})


async def handle_responses(service: Any, store: ResponseStore, request: Request) -> Response:
    body = await service.read_json(request)
    owner = owner_of(request)
    history = None
    previous = body.get("previous_response_id") if isinstance(body, Mapping) else None
    if previous is not None:
        if not isinstance(previous, str) or not previous:
            raise bad("'previous_response_id' must be a response id", "previous_response_id")
        history = store.get(previous, owner)
        if history is None:
            raise APIError(404, f"previous response {previous[:80]!r} not found (responses are kept in this "
                           f"server's memory, for the API key that made them, up to {store.max_entries})",
                           param="previous_response_id", code="not_found")
    translated = await run_in_threadpool(translate_responses, body, history)
    plan = await plan_for(service.models, translated.model)
    parsed = await run_in_threadpool(parse_translated, translated, plan, service.max_tokens_limit(plan))
    keep_alive = keep_alive_field(body)
    conversation = translated.extra["conversation"]

    def keep(response_id: str, output: list[dict[str, Any]]) -> None:
        if translated.extra["store"]:
            store.put(response_id, owner, [*conversation, *output_messages(output)])

    try:
        return await service.generate(request, parsed, plan, keep_alive,
                                      reply=lambda ctx: ResponsesReply(ctx, translated.extra["echo"], keep))
    except APIError as e:
        raise renamed_error(e, _NAMES) from None
