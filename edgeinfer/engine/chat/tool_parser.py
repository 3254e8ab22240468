"""The model's own tool-call formats, and the streaming parser that turns its text into calls.

Call formats recognized (detected from the chat template's text):

| format | models | a call is written as | parsed |
| --- | --- | --- | --- |
| `hermes` | Qwen2.5 / Qwen3 (not Qwen3-Coder's XML), Hermes 2 Pro / 3, and every template without tools support (edgeinfer's fallback) | `<tool_call>{"name": f, "arguments": {…}}</tool_call>`, any number, anywhere in the reply; also the call object in a ```json block, or as the whole reply (Qwen2.5-Coder writes them so) | yes, streamed |
| `llama3` | Llama 3.1 / 3.2 / 3.3 (JSON tool calling) | `{"name": f, "parameters": {…}}` as the whole reply, or after `<|python_tag|>` | yes, streamed; one call a reply (the template renders one) |
| `mistral` | Mistral 7B v0.3, Nemo, Small ≤ 3.1 | `[TOOL_CALLS][{"name": f, "arguments": {…}, "id": "abc123xyz"}, …]` | yes, streamed |
| `mistral-args` | templates with `[ARGS]` (Mistral Small 3.2, Magistral, Devstral, Ministral 3) | `[TOOL_CALLS]f[ARGS]{…}` per call | yes, streamed |

Not recognized (a request with tools is refused with one line naming the way out, `chatml`):
Llama 3.1's built-in tools (`<|python_tag|>brave_search.call(...)`), functionary, Command-R,
DeepSeek, gpt-oss (harmony), Granite, Phi-4, Gemma 4, Qwen3-Coder's XML (`<function=…>`).
Both `"arguments"` and `"parameters"` are accepted as the arguments key in every format. A call
without a marker (a ```json block, a reply that is a JSON object) counts only if its first key is
"name" (or "type"), the name is one of the tools' and an arguments key follows; otherwise it is
content, as is every other code block.

Malformed calls (no grammar can make these, but `auto` without a grammar-compatible schema or a
model that stops mid-call can): a call marker followed by text that is not a call object is
content; a call whose name was already streamed keeps the arguments text the model wrote (it may
not be valid JSON, as OpenAI warns), up to the format's end marker; a call cut off by `max_tokens`
is not in `DoneEvent.tool_calls`.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from .template import template_supports_tools
from .json_scan import JsonScan
from ..core.events import DoneEvent, Event, TokenEvent, ToolCall, ToolCallEvent

__all__ = ["ToolFormat", "FORMATS", "HERMES", "LLAMA3", "MISTRAL", "MISTRAL_ARGS", "ToolCallParser", "detect_format",
           "new_call_id", "NAME"]

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a function name OpenAI accepts


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls (see the table in the module docstring)."""

    name: str
    start: str  # the text that starts a call (or a list of calls)
    end: str = ""  # the text that ends one, if the format has one
    args_key: str = "arguments"  # how the model names the arguments (both names are read)
    parallel: bool = True  # the format can carry several calls in one reply
    bare: bool = False  # a reply that is a JSON call object, without a marker, is a call too
    fenced: bool = False  # and so is a call object in a ```json code block


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", bare=True, fenced=True)
LLAMA3 = ToolFormat("llama3", "<|python_tag|>", args_key="parameters", parallel=False, bare=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]")
MISTRAL_ARGS = ToolFormat("mistral-args", "[TOOL_CALLS]", "[ARGS]")
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS)}


def detect_format(template: str) -> ToolFormat | None:
    """The call format of a chat template: Hermes for templates without tools support (they get the
    Hermes fallback), None for a template that renders tools in a format not recognized here."""
    if not template_supports_tools(template):
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL_ARGS if "[ARGS]" in template else MISTRAL
    if "<tool_call>" in template and "<function=" not in template:
        return HERMES
    if "<|start_header_id|>" in template and ("<|python_tag|>" in template or '"parameters"' in template):
        return LLAMA3
    return None


def new_call_id(fmt: ToolFormat = HERMES) -> str:
    """An id for a call the model made: OpenAI's `call_…`; 9 letters and digits for Mistral's
    templates, which refuse any other id when the call comes back in the conversation. (An id a
    Mistral model writes comes after the arguments, which are streamed before it: ours is used.)"""
    alphabet = string.ascii_letters + string.digits
    if fmt.name.startswith("mistral"):
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


# -- parsing ---------------------------------------------------------------------------------------

# A call marker that is a control token prints as nothing: the parser puts its text in the buffer
# between these two noncharacters, so that it is recognized but never shown.
_HIDE, _SHOW = "\ufdd0", "\ufdd1"
_HIDDEN = re.compile(f"{_HIDE}[^{_SHOW}]*{_SHOW}")


def _marker(text: str) -> re.Pattern[str]:
    return re.compile(f"({_HIDE})?{re.escape(text)}{_SHOW}?")


def _fenced_call(buf: str, at: int) -> int:
    """For a "```" at `at`: where a call object would begin if this code block holds one (```json
    and whitespace, then "{"), 0 if it cannot, -1 if the text so far does not tell."""
    i = at + 3
    for tag in ("json", "JSON", ""):
        if buf.startswith(tag, i) or (tag and tag.startswith(buf[i:]) and len(buf) - i < len(tag)):
            if not buf.startswith(tag, i):
                return -1  # "```js..." so far
            i += len(tag)
            break
    j = i
    while j < len(buf) and buf[j] in " \t\r\n":
        j += 1
    if j == len(buf):
        return -1
    return j if buf[j] == "{" else 0


class _Call:
    """A call being read: its scanner and what has been streamed of it."""

    def __init__(self, index: int, marker_text: str, prelude: str = "", strict: bool = False, closer: str = ""):
        self.index = index
        # no call marker (a reply opening with "{", a ```json block): a call only if it reads as one,
        # its first key "name" (or "type"), the name one of the tools', and an arguments key
        self.strict = strict
        self.closer = closer  # the text that ends the call after its object (`</tool_call>`, ```)
        self.marker_text = marker_text  # given back as content if this turns out not to be a call
        self.prelude = prelude  # "bracket" (Mistral's list), "name" (Mistral's name[ARGS]) or ""
        self.scan = JsonScan()
        self.id = ""
        self.name: str | None = None
        self.started = False
        self.sent = ""  # the arguments text streamed so far
        self.args_start = -1  # where the arguments value begins in the buffer, once known
        self.raw = False  # broken JSON after its name went out: its arguments are the raw text


class ToolCallParser:
    """Turns a generation's events into content TokenEvents and ToolCallEvents (see the module).

    `feed(event)` for each TokenEvent returns the events to show now: the TokenEvent itself with
    `text` cut to the content (it is always returned, so token counts and logprobs stay whole), then
    any ToolCallEvents (content that follows a call within the same token goes with the next token).
    `finish(done)` returns what was held back (carried by a copy of the last TokenEvent) and the
    DoneEvent with `tool_calls`, `text` = the content, and finish_reason "tool_calls" when calls were
    made. `events(source)` does both for a whole stream. `enabled=False` passes everything through."""

    def __init__(self, fmt: ToolFormat, *, names: Sequence[str] = (), markers: Mapping[int, str] | None = None,
                 parallel: bool = True, enabled: bool = True):
        self.format = fmt
        self.names = frozenset(names)
        self.markers = dict(markers or {})
        self.parallel = parallel
        self.enabled = enabled
        self.calls: list[ToolCall] = []
        self._start_re = _marker(fmt.start)
        self._end_re = _marker(fmt.end) if fmt.end else None
        self._buf = ""  # text not given out yet: held back, or the call being read
        self._state = "content"  # content | call | after
        self._call: _Call | None = None
        self._content: list[str] = []
        self._at_start = True  # nothing but whitespace given out yet
        self._started = 0  # calls whose first event went out
        self._deferred = ""  # content after a call within one token: given with the next token
        self._last: TokenEvent | None = None
        self._closer = ""  # what closes the call just read

    # -- events ------------------------------------------------------------------------------------
    def events(self, source: Iterable[Event]) -> Iterator[Event]:
        for event in source:
            if isinstance(event, DoneEvent):
                yield from self.finish(event)
            elif isinstance(event, TokenEvent):
                yield from self.feed(event)
            else:
                yield event

    def feed(self, event: TokenEvent) -> list[Event]:
        if not self.enabled:
            self._content.append(event.text)
            return [event]
        text = event.text
        if not text and event.token in self.markers:
            text = _HIDE + self.markers[event.token] + _SHOW
        self._last = event
        items = self._push(text, final=False)
        out: list[Event] = []
        carrier, self._deferred = self._deferred, ""
        for item in items:
            if isinstance(item, str):
                if out:
                    self._deferred += item
                else:
                    carrier += item
            else:
                if not out:
                    out.append(replace(event, text=carrier))
                out.append(item)
        return out or [replace(event, text=carrier)]

    def finish(self, done: DoneEvent) -> list[Event]:
        if not self.enabled:
            return [done]
        items = self._push("", final=True)
        out: list[Event] = []
        tail = self._deferred + "".join(i for i in items if isinstance(i, str))
        self._deferred = ""
        if tail and self._last is not None:
            out.append(replace(self._last, text=tail))
        out += [i for i in items if isinstance(i, ToolCallEvent)]
        reason = done.finish_reason
        if self.calls and reason in ("eos", "stop"):
            reason = "tool_calls"
        out.append(replace(done, text="".join(self._content), finish_reason=reason, tool_calls=tuple(self.calls)))
        return out

    # -- the text machine ---------------------------------------------------------------------------
    def _push(self, text: str, final: bool) -> list[str | ToolCallEvent]:
        self._buf += text
        out: list[str | ToolCallEvent] = []
        while True:
            before = (self._state, self._buf, self._call)
            if self._state == "content":
                self._content_step(out, final)
            elif self._state == "call":
                self._call_step(out, final)
            else:
                self._after_step(out, final)
            if (self._state, self._buf, self._call) == before:
                break
        return out

    def _release(self, out: list[str | ToolCallEvent], text: str) -> None:
        text = _HIDDEN.sub("", text)
        if text:
            if text.strip():
                self._at_start = False
            out.append(text)
            self._content.append(text)

    def _may_call(self) -> bool:
        return self.parallel or not self._started

    def _content_step(self, out: list[str | ToolCallEvent], final: bool) -> None:
        buf, fmt = self._buf, self.format
        may = self._may_call()
        found: list[tuple[int, str]] = []  # where a call may start, and how
        hit = self._start_re.search(buf) if may else None
        if hit is not None:
            found.append((hit.start(), "marker"))
        if may and fmt.bare and self._at_start:
            j = len(buf) - len(buf.lstrip())
            if buf[j : j + 1] == "{":
                found.append((j, "bare"))
        fence = buf.find("```") if may and fmt.fenced else -1
        if fence >= 0:
            found.append((fence, "fence"))
        if found:
            at, kind = min(found)
            before = buf[:at]
            if kind == "fence":
                end = _fenced_call(buf, at)
                if end == 0:  # a code block that is not a call: its fence is content
                    self._release(out, buf[: at + 3])
                    self._buf = buf[at + 3 :]
                    return
                if end < 0 and not final:  # not known yet: keep the fence
                    if before.strip() or not (self._at_start or self.calls):
                        self._release(out, before)
                        self._buf = buf[at:]
                    return
                if end < 0:
                    self._release(out, buf)
                    self._buf = ""
                    return
            if before.strip() or not (self._at_start or self.calls):
                self._release(out, before)  # (whitespace held before a first call or between calls is dropped)
            if kind == "bare":
                self._buf = buf[at:]
                self._begin("", strict=True)
            elif kind == "fence":
                self._buf = buf[end:]
                self._begin(buf[at:end], strict=True, closer="```")
            else:
                assert hit is not None
                self._buf = buf[hit.end() :]
                self._begin("" if hit.group(1) else hit.group(0),
                            "bracket" if fmt is MISTRAL else "name" if fmt is MISTRAL_ARGS else "", closer=fmt.end)
            return
        if final:
            if buf.strip() or not self.calls:
                self._release(out, buf)
            self._buf = ""
            return
        start = fmt.start
        keep = max((k for k in range(1, len(start)) if buf.endswith(start[:k])), default=0) if may else 0
        if may and fmt.fenced:
            keep = max(keep, len(buf) - len(buf.rstrip("`")))
        rest = buf[: len(buf) - keep]
        if not rest.strip() and (self._at_start or self.calls):
            return  # whitespace before or between calls: shown only if content follows
        self._release(out, rest)
        self._buf = buf[len(rest) :]

    def _begin(self, marker_text: str, prelude: str = "", strict: bool = False, closer: str = "") -> None:
        self._call = _Call(self._started, marker_text, prelude, strict, closer)
        self._state = "call"

    def _call_step(self, out: list[str | ToolCallEvent], final: bool) -> None:
        call = self._call
        assert call is not None
        if call.raw:
            self._raw_step(out, final)
            return
        if call.prelude and not self._prelude(out, call, final):
            return
        scan = call.scan
        scan.feed(self._buf, final)
        if self.format is MISTRAL_ARGS:
            if scan.error:
                self._broken(out, call, final)
            else:
                self._args_value_step(out, call, final)
            return
        bare = call.strict
        members = scan.members
        if call.name is None:
            first = next(iter(members), None) or scan.key
            if bare and first is not None and first not in ("name", "type"):
                self._not_a_call(out)
                return
            if "name" in members:
                name = json.loads(self._buf[slice(*members["name"])])
                if not isinstance(name, str) or not NAME.fullmatch(name) or (bare and name not in self.names):
                    self._not_a_call(out)
                    return
                call.name = name
        key = next((k for k in ("arguments", "parameters") if k in members), None)
        in_args = scan.key in ("arguments", "parameters") and scan.value_start >= 0
        if key is not None:
            call.args_start = members[key][0]
        elif in_args:
            call.args_start = scan.value_start
        if scan.error:
            self._broken(out, call, final)
            return
        if call.name is not None and not call.started and (in_args or key is not None):
            self._start(out, call)
        if call.started and call.args_start >= 0:
            self._stream(out, call, members[key][1] if key is not None else scan.pos)
        if scan.done:
            if call.name is None or (bare and key is None):
                self._not_a_call(out)
                return
            args = self._args_text(self._buf[slice(*members[key])]) if key is not None else "{}"
            self._complete(out, call, args)
            self._buf = self._buf[scan.end :]
            self._state = "after"
        elif final:
            self._cut_off(out, call)

    def _broken(self, out: list[str | ToolCallEvent], call: _Call, final: bool) -> None:
        """The call's JSON broke: a call whose name and the start of whose arguments were read is
        kept with the raw text as its arguments; anything less is content."""
        if call.name is None or call.args_start < 0:
            self._not_a_call(out)
            return
        if not call.started:
            self._start(out, call)
        call.raw = True
        self._raw_step(out, final)

    def _prelude(self, out: list[str | ToolCallEvent], call: _Call, final: bool) -> bool:
        """Mistral's "[" before its list of calls, or the function name before [ARGS]: True once read."""
        if call.prelude == "bracket":
            body = self._buf.lstrip()
            if body[:1] == "[":
                call.marker_text += self._buf[: len(self._buf) - len(body) + 1]
                self._buf = body[1:]
                call.prelude = ""
                return True
            if body or final:
                self._not_a_call(out)
            return False
        assert self._end_re is not None
        hit = self._end_re.search(self._buf)
        head = self._buf if hit is None else self._buf[: hit.start()]
        if hit is None:  # the name so far, without what may be the start of [ARGS]
            end = self.format.end
            head = head[: len(head) - max((k for k in range(1, len(end)) if head.endswith(end[:k])), default=0)]
        if not NAME.fullmatch(head.strip() or "x") or len(head) > 80 or (final and hit is None):
            self._not_a_call(out)
            return False
        if hit is None:
            return False
        call.name = head.strip()
        call.marker_text += self._buf[: hit.end()]
        self._buf = self._buf[hit.end() :]
        call.prelude = ""
        return True

    def _args_value_step(self, out: list[str | ToolCallEvent], call: _Call, final: bool) -> None:
        """Mistral's [ARGS]: the arguments are the whole JSON value that follows."""
        scan = call.scan
        if not call.started:
            self._start(out, call)
        call.args_start = len(self._buf) - len(self._buf.lstrip())
        self._stream(out, call, scan.end if scan.done else scan.pos)
        if scan.done:
            self._complete(out, call, self._args_text(self._buf[call.args_start : scan.end]))
            self._buf = self._buf[scan.end :]
            self._state = "content"
        elif final:
            self._cut_off(out, call)

    @staticmethod
    def _args_text(raw: str) -> str:
        """The arguments' JSON text as written, or decoded where the model wrote a JSON string."""
        if raw.startswith('"'):
            decoded = json.loads(raw)
            return decoded if isinstance(decoded, str) else raw
        return raw

    def _start(self, out: list[str | ToolCallEvent], call: _Call) -> None:
        assert call.name is not None
        call.started = True
        call.id = call.id or new_call_id(self.format)
        self._started += 1
        out.append(ToolCallEvent(index=call.index, id=call.id, name=call.name))

    def _stream(self, out: list[str | ToolCallEvent], call: _Call, end: int) -> None:
        if self._buf[call.args_start : call.args_start + 1] == '"':
            return  # arguments written as a JSON string: given whole, decoded, when complete
        piece = self._buf[call.args_start + len(call.sent) : end]
        if piece:
            call.sent += piece
            assert call.name is not None
            out.append(ToolCallEvent(index=call.index, id=call.id, name=call.name, arguments=piece))

    def _complete(self, out: list[str | ToolCallEvent], call: _Call, args: str) -> None:
        if not call.started:
            self._start(out, call)
        assert call.name is not None
        rest = args[len(call.sent) :] if args.startswith(call.sent) else ""
        done = ToolCall(id=call.id, name=call.name, arguments=args)
        self.calls.append(done)
        out.append(ToolCallEvent(index=call.index, id=call.id, name=call.name, arguments=rest, call=done))
        self._call = None
        self._closer = call.closer

    def _cut_off(self, out: list[str | ToolCallEvent], call: _Call) -> None:
        """The reply ended inside a call: streamed, so not content, but not a complete call either."""
        if not call.started:
            self._not_a_call(out)
            return
        self._call = None
        self._buf = ""
        self._state = "content"

    def _not_a_call(self, out: list[str | ToolCallEvent]) -> None:
        """What followed a call marker is not a call: the marker's text and the rest are content."""
        call = self._call
        assert call is not None
        self._call = None
        self._state = "content"
        self._at_start = False
        self._release(out, call.marker_text)
        if call.strict and not call.marker_text:  # a reply opening with "{" that is not a call: its "{" is content
            self._release(out, self._buf[:1])
            self._buf = self._buf[1:]

    def _raw_step(self, out: list[str | ToolCallEvent], final: bool) -> None:
        """A call whose name went out but whose JSON broke: its arguments are the text up to the text
        that closes it (`</tool_call>`, ```) or the end of the reply, without the call object's "}"."""
        call = self._call
        assert call is not None and call.name is not None
        hit = _marker(call.closer).search(self._buf) if call.closer and self.format is not MISTRAL_ARGS else None
        if hit is None and not final:
            return
        body = _HIDDEN.sub("", self._buf if hit is None else self._buf[: hit.start()])
        args = body[max(call.args_start, 0) :].rstrip()
        if self.format is MISTRAL and args.endswith("]"):
            args = args[:-1].rstrip()
        if self.format is not MISTRAL_ARGS and args.endswith("}"):
            args = args[:-1].rstrip()
        if not args.startswith(call.sent):
            args = call.sent
        extra = args[len(call.sent) :]
        done = ToolCall(id=call.id, name=call.name, arguments=args)
        self.calls.append(done)
        out.append(ToolCallEvent(index=call.index, id=call.id, name=call.name, arguments=extra, call=done))
        self._call = None
        self._buf = "" if hit is None else self._buf[hit.end() :]
        self._state = "content"

    def _after_step(self, out: list[str | ToolCallEvent], final: bool) -> None:
        """After a call object: what closes it (`</tool_call>`, ```), or Mistral's `,` (another call) or `]`."""
        body = self._buf.lstrip()
        if self.format is HERMES or self.format is LLAMA3:
            closer = self._closer
            hit = _marker(closer).match(body) if closer else None
            if hit is not None:
                self._buf = body[hit.end() :]
            elif closer and closer.startswith(body) and not final:
                return  # may still become the closing text
            self._state = "content"  # (without its closing text the call stands; the rest is content)
        elif self.format is MISTRAL:
            if not body and not final:
                return
            if body[:1] == "," and self.parallel:
                self._buf = body[1:]
                self._begin("")
            else:
                if body[:1] == "]":
                    self._buf = body[1:]
                self._state = "content"
        else:
            self._state = "content"
