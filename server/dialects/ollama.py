"""`POST /api/chat` and `POST /api/generate`: Ollama's generation API over the chat and completions
request path, with Ollama's field names.

/api/chat becomes the chat-completions body it means: `messages` (with `tool_calls` whose
arguments are objects, and `tool_name` on tool messages), `tools`, `format` ("json": any JSON
object, or a JSON schema) the `response_format`, `options` the sampling fields. /api/generate is a
chat of `system` and `prompt` through the model's template, or with `raw: true` the prompt as it
is (`/v1/completions`). Both stream NDJSON unless `"stream": false` (server/dialects/ollama_reply.py).

`options`: temperature, top_k, top_p, min_p, seed, stop, repeat_penalty, repeat_last_n (-1: the
context), presence_penalty, frequency_penalty, num_predict (-1 and -2: up to the context) are
honoured; num_ctx is accepted up to the context a request gets here (a model's context is set
when it loads: serve.toml / --ctx), num_keep changes nothing (the context is never shifted: a
prompt too long is a 400); mirostat 0, typical_p 1, tfs_z 1 and penalize_newline false are
accepted (off). Defaults are the engine's (SamplingOptions), not Ollama's. Load options (num_gpu,
num_thread, num_batch, use_mmap, ...) are refused: a model loads once with the server's settings.
`keep_alive` as Ollama's (a duration, 0 unloads after the request, negative keeps it loaded); an
empty `messages` / `prompt` only loads the model (done_reason "load"), or with keep_alive 0
unloads it ("unload"), as Ollama does.

Refused with a 400 naming them: images (no multimodal models), `think` (no reasoning models),
`logprobs`, `suffix` (no fill-in-the-middle), `template` (the model's own template is used),
`context` (the deprecated token context: send the conversation to /api/chat), image generation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import edgeinfer
from edgeinfer.service import ModelPlan

from ..errors import APIError
from ..protocol import ParsedRequest
from ..routing import acquire, keep_alive_field, plan_for
from .common import (MAX_ITEMS, Translated, bad, bool_field, check_fields, check_object, int_field, list_field,
                     parse_translated, renamed_error, text_field)
from .ollama_reply import OllamaReply, created_at

__all__ = ["translate_ollama", "handle_ollama_generation"]

_COMMON = {"model", "format", "options", "stream", "keep_alive", "think", "logprobs", "top_logprobs"}
_FIELDS = {"chat": _COMMON | {"messages", "tools"},
           "generate": _COMMON | {"prompt", "suffix", "system", "template", "context", "raw", "images", "width",
                                  "height", "steps"}}
_REFUSED = {
    "think": "'think' is not supported (no reasoning models)",
    "logprobs": "'logprobs' is not supported on /api routes (use /v1/chat/completions with 'logprobs')",
    "top_logprobs": "'top_logprobs' is not supported on /api routes (use /v1/chat/completions)",
    "suffix": "'suffix' is not supported (no fill-in-the-middle)",
    "template": "'template' is not supported (the model's own chat template is used; 'raw': true sends the "
                "prompt as it is)",
    "context": "'context' is not supported (send the conversation to /api/chat instead)",
    "images": "images are not supported (the models served here read text only)",
    "width": "image generation is not supported", "height": "image generation is not supported",
    "steps": "image generation is not supported",
}
_SAMPLING = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "repeat_penalty": (0.0, 10.0),
             "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}
_OFF = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0, "penalize_newline": False}  # accepted at these values
_LOAD = {"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap",
         "use_mlock", "embedding_only", "num_thread"}
_OPTIONS = set(_SAMPLING) | set(_OFF) | _LOAD | {"top_k", "seed", "stop", "num_predict", "num_ctx", "num_keep",
                                                  "repeat_last_n"}
_NAMES = {"max_tokens": "options.num_predict", "response_format": "format", "messages": "messages",
          **{k: f"options.{k}" for k in (*_SAMPLING, "top_k", "seed", "stop")}}


def _options(value: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Ollama's options into the chat body's fields; what the body cannot say is returned."""
    if value is None:
        return {}
    options = check_object(value, "'options'")
    check_fields(options, _OPTIONS, "'options'")
    for name in sorted(_LOAD & set(options)):
        raise bad(f"'options.{name}' is a load option: a model loads once, with the server's settings "
                  "(serve.toml, the serve flags)", "options")
    for name, off in _OFF.items():
        if options.get(name) is not None and options[name] != off:
            raise bad(f"'options.{name}' is not supported (only {json.dumps(off)}: off)", "options")
    for name in _SAMPLING:
        if options.get(name) is not None:
            out[name] = options[name]
    for name in ("top_k", "seed"):
        if options.get(name) is not None:
            out[name] = options[name]
    stop = options.get("stop")
    if stop is not None:
        out["stop"] = [stop] if isinstance(stop, str) else stop
    predict = int_field(options, "num_predict", -2, 1 << 31, where="options.")
    if predict == 0:
        raise bad("'options.num_predict' must be at least 1 (or -1, -2: up to the context)", "options")
    if predict is not None and predict > 0:
        out["max_tokens"] = predict
    int_field(options, "num_keep", -1, 1 << 31, where="options.")
    later = {"num_ctx": int_field(options, "num_ctx", 1, 1 << 31, where="options."),
             "repeat_last_n": int_field(options, "repeat_last_n", -1, 1 << 31, where="options.")}
    return {k: v for k, v in later.items() if v is not None}


def _adjust(later: dict[str, Any]):
    """What the chat body cannot say, applied to the parsed request once the model's plan is known."""
    def adjust(parsed: ParsedRequest, plan: ModelPlan) -> ParsedRequest:
        n_ctx = plan.n_ctx_per_request
        if later.get("num_ctx") is not None and later["num_ctx"] > n_ctx:
            raise bad(f"'options.num_ctx' {later['num_ctx']} is more than the {n_ctx} tokens a request to "
                      f"{plan.name} gets here (its context is set when it loads: serve.toml ctx/parallel, or "
                      "--ctx/--parallel)", "options")
        last_n = later.get("repeat_last_n")
        if last_n is None:
            return parsed
        sampling = replace(parsed.options.sampling, repeat_last_n=n_ctx if last_n == -1 else last_n)
        return replace(parsed, options=replace(parsed.options, sampling=sampling))

    return adjust


def _format(value: Any) -> dict[str, Any] | None:
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, Mapping):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise bad("'format' must be \"json\" or a JSON schema object", "format")


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise bad(f"{where} must be an object", "messages")
    check_fields(m, {"role", "content", "images", "tool_calls", "tool_name", "thinking"}, where)
    if m.get("images"):
        raise bad(f"{where}: images are not supported (the models served here read text only)", "messages")
    if m.get("thinking"):
        raise bad(f"{where}: 'thinking' is not supported (no reasoning models)", "messages")
    role = text_field(m, "role", required=True, empty=False, where=f"{where}.")
    out: dict[str, Any] = {"role": role, "content": text_field(m, "content", where=f"{where}.") or ""}
    calls = list_field(m, "tool_calls", where=f"{where}.")
    if calls:
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise bad(f"{where}.tool_calls[{j}] must be {{\"function\": {{\"name\": ..., \"arguments\": {{...}}}}}}",
                          "messages")
            out["tool_calls"].append({"type": "function", "function": {"name": fn["name"],
                                                                       "arguments": fn.get("arguments") or {}}})
    name = text_field(m, "tool_name", where=f"{where}.")
    if name:
        out["name"] = name
    return out


def translate_ollama(body: Any, kind: str) -> Translated | None:
    """The OpenAI body an /api/chat or /api/generate request means; None for a load/unload request
    (no messages, or an empty prompt)."""
    body = check_object(body)
    check_fields(body, _FIELDS[kind], f"/api/{kind}")
    for name, why in _REFUSED.items():
        if name in _FIELDS[kind] and body.get(name) not in (None, False, [], ""):
            raise bad(why, name)
    model = text_field(body, "model", required=True, empty=False)
    out: dict[str, Any] = {"model": model, "stream": bool_field(body, "stream", default=True)}
    later = _options(body.get("options"), out)
    fmt = _format(body.get("format"))
    if fmt is not None:
        out["response_format"] = fmt
    names = dict(_NAMES)
    if kind == "chat":
        messages = list_field(body, "messages", limit=MAX_ITEMS)
        if not messages:
            return None
        out["messages"] = [_message(m, i) for i, m in enumerate(messages)]
        tools = list_field(body, "tools")
        if tools:
            out["tools"] = tools
        return Translated("chat", out, names, adjust=_adjust(later))
    prompt = text_field(body, "prompt")
    system = text_field(body, "system")
    if not prompt:
        return None
    if bool_field(body, "raw", default=False):
        if system:
            raise bad("'system' does nothing with 'raw': true (the prompt is sent as it is)", "system")
        out["prompt"] = prompt
        names["prompt"] = "prompt"
        return Translated("completion", out, names, adjust=_adjust(later))
    out["messages"] = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                      "content": prompt}]
    names["messages"] = "prompt"
    return Translated("chat", out, names, adjust=_adjust(later))


async def _load_or_unload(service: Any, request: Request, body: Mapping[str, Any], kind: str,
                          keep_alive: float | None) -> Response:
    """Ollama's way to load a model (an empty request) or unload it (the same with keep_alive 0)."""
    plan = await plan_for(service.models, body["model"])
    if keep_alive == 0:
        try:
            await run_in_threadpool(service.models.stop, body["model"])
        except edgeinfer.ModelNotLoadedError:
            pass  # not loaded: nothing to unload, as Ollama answers
        reason = "unload"
    else:
        lease = await acquire(service.models, body["model"], keep_alive, request)
        lease.release()
        reason = "load"
    piece = {"response": ""} if kind == "generate" else {"message": {"role": "assistant", "content": ""}}
    return JSONResponse({"model": plan.name, "created_at": created_at(), **piece, "done_reason": reason,
                         "done": True})


async def handle_ollama_generation(service: Any, request: Request, kind: str) -> Response:
    body = await service.read_json(request)
    translated = await run_in_threadpool(translate_ollama, body, kind)
    keep_alive = keep_alive_field(body)
    if translated is None:
        return await _load_or_unload(service, request, body, kind, keep_alive)
    plan = await plan_for(service.models, translated.model)
    parsed = await run_in_threadpool(parse_translated, translated, plan, service.max_tokens_limit(plan))
    try:
        return await service.generate(request, parsed, plan, keep_alive, reply=lambda ctx: OllamaReply(ctx, kind))
    except APIError as e:
        raise renamed_error(e, translated.names) from None
