"""Tool calls: the model's own call format, parsed into OpenAI-style calls, and enforced by a grammar.

One request with tools goes through three steps, all prepared by `tool_request`:

1. The prompt: the tools are rendered by the model's chat template (`chat_tokens(..., tools=...)`;
   a template without tools support gets edgeinfer's Hermes-style fallback, see engine/chat.py).
   `tool_choice="none"` renders no tools, so the model is not offered any and nothing is parsed.
2. Sampling: `tool_choice="required"` or a named function is a grammar from the first token (a call
   of one of the tools, or of the named one, must come first); `"auto"` a *lazy* grammar that starts
   constraining where the model writes the format's call marker. Either way a call's arguments
   always parse and match the function's JSON schema (engine/grammar.py's compiler; in `auto`, a
   function whose schema that compiler refuses gets any JSON object instead, in `required` the
   request is refused naming the keyword). `parallel_tool_calls=False` makes the grammar stop after
   one call.
3. The output: `ToolCallParser` turns the stream of TokenEvents into content TokenEvents and
   ToolCallEvents (OpenAI's streamed `tool_calls[i].function.arguments` chunks), holding back only
   text that may be the start of a call marker, and ends with a DoneEvent whose `tool_calls` are the
   complete calls, `text` the content and `finish_reason` "tool_calls" when calls were made.

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
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..errors import InvalidOptionError
from .chat import template_supports_tools
from .events import DoneEvent, Event, TokenEvent, ToolCall, ToolCallEvent
from .grammar import Grammar
from .json_schema import json_schema_to_grammar
from .options import GenerateOptions

__all__ = [
    "ToolFormat",
    "FORMATS",
    "ToolSetup",
    "ToolCallParser",
    "ToolGeneration",
    "ToolChoice",
    "detect_format",
    "normalize_tools",
    "normalize_tool_choice",
    "tool_request",
    "new_call_id",
    "MAX_TOOLS",
]

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

ToolChoice = Literal["auto", "none", "required", "function"]


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


# -- requests --------------------------------------------------------------------------------------

def normalize_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """Checked copies of OpenAI-style tools `[{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}]`; InvalidOptionError naming the first problem."""
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidOptionError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    if len(tools) > MAX_TOOLS:
        raise InvalidOptionError(f"at most {MAX_TOOLS} tools, got {len(tools)}")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidOptionError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise InvalidOptionError(f"{where}.function must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidOptionError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        if name in seen:
            raise InvalidOptionError(f"{where}: two tools are named {name!r}")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidOptionError(f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise InvalidOptionError(f"{where}.function.parameters must be a JSON schema object")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidOptionError(f"{where}.function.strict must be a boolean")
        function: dict[str, Any] = {"name": name}
        if description is not None:
            function["description"] = description
        function["parameters"] = params
        out.append({"type": "function", "function": function})
    return tuple(out)


def normalize_tool_choice(choice: Any, tools: Sequence[Mapping[str, Any]]) -> tuple[ToolChoice, str | None]:
    """("auto" | "none" | "required" | "function", the named function or None) from OpenAI's
    `tool_choice`: "auto", "none", "required" or {"type": "function", "function": {"name": ...}}."""
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidOptionError(f"tool_choice must be 'auto', 'none', 'required' or "
                                     f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
        if choice == "required" and not tools:
            raise InvalidOptionError("tool_choice 'required' needs tools")
        return choice, None  # type: ignore[return-value]
    fn = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidOptionError("tool_choice must be 'auto', 'none', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}")
    if fn["name"] not in names:
        raise InvalidOptionError(f"tool_choice names the function {fn['name']!r}, which is not among the tools")
    return "function", fn["name"]


@dataclass(frozen=True)
class ToolSetup:
    """What one request with tools needs (made by `tool_request`): the tools to render, the grammar
    to sample with, and a fresh parser per generation (`parser()`)."""

    format: ToolFormat
    tools: tuple[dict[str, Any], ...]
    choice: ToolChoice
    function: str | None  # the named function of tool_choice {"type": "function", ...}
    parallel: bool
    grammar: Grammar | None
    markers: Mapping[int, str] = field(default_factory=dict)  # control-token id -> its text, for the parser

    @property
    def render_tools(self) -> tuple[dict[str, Any], ...] | None:
        """What `chat_tokens(..., tools=)` gets: None (no tools in the prompt) for tool_choice none."""
        return self.tools if self.tools and self.choice != "none" else None

    def options(self, options: GenerateOptions | None) -> GenerateOptions:
        """`options` with the tool grammar; InvalidOptionError if they already constrain the output."""
        options = options or GenerateOptions()
        if self.grammar is None:
            return options
        if options.grammar is not None or options.json_schema is not None:
            raise InvalidOptionError("a grammar or JSON schema cannot be combined with tools "
                                     "(unless tool_choice is 'none')")
        return replace(options, grammar=self.grammar)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.format, names=[t["function"]["name"] for t in self.tools],
                              markers=self.markers, parallel=self.parallel,
                              enabled=self.render_tools is not None)

    def wrap(self, generation: Any) -> ToolGeneration:
        """`generation` (an Engine's Generation or a BatchGeneration) with its events parsed."""
        return ToolGeneration(generation, self.parser())


def tool_request(
    template: str,
    tools: Any,
    tool_choice: Any = "auto",
    parallel_tool_calls: bool = True,
    *,
    tokenize: Callable[[str, bool], list[int]] | None = None,
) -> ToolSetup:
    """Everything a request with `tools` needs, for a model whose chat template is `template`.
    `tokenize(text, parse_special)` (a ChatVocab's) lets the parser and the grammar know the call
    markers that are control tokens (printed as nothing in TokenEvent.text)."""
    if not isinstance(parallel_tool_calls, bool):
        raise InvalidOptionError("parallel_tool_calls must be true or false")
    checked = normalize_tools(tools)
    choice, function = normalize_tool_choice(tool_choice, checked)
    fmt = detect_format(template)
    if checked and choice != "none" and fmt is None:
        raise InvalidOptionError(
            "this model's chat template renders tools in a call format edgeinfer does not parse (recognized: "
            "Hermes/Qwen <tool_call>, Llama 3.x JSON, Mistral [TOOL_CALLS]); use the built-in 'chatml' "
            "template (engine.chat_template = 'chatml'), which offers tools in the Hermes format")
    fmt = fmt or HERMES
    parallel = parallel_tool_calls and fmt.parallel
    markers: dict[int, str] = {}
    start_token = None  # the start marker as one token of the vocabulary, if it is one
    if tokenize is not None:
        for text in {fmt.start, fmt.end} - {""}:
            ids = tokenize(text, True)
            if len(ids) == 1 and tokenize(text, False) != ids:
                markers[ids[0]] = text
            if len(ids) == 1 and text == fmt.start:
                start_token = ids[0]
    grammar = None
    if checked and choice != "none":
        grammar = _grammar(fmt, checked, choice, function, parallel, start_token)
    return ToolSetup(format=fmt, tools=checked, choice=choice, function=function, parallel=parallel,
                     grammar=grammar, markers=markers)


def new_call_id(fmt: ToolFormat = HERMES) -> str:
    """An id for a call the model made: OpenAI's `call_…`; 9 letters and digits for Mistral's
    templates, which refuse any other id when the call comes back in the conversation. (An id a
    Mistral model writes comes after the arguments, which are streamed before it: ours is used.)"""
    alphabet = string.ascii_letters + string.digits
    if fmt.name.startswith("mistral"):
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


class ToolGeneration:
    """A generation whose events pass through a ToolCallParser: iterate it (or `poll()` a
    BatchGeneration's) for content TokenEvents, ToolCallEvents and the DoneEvent with `tool_calls`;
    `done` and `result()` give that DoneEvent; everything else (cancel, close, stats, options,
    finished, ...) is the wrapped generation's."""

    def __init__(self, generation: Any, parser: ToolCallParser):
        self._gen = generation
        self._parser = parser
        self._queue: deque[Event] = deque()
        self._done: DoneEvent | None = None

    def _parse(self, events: Iterable[Event]) -> list[Event]:
        out = list(self._parser.events(events))
        for e in out:
            if isinstance(e, DoneEvent):
                self._done = e
        return out

    def __iter__(self) -> ToolGeneration:
        return self

    def __next__(self) -> Event:
        while not self._queue:
            self._queue.extend(self._parse([next(self._gen)]))  # StopIteration ends this one too
        return self._queue.popleft()

    def poll(self) -> list[Event]:
        batch = self._gen.poll()
        return self._parse(batch) if batch else batch

    @property
    def done(self) -> DoneEvent | None:
        """The DoneEvent with the calls, once the generation has ended (also when closed early)."""
        if self._done is None and getattr(self._gen, "done", None) is not None:
            self._parse([self._gen.done])  # ended without its DoneEvent being read here
        return self._done

    def result(self) -> DoneEvent:
        """Run to the end; the DoneEvent (content as `text`, the calls as `tool_calls`)."""
        for _ in self:
            pass
        done = self.done
        assert done is not None
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gen, name)


# -- grammar ---------------------------------------------------------------------------------------

_P = "edgeinfer-tool-"  # our rule names; the schema compiler's names never start with it
_GBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|<[^>\s]*>|\{[^}]*\}|#[^\n]*|([A-Za-z0-9-]+)|\s+|.',
                         re.S)


def _prefixed(gbnf: str, prefix: str) -> str:
    """GBNF with every rule name prefixed (names only: literals, classes and counts are kept)."""
    return _GBNF_TOKEN.sub(lambda m: prefix + m.group(1) if m.group(1) else m.group(0), gbnf)


def _gbnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# Whitespace inside a call object (none, a space, or a line break and an indent) and around it,
# as GBNF and as the regex that starts a lazy grammar: the text a trigger matches is handed to the
# grammar, and llama.cpp aborts the process on text its grammar refuses, so the two must agree.
_SP_GBNF = '| " " | "\\n" [ \\t]{0,20}'
_SP_RE = r"(?: |\n[ \t]{0,20})?"
_CALL_START_RE = r"\{" + _SP_RE + '"name"' + _SP_RE + ":"


def _grammar(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], choice: ToolChoice, function: str | None,
             parallel: bool, start_token: int | None) -> Grammar:
    """The grammar of a tool call in `fmt`: from the first token for required and a named function;
    lazy for auto, from the call marker (as a token when it is one, else its text), a ```json block
    or a reply that opens with a call object, each form's text exactly as the grammar starts."""
    rules: list[str] = [f"{_P}sp ::= {_SP_GBNF}", f"{_P}gap ::= [ \\t\\r\\n]{{0,16}}"]
    alternatives = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if choice == "function" and fn["name"] != function:
            continue
        try:
            args = json_schema_to_grammar(fn["parameters"])
        except InvalidOptionError as e:
            if choice == "auto":  # the call still parses as JSON; the schema is not enforced
                args = json_schema_to_grammar({"type": "object", "additionalProperties": True})
            else:
                raise InvalidOptionError(f"tool {fn['name']!r}: {e}") from None
        prefix = f"{_P}{i}-"
        rules.append(_prefixed(args.gbnf, prefix).strip())
        kv = f'{_P}sp ":" {_P}sp'
        if fmt is MISTRAL_ARGS:
            alternatives.append(f'{_gbnf_literal(fmt.start)} {_gbnf_literal(fn["name"])} {_gbnf_literal(fmt.end)} '
                                f'{prefix}root')
            continue
        key = _gbnf_literal(json.dumps(fmt.args_key))
        body = (f'"{{" {_P}sp {_gbnf_literal(json.dumps("name"))} {kv} {_gbnf_literal(json.dumps(fn["name"]))} '
                f'{_P}sp "," {_P}sp {key} {kv} {prefix}root')
        if fmt is MISTRAL:
            body += f' ( {_P}sp "," {_P}sp {_gbnf_literal(json.dumps("id"))} {kv} "\\"" [a-zA-Z0-9]{{9}} "\\"" )?'
        alternatives.append(body + f' {_P}sp "}}"')
    rules.append(f"{_P}call ::= " + " | ".join(f"( {a} )" for a in alternatives))
    lazy = choice == "auto"
    patterns: list[str] = []
    if fmt is HERMES:
        one = f'"<tool_call>" {_P}gap {_P}call {_P}gap "</tool_call>"'
        root = f"{one} ( {_P}gap {one} )*" if parallel else one
        if lazy:  # the forms Qwen2.5-Coder also writes: a ```json block, or the call object alone
            root += f' | "```" ( "json" | "JSON" )? {_P}sp {_P}call {_P}sp "```" | {_P}call'
            patterns += ["(```(?:json|JSON)?" + _SP_RE + _CALL_START_RE + ")",
                         r"^[ \t\r\n]*(" + _CALL_START_RE + r")[\s\S]*$"]
    elif fmt is LLAMA3:
        root = f'"<|python_tag|>"? {_P}call'
        if lazy:
            patterns.append(r"^[ \t\r\n]*(" + _CALL_START_RE + r")[\s\S]*$")
    elif fmt is MISTRAL:
        root = (f'"[TOOL_CALLS]" {_P}sp "[" {_P}call ( "," {_P}sp {_P}call )* "]"' if parallel
                else f'"[TOOL_CALLS]" {_P}sp "[" {_P}call "]"')
    else:  # mistral-args: every call has its own [TOOL_CALLS]
        root = f"{_P}call+" if parallel else f"{_P}call"
    rules.append(f"{_P}root ::= {root}")
    gbnf = "\n".join(rules) + "\n"
    if not lazy:
        return Grammar(gbnf, root=f"{_P}root").validate()
    # the marker as a token: the grammar is handed exactly its text. As text (a vocabulary without
    # such a token), the token that completes it may carry more: the gap after it allows whitespace.
    tokens = (start_token,) if start_token is not None else ()
    if start_token is None:
        patterns.insert(0, re.escape(fmt.start))
    return Grammar(gbnf, root=f"{_P}root", trigger_patterns=tuple(patterns), trigger_tokens=tokens).validate()


# -- parsing ---------------------------------------------------------------------------------------

class _Scan:
    """An incremental JSON scanner: fed a growing text, it finds where the first JSON value ends
    (`done`, `end`), refuses what is not JSON (`error`), and records the spans of the members of a
    top-level object (`members`: key -> (start, end); `key`/`value_start` for the member in
    progress). Each character is looked at once."""

    _WS = " \t\n\r"

    def __init__(self) -> None:
        self.pos = 0
        self.stack: list[str] = []
        self.expect = "value"  # value | key | first-key | colon | next | first-value
        self.scalar = ""  # "str" | "key" | "num" | "lit" while one is being read
        self.scalar_start = -1
        self.esc = False
        self.hex = 0
        self.members: dict[str, tuple[int, int]] = {}
        self.key: str | None = None
        self.value_start = -1
        self.done = False
        self.end = -1
        self.error = ""

    def feed(self, text: str, final: bool = False) -> None:
        while self.pos < len(text) and not self.done and not self.error:
            c = text[self.pos]
            if self.scalar in ("str", "key"):
                self._string_char(text, c)
                continue
            if self.scalar:  # a number or a literal: runs until a character that cannot continue it
                if (c.isalnum() or c in "+-.") and self.pos - self.scalar_start < 64:
                    self.pos += 1
                    continue
                if not self._end_scalar(text, self.pos):
                    return
                continue
            self._structure(text, c)
        if final and self.scalar in ("num", "lit") and not self.error:
            self._end_scalar(text, self.pos)

    def _string_char(self, text: str, c: str) -> None:
        self.pos += 1
        if self.hex:
            if c not in string.hexdigits:
                self.error = "bad \\u escape"
            self.hex -= 1
        elif self.esc:
            self.esc = False
            if c == "u":
                self.hex = 4
            elif c not in '"\\/bfnrt':
                self.error = f"bad escape \\{c}"
        elif c == "\\":
            self.esc = True
        elif c == '"':
            kind, self.scalar = self.scalar, ""
            if kind == "key":
                key = json.loads(text[self.scalar_start : self.pos])
                if len(self.stack) == 1:
                    self.key = key
                self.expect = "colon"
            else:
                self._value_end(self.pos)
        elif ord(c) < 0x20:
            self.error = "a control character in a string"

    def _end_scalar(self, text: str, end: int) -> bool:
        raw = text[self.scalar_start : end]
        self.scalar = ""
        try:
            json.loads(raw)
        except ValueError:
            self.error = f"{raw!r} is not a JSON value"
            return False
        self._value_end(end)
        return True

    def _structure(self, text: str, c: str) -> None:
        if c in self._WS:
            self.pos += 1
            return
        expect = self.expect
        if expect in ("value", "first-value"):
            if expect == "first-value" and c == "]":
                self._close("[")
                return
            if len(self.stack) == 1 and self.stack[0] == "{":
                self.value_start = self.pos
            if c in "{[":
                self.stack.append(c)
                self.expect = "first-key" if c == "{" else "first-value"
                self.pos += 1
            elif c == '"':
                self.scalar, self.scalar_start = "str", self.pos
                self.pos += 1
            elif c in "-0123456789tfn":
                self.scalar, self.scalar_start = ("num" if c not in "tfn" else "lit"), self.pos
                self.pos += 1
            else:
                self.error = f"unexpected {c!r}"
        elif expect in ("key", "first-key"):
            if c == '"':
                self.scalar, self.scalar_start = "key", self.pos
                self.pos += 1
            elif c == "}" and expect == "first-key":
                self._close("{")
            else:
                self.error = f"unexpected {c!r} where a key belongs"
        elif expect == "colon":
            if c == ":":
                self.expect = "value"
                self.pos += 1
            else:
                self.error = f"unexpected {c!r} where ':' belongs"
        else:  # next: "," or the container's end
            top = self.stack[-1]
            if c == ",":
                self.expect = "key" if top == "{" else "value"
                self.pos += 1
            elif (c == "}" and top == "{") or (c == "]" and top == "["):
                self._close(top)
            else:
                self.error = f"unexpected {c!r} where ',' belongs"

    def _close(self, kind: str) -> None:
        self.stack.pop()
        self.pos += 1
        self._value_end(self.pos)

    def _value_end(self, end: int) -> None:
        if not self.stack:
            self.done, self.end = True, end
            return
        self.expect = "next"
        if len(self.stack) == 1 and self.stack[0] == "{" and self.value_start >= 0 and self.key is not None:
            self.members[self.key] = (self.value_start, end)
            self.value_start = -1


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
        self.scan = _Scan()
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
                if not isinstance(name, str) or not _NAME.fullmatch(name) or (bare and name not in self.names):
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
        if not _NAME.fullmatch(head.strip() or "x") or len(head) > 80 or (final and hit is None):
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
