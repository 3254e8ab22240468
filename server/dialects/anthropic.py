"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the chat
request path.

The request becomes the chat-completions body it means: `system` (a string or text blocks) the
system message; each message's content blocks its content (`text`), its tool calls (`tool_use`, on
assistant turns) or tool messages (`tool_result`, on user turns, `is_error` said in the text);
`tools` (name, description, input_schema) and `tool_choice` (auto, any, tool, none;
`disable_parallel_tool_use`) the chat's tools; `output_config.format` (json_schema) the
`response_format`; `stop_sequences`, `max_tokens`, `temperature` (0..1, as Anthropic's), `top_p`,
`top_k` as they are. `cache_control` marks, `metadata`, `service_tier` and `thinking:
{"type": "disabled"}` are accepted and change nothing. The key may come in `x-api-key` (as
Anthropic's clients send it) or `Authorization: Bearer`; `anthropic-version` and `anthropic-beta`
headers are accepted whatever they say.

Refused with a 400 that names them: images and documents (no multimodal models), `thinking`
(no reasoning models), server tools (bash, text editor, web search, ...: the server runs no tools),
`output_config.effort`, `container`, MCP servers. count_tokens renders the prompt with the model's
chat template (tools included), as the request would be read, so the model is loaded for it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import edgeinfer

from ..errors import APIError, from_library_error
from ..routing import acquire, plan_for
from ..tools import prepare_chat
from .anthropic_reply import AnthropicReply
from .common import (MAX_ITEMS, Translated, bad, bool_field, check_fields, check_object, flat_tools, int_field,
                     list_field, number_field, parse_translated, renamed_error, text_field)

__all__ = ["translate_messages", "handle_messages", "handle_count_tokens"]

_COMMON = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "cache_control"}
_CREATE = _COMMON | {"max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k", "metadata",
                     "service_tier"}
_NAMES = {"messages": "messages", "stop": "stop_sequences", "response_format": "output_config.format",
          "max_completion_tokens": "max_tokens"}
_BLOCK_FIELDS = {"text": {"type", "text", "cache_control", "citations"},
                 "tool_use": {"type", "id", "name", "input", "cache_control"},
                 "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"}}


def _text_blocks(value: Any, where: str, param: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        raise bad(f"{where} must be a string or a list of at most {MAX_ITEMS} text blocks", param)
    parts = []
    for j, block in enumerate(value):
        if not isinstance(block, Mapping) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, Mapping) else None
            what = f"{kind} blocks are not supported here" if kind in ("image", "document") else "must be a text block"
            raise bad(f"{where}[{j}] {what}", param)
        check_fields(block, _BLOCK_FIELDS["text"], f"{where}[{j}]")
        parts.append(block["text"])
    return "".join(parts)


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user turn's tool results come first, one each)."""
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise bad(f"{where} must be an object", "messages")
    check_fields(m, {"role", "content"}, where)
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise bad(f"{where}.role must be 'user' or 'assistant', got {str(role)[:40]!r}", "messages")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of content blocks", "messages")
    if len(content) > MAX_ITEMS:
        raise bad(f"{where}.content has {len(content)} blocks, more than the {MAX_ITEMS} a request may have",
                  "messages")
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind not in _BLOCK_FIELDS:
            why = {"image": "images are not supported (the models served here read text only)",
                   "document": "documents are not supported (send their text)",
                   "thinking": "thinking blocks are not supported (no reasoning models)",
                   "redacted_thinking": "thinking blocks are not supported (no reasoning models)"}.get(
                str(kind), f"must be a text, tool_use or tool_result block, got {str(kind)[:40]!r}")
            raise bad(f"{at}: {why}", "messages")
        check_fields(block, _BLOCK_FIELDS[kind], at)
        if kind == "text":
            text.append(text_field(block, "text", required=True, where=f"{at}."))
        elif kind == "tool_use":
            if role != "assistant":
                raise bad(f"{at}: tool_use blocks belong to assistant messages", "messages")
            text_field(block, "id", required=True, empty=False, where=f"{at}.")
            text_field(block, "name", required=True, empty=False, where=f"{at}.")
            if not isinstance(block.get("input"), Mapping):
                raise bad(f"{at}.input must be an object", "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        else:
            if role != "user":
                raise bad(f"{at}: tool_result blocks belong to user messages", "messages")
            text_field(block, "tool_use_id", required=True, empty=False, where=f"{at}.")
            result = _text_blocks(block.get("content") or "", f"{at}.content", "messages")
            if bool_field(block, "is_error", where=f"{at}."):
                result = f"Error: {result}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
    out = list(results)
    if calls:
        out.append({"role": "assistant", "content": "".join(text) or None, "tool_calls": calls})
    elif text or not results:
        out.append({"role": role, "content": "".join(text)})
    return out


def _tool_choice(value: Any, body: dict[str, Any]) -> None:
    if value is None:
        return
    choice = check_object(value, "'tool_choice'")
    check_fields(choice, {"type", "name", "disable_parallel_tool_use"}, "'tool_choice'")
    kind = choice.get("type")
    if kind == "tool":
        body["tool_choice"] = {"type": "function", "function": {"name": text_field(choice, "name", required=True,
                                                                                     where="tool_choice.")}}
    elif kind in ("auto", "any", "none"):
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise bad(f"'tool_choice.type' must be auto, any, tool or none, got {str(kind)[:40]!r}", "tool_choice")
    if bool_field(choice, "disable_parallel_tool_use", where="tool_choice."):
        body["parallel_tool_calls"] = False


def _output_config(value: Any, body: dict[str, Any]) -> None:
    if value is None:
        return
    config = check_object(value, "'output_config'")
    check_fields(config, {"format", "effort"}, "'output_config'")
    if config.get("effort") is not None:
        raise bad("'output_config.effort' is not supported (no reasoning models)", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return
    fmt = check_object(fmt, "'output_config.format'")
    check_fields(fmt, {"type", "schema"}, "'output_config.format'")
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), Mapping):
        raise bad("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config")
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def translate_messages(body: Any, *, count_only: bool = False) -> Translated:
    body = check_object(body)
    check_fields(body, _COMMON if count_only else _CREATE,
                 "/v1/messages/count_tokens" if count_only else "/v1/messages")
    model = text_field(body, "model", required=True, empty=False)
    out: dict[str, Any] = {"model": model}
    if not count_only:
        if body.get("max_tokens") is None:
            raise bad("'max_tokens' is required", "max_tokens")
        out["max_tokens"] = int_field(body, "max_tokens", 1, 1 << 31)
        out["stream"] = bool_field(body, "stream", default=False)
        for name, hi in (("temperature", 1.0), ("top_p", 1.0)):
            value = number_field(body, name, 0.0, hi)
            if value is not None:
                out[name] = value
        top_k = int_field(body, "top_k", 0, 1 << 20)
        if top_k is not None:
            out["top_k"] = top_k
        stops = list_field(body, "stop_sequences", limit=16)
        if stops:
            if not all(isinstance(s, str) and s for s in stops):
                raise bad("'stop_sequences' must be non-empty strings", "stop_sequences")
            out["stop"] = stops
        for name in ("metadata",):
            if body.get(name) is not None and not isinstance(body[name], Mapping):
                raise bad(f"'{name}' must be an object", name)
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, Mapping) or thinking.get("type") != "disabled"):
        raise bad("'thinking' is not supported (no reasoning models): leave it out or set {\"type\": \"disabled\"}",
                  "thinking")
    messages = list_field(body, "messages")
    if not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    system = body.get("system")
    chat = [{"role": "system", "content": _text_blocks(system, "system", "system")}] if system else []
    for i, m in enumerate(messages):
        chat += _message(m, i)
    out["messages"] = chat
    tools = flat_tools(list_field(body, "tools"), (None, "custom"), "input_schema")
    if tools:
        out["tools"] = tools
        _tool_choice(body.get("tool_choice"), out)
    elif body.get("tool_choice") is not None and check_object(body["tool_choice"], "'tool_choice'").get("type") != "none":
        raise bad("'tool_choice' needs 'tools'", "tool_choice")
    _output_config(body.get("output_config"), out)
    return Translated("chat", out, _NAMES, {"stops": tuple(out.get("stop", ()))})


async def handle_messages(service: Any, request: Request) -> Response:
    body = await service.read_json(request)
    translated = await run_in_threadpool(translate_messages, body)
    plan = await plan_for(service.models, translated.model)
    parsed = await run_in_threadpool(parse_translated, translated, plan, service.max_tokens_limit(plan))
    try:
        return await service.generate(request, parsed, plan, None,
                                      reply=lambda ctx: AnthropicReply(ctx, translated.extra["stops"]))
    except APIError as e:
        raise renamed_error(e, _NAMES) from None


async def handle_count_tokens(service: Any, request: Request) -> Response:
    """The prompt's tokens as the model's chat template renders it (tools included)."""
    body = await service.read_json(request)
    translated = await run_in_threadpool(translate_messages, body, count_only=True)
    plan = await plan_for(service.models, translated.model)
    parsed = await run_in_threadpool(parse_translated, translated, plan, service.max_tokens_limit(plan))
    lease = await acquire(service.models, parsed.model, None, request)
    try:
        tokens, _, _ = await run_in_threadpool(prepare_chat, lease.engine, parsed.messages, parsed.options,
                                               parsed.tools)
    except edgeinfer.EdgeInferError as e:
        raise renamed_error(from_library_error(e), _NAMES) from None
    finally:
        lease.release()
    return JSONResponse({"input_tokens": len(tokens)})
