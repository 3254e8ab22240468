"""The OpenAI request and response shapes, translated to and from edgeinfer's public types.

Parsing is strict: a field we cannot honour is a 400 that names it, never silently ignored
(n > 1, echo, suffix, logit_bias). Tools and structured output: server/tools.py.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import edgeinfer

from .errors import APIError
from .tools import ToolDeltas, ToolFields, chat_message, parse_constraint, parse_tool_fields, tool_call_json

__all__ = ["ParsedRequest", "parse_chat", "parse_completion", "finish_reason", "usage", "drafted_spans", "Responder"]

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled", "tool_calls": "tool_calls"}
_MAX_STOP = 16


def finish_reason(reason: str) -> str:
    return _FINISH.get(reason, reason)


@dataclass(frozen=True)
class ParsedRequest:
    kind: Literal["chat", "completion"]
    model: str | None
    options: edgeinfer.GenerateOptions
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: not asked; else how many alternatives
    include_drafted: bool = False  # stream_options.include_drafted: which text was drafted (our extension)
    messages: tuple[Mapping[str, Any], ...] = ()
    prompt: str | tuple[int, ...] = ""
    tools: ToolFields = ToolFields()


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not lo <= v <= hi:
        raise _bad(f"'{name}' must be a number in [{lo}, {hi}], got {v!r}", name)
    return float(v)


def _integer(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


def _speculation(body: Mapping[str, Any], server: edgeinfer.SpeculationOptions) -> edgeinfer.SpeculationOptions:
    """The extra field `speculation`: off, lookup, or the server's own method (its --speculate: a
    draft model or self-draft it opened, or auto), as a name or {"method": ..., "draft_max": ...}.
    A request never names a model file: the server's disk is not the client's to choose."""
    spec = body.get("speculation")
    if spec is None:
        return server
    if isinstance(spec, str):
        method, knobs = spec, {}
    elif isinstance(spec, Mapping):
        method = spec.get("method", server.method)
        knobs = {k: v for k, v in spec.items() if k != "method"}
    else:
        raise _bad("'speculation' must be a method name or an object", "speculation")
    unknown = sorted(set(knobs) - _SPECULATION_KNOBS)
    if unknown:
        raise _bad(f"'speculation' may set {', '.join(sorted(_SPECULATION_KNOBS))}, not {', '.join(unknown)} "
                   "(the draft model is the server's --speculate)", "speculation")
    if method in ("off", "lookup") or (method == "auto" and server.method != "auto"):
        base = edgeinfer.SpeculationOptions(method=method) if isinstance(method, str) else None
    elif method == server.method:
        base = server
    elif method in ("draft", "self", "eagle3"):
        raise _bad(f"speculation {method!r} needs a draft model this server did not open "
                   f"(it speculates with {server.method!r}: start it with --speculate {method}=...)", "speculation")
    elif method == "mtp":
        raise _bad(f"speculation 'mtp' needs the model's MTP head, which this server did not open "
                   f"(it speculates with {server.method!r}: start it with --speculate mtp)", "speculation")
    else:
        base = None
    if base is None:
        raise _bad(f"'speculation' must be off, lookup, auto, draft, self, mtp or eagle3, got {method!r}",
                   "speculation")
    try:
        return replace(base, **knobs).validate()
    except edgeinfer.InvalidOptionError as e:
        raise _bad(f"invalid 'speculation': {e}", "speculation") from None


_SPECULATION_KNOBS = {"draft_max", "draft_min", "p_min", "adaptive"}


def _common(body: Mapping[str, Any], max_tokens_limit: int,
            speculation: edgeinfer.SpeculationOptions) -> dict[str, Any]:
    """The fields chat and completions share, as keyword arguments of ParsedRequest."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    _integer(body, "n", 1, 1)  # one choice per request
    if body.get("logit_bias"):
        raise _bad("'logit_bias' is not supported", "logit_bias")
    constraint = parse_constraint(body)

    max_tokens = _integer(body, "max_completion_tokens", 1, max_tokens_limit)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, max_tokens_limit)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= _MAX_STOP:
        stops = tuple(stop)
    else:
        raise _bad(f"'stop' must be a string or a list of at most {_MAX_STOP} strings", "stop")
    if any(not s for s in stops):
        raise _bad("stop strings must not be empty", "stop")

    sampling: dict[str, Any] = {}
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                         ("repeat_penalty", 0.0, 10.0), ("presence_penalty", -2.0, 2.0),
                         ("frequency_penalty", -2.0, 2.0)):
        v = _number(body, name, lo, hi)
        if v is not None:
            sampling[name] = v
    if sampling.get("top_p") == 0.0:
        raise _bad("'top_p' must be greater than 0", "top_p")
    top_k = _integer(body, "top_k", 0, 1 << 20)
    if top_k is not None:
        sampling["top_k"] = top_k
    seed = _integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    if seed is not None:
        sampling["seed"] = seed  # as given: SamplingOptions maps OpenAI's int64 range to llama.cpp's seed

    spec = _speculation(body, speculation)

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, Mapping):
        raise _bad("'stream_options' must be an object", "stream_options")
    include_drafted = stream_options.get("include_drafted")
    if include_drafted is None:
        include_drafted = False
    elif not isinstance(include_drafted, bool):
        raise _bad("'stream_options.include_drafted' must be a boolean", "stream_options")
    try:
        options = edgeinfer.GenerateOptions(
            max_tokens=max_tokens or max_tokens_limit,
            stop=stops,
            sampling=edgeinfer.SamplingOptions(**sampling),
            speculation=spec,
        ).validate()
    except edgeinfer.InvalidOptionError as e:
        raise _bad(str(e)) from None
    if constraint:  # a schema or grammar that does not compile: a 400 naming the field
        try:
            options = replace(options, **constraint).validate()
        except edgeinfer.InvalidOptionError as e:
            raise _bad(str(e), "grammar" if "grammar" in constraint else "response_format") from None
    return {
        "model": model,
        "options": options,
        "stream": stream,
        "include_usage": bool(stream_options.get("include_usage", False)),
        "include_drafted": include_drafted,
    }


def _content(message: Mapping[str, Any], i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}]: only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_chat(body: Any, max_tokens_limit: int,
               speculation: edgeinfer.SpeculationOptions = edgeinfer.DEFAULT_SPECULATION) -> ParsedRequest:
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    parsed_messages = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a 'role'", "messages")
        parsed_messages.append(chat_message(m, i, _content(m, i)))
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise _bad("'logprobs' must be a boolean", "logprobs")
    top = _integer(body, "top_logprobs", 0, 20)
    if top is not None and not logprobs:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    tools = parse_tool_fields(body)
    common = _common(body, max_tokens_limit, speculation)
    if tools.active and (common["options"].grammar is not None or common["options"].json_schema is not None):
        raise _bad("a JSON response_format or grammar cannot be combined with tools (unless tool_choice is "
                   "'none')", "response_format")
    return ParsedRequest(kind="chat", messages=tuple(parsed_messages), logprobs=(top or 0) if logprobs else None,
                         tools=tools, **common)


def parse_completion(body: Any, max_tokens_limit: int,
                     speculation: edgeinfer.SpeculationOptions = edgeinfer.DEFAULT_SPECULATION) -> ParsedRequest:
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' must be a non-empty string or list of token ids (one prompt per request)", "prompt")
    if body.get("tools") is not None or body.get("functions") is not None:
        raise _bad("tools work with /v1/chat/completions", "tools")
    if body.get("echo"):
        raise _bad("'echo' is not supported", "echo")
    if body.get("suffix"):
        raise _bad("'suffix' is not supported", "suffix")
    if body.get("best_of") not in (None, 1):
        raise _bad("'best_of' must be 1", "best_of")
    logprobs = _integer(body, "logprobs", 0, 5)
    return ParsedRequest(kind="completion", prompt=prompt, logprobs=logprobs,
                         **_common(body, max_tokens_limit, speculation))


def drafted_spans(events: Sequence[edgeinfer.TokenEvent]) -> list[list[int]]:
    """[start, end) offsets, in Unicode code points of the events' joined text, of the text of
    tokens the drafter proposed and the model accepted (adjacent ones merged), as the chat UI
    colours them."""
    spans: list[list[int]] = []
    pos = 0
    for e in events:
        end = pos + len(e.text)
        if e.drafted and end > pos:
            if spans and spans[-1][1] == pos:
                spans[-1][1] = end
            else:
                spans.append([pos, end])
        pos = end
    return spans


def usage(stats: edgeinfer.GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


class Responder:
    """Builds the response objects and stream chunks of one request."""

    def __init__(self, req: ParsedRequest, model: str, token_bytes):
        self.req = req
        self.model = model
        self.id = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._token_bytes = token_bytes  # token id -> bytes (for logprobs)
        self._offset = 0  # text offset, for completion logprobs
        self._tool_deltas = ToolDeltas()
        self._uncounted = [0, 0]  # tokens, and drafted ones, in no chunk yet (their text was still pending)

    # -- logprobs --------------------------------------------------------------------------------
    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self._token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def chat_logprobs(self, events: Sequence[edgeinfer.TokenEvent]) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        content = []
        for e in events:
            entry = self._entry(e.token, getattr(e, "logprob", 0.0))
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in getattr(e, "top_logprobs", ())]
            content.append(entry)
        return {"content": content}

    def completion_logprobs(self, events: Sequence[edgeinfer.TokenEvent]) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in events:
            out["tokens"].append(self._entry(e.token, 0.0)["token"])
            out["token_logprobs"].append(getattr(e, "logprob", 0.0))
            out["top_logprobs"].append({self._entry(t, 0.0)["token"]: lp for t, lp in getattr(e, "top_logprobs", ())})
            out["text_offset"].append(self._offset)
            self._offset += len(e.text)
        return out

    # -- whole responses -------------------------------------------------------------------------
    def complete(self, events: list[edgeinfer.TokenEvent], done: edgeinfer.DoneEvent) -> dict[str, Any]:
        text = "".join(e.text for e in events)
        reason = finish_reason(done.finish_reason)
        if self.req.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if done.tool_calls:
                message = {"role": "assistant", "content": text or None,
                           "tool_calls": [tool_call_json(c) for c in done.tool_calls]}
            choice = {"index": 0, "message": message, "logprobs": self.chat_logprobs(events), "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs(events), "finish_reason": reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(done.stats), "edgeinfer": done.stats.to_dict()}

    # -- stream chunks ---------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def first_chunk(self) -> dict[str, Any] | None:
        if self.req.kind != "chat":
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def delta_chunks(self, batch: Sequence[Any]) -> list[dict[str, Any]]:
        """The chunks of a batch of events, in order: runs of tokens as content deltas, runs of
        tool-call events as `delta.tool_calls` (other events make none)."""
        chunks: list[dict[str, Any]] = []
        run: list[Any] = []
        for e in [*batch, None]:
            if run and (e is None or type(e) is not type(run[-1]) and not (
                    isinstance(e, edgeinfer.TokenEvent) and isinstance(run[-1], edgeinfer.TokenEvent))):
                if isinstance(run[0], edgeinfer.ToolCallEvent):
                    entries = self._tool_deltas.entries(run)
                    if entries:
                        chunks.append(self._chunk([{"index": 0, "delta": {"tool_calls": entries}, "logprobs": None,
                                                    "finish_reason": None}]))
                else:
                    chunk = self.delta_chunk(run)
                    if chunk is not None:
                        chunks.append(chunk)
                run = []
            if isinstance(e, (edgeinfer.TokenEvent, edgeinfer.ToolCallEvent)):
                run.append(e)
        return chunks

    def delta_chunk(self, events: list[edgeinfer.TokenEvent]) -> dict[str, Any] | None:
        text = "".join(e.text for e in events)
        self._uncounted[0] += len(events)
        self._uncounted[1] += sum(e.drafted for e in events)
        if not text and self.req.logprobs is None:
            return None
        if self.req.kind == "chat":
            choice = {"index": 0, "delta": {"content": text}, "logprobs": self.chat_logprobs(events),
                      "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs(events), "finish_reason": None}
        if self.req.include_drafted:
            tokens, drafted = self._uncounted
            choice["edgeinfer"] = {"tokens": tokens, "drafted_tokens": drafted, "drafted": drafted_spans(events)}
        self._uncounted = [0, 0]
        return self._chunk([choice])

    def last_chunks(self, done: edgeinfer.DoneEvent) -> list[dict[str, Any]]:
        reason = finish_reason(done.finish_reason)
        if self.req.kind == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
        chunks = [self._chunk([choice], edgeinfer=done.stats.to_dict())]
        if self.req.include_usage:
            chunks.append(self._chunk([], usage=usage(done.stats)))
        return chunks
