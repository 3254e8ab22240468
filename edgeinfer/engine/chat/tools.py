"""
One request with tools goes through three steps, all prepared by `tool_request`:

1. The prompt: the tools are rendered by the model's chat template (`chat_tokens(..., tools=...)`;
   a template without tools support gets edgeinfer's Hermes-style fallback, see engine/chat/template.py).
   `tool_choice="none"` renders no tools, so the model is not offered any and nothing is parsed.
2. Sampling: `tool_choice="required"` or a named function is a grammar from the first token (a call
   of one of the tools, or of the named one, must come first); `"auto"` a *lazy* grammar that starts
   constraining where the model writes the format's call marker. Either way a call's arguments
   always parse and match the function's JSON schema (engine/structured/grammar.py's compiler; in `auto`, a
   function whose schema that compiler refuses gets any JSON object instead, in `required` the
   request is refused naming the keyword). `parallel_tool_calls=False` makes the grammar stop after
   one call.
3. The output: `ToolCallParser` turns the stream of TokenEvents into content TokenEvents and
   ToolCallEvents (OpenAI's streamed `tool_calls[i].function.arguments` chunks), holding back only
   text that may be the start of a call marker, and ends with a DoneEvent whose `tool_calls` are the
   complete calls, `text` the content and `finish_reason` "tool_calls" when calls were made. The
   parser is a layer of the request's Generation (engine/faces/generation.py), on either face;
   `chat(..., tools=...)` (engine/faces/common.py) runs the three steps, for the server too.

The call formats and their parser: engine/chat/tool_parser.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ...errors import InvalidOptionError
from ..structured.grammar import Grammar
from ..structured.json_schema import json_schema_to_grammar
from ..core.options import GenerateOptions
from .tool_parser import (
    FORMATS,
    HERMES,
    LLAMA3,
    MISTRAL,
    MISTRAL_ARGS,
    NAME,
    ToolCallParser,
    ToolFormat,
    detect_format,
    new_call_id,
)

__all__ = [
    "ToolFormat",
    "FORMATS",
    "ToolSetup",
    "ToolCallParser",
    "ToolChoice",
    "detect_format",
    "normalize_tools",
    "normalize_tool_choice",
    "tool_request",
    "new_call_id",
    "MAX_TOOLS",
]

MAX_TOOLS = 128  # OpenAI's limit


ToolChoice = Literal["auto", "none", "required", "function"]


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
        if not isinstance(name, str) or not NAME.fullmatch(name):
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
        return Grammar(gbnf, root=f"{_P}root", native=True).validate()
    # the marker as a token: the grammar is handed exactly its text. As text (a vocabulary without
    # such a token), the token that completes it may carry more: the gap after it allows whitespace.
    tokens = (start_token,) if start_token is not None else ()
    if start_token is None:
        patterns.insert(0, re.escape(fmt.start))
    return Grammar(gbnf, root=f"{_P}root", trigger_patterns=tuple(patterns), trigger_tokens=tokens,
                   native=True).validate()
