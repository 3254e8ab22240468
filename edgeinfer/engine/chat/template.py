"""Chat prompts rendered with the model's own template (in a sandbox with limits).

The sandbox and its limits: engine/chat/sandbox.py.

Tools (`tools=`, OpenAI's `[{"type": "function", "function": {...}}]`) reach the template as its
`tools` variable, as Hugging Face's `apply_chat_template(tools=...)` passes them; assistant messages
may carry `tool_calls` (their JSON `arguments` are given to the template as objects, as HF templates
expect) and `role: "tool"` messages the results. A template that never mentions `tools` gets
edgeinfer's documented fallback instead of an error (`template_supports_tools`): the Hermes-style
block Qwen2.5 uses (`# Tools ... <tools>...</tools> ... <tool_call>`) is added to the system message
(or, where the template refuses a system role, to the first user message), earlier calls are written
into the assistant's text as `<tool_call>{...}</tool_call>` and results become user turns wrapped in
`<tool_response>`, so any chat model can be offered tools and is parsed as the Hermes format.

Special tokens: `chat_tokens` tokenizes the template's own markup with special tokens parsed, and
the text of messages and tools without: a user who writes `<|im_start|>system` gets those characters,
not a role marker. Every user-supplied string in which the tokenizer would find a control token is
located with the tokenizer itself; those spans are wrapped in two private-use marker characters
before rendering (they survive `trim`, `upper`, `tojson`), and the rendered prompt is tokenized piece
by piece: marked spans with `parse_special=False`, the rest with `parse_special=True`. Strings
without such text are rendered unchanged, so a benign conversation tokenizes exactly as the plain
path (render, then tokenize with special tokens parsed). Limits: a template that changes the case of
a content (`lower`) could still form a special token from a differently-cased spelling; on
tokenizers that add a space prefix (SentencePiece, Llama 2) the pieces around a neutralised span each
get one.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from ...errors import ChatTemplateError, InvalidOptionError
from .sandbox import TemplateLimits, render_template, template_environment, tojson as _tojson

__all__ = ["render_chat", "chat_tokens", "ChatVocab", "CHATML_TEMPLATE", "Message", "TemplateLimits",
           "BUILTIN_TEMPLATES", "template_supports_tools", "normalize_messages", "FALLBACK_TOOLS_HEADER"]

Message = Mapping[str, Any]

# Used when a model ships no template (base models), or when the caller asks for it
# (`template="chatml"`): the common default of llama.cpp.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE}


# -- messages and tools ------------------------------------------------------------------------

def normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Checked copies of chat messages, as templates get them: `content` a string (None only beside
    `tool_calls`, then ""), `tool_calls` in OpenAI's shape with `arguments` decoded from JSON,
    `tool_call_id`/`name` strings. InvalidOptionError (one line) for anything else."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
            raise InvalidOptionError("each chat message needs a 'role' and a 'content'")
        content = m.get("content")
        if not isinstance(m["role"], str) or not (isinstance(content, str) or (content is None and m.get("tool_calls"))):
            raise InvalidOptionError("a chat message's 'role' and 'content' must be strings "
                                     "(content may be null beside 'tool_calls')")
        msg = dict(m)
        msg["content"] = content or ""
        calls = msg.pop("tool_calls", None)
        if calls is not None:
            if m["role"] != "assistant":
                raise InvalidOptionError(f"messages[{i}]: only assistant messages carry 'tool_calls'")
            if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
                raise InvalidOptionError(f"messages[{i}].tool_calls must be a list")
            if calls:  # an empty list is no calls (Llama 3's template tests `'tool_calls' in message`)
                msg["tool_calls"] = [_normalize_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        for key in ("tool_call_id", "name"):
            if key in msg and msg[key] is None:
                del msg[key]
            elif key in msg and not isinstance(msg[key], str):
                raise InvalidOptionError(f"messages[{i}].{key} must be a string")
        out.append(msg)
    return out


def _normalize_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidOptionError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                                 "'arguments': '<JSON>'}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            raise InvalidOptionError(f"{where}.function.arguments is not valid JSON") from None
    elif not isinstance(args, Mapping):
        raise InvalidOptionError(f"{where}.function.arguments must be a JSON string or an object")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise InvalidOptionError(f"{where}.id must be a string")
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call_id is not None:
        out["id"] = call_id
    return out


def _tool_list(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as the template gets them (edgeinfer.engine.chat.tools.normalize_tools checks their
    content; here only the shape a template can iterate)."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidOptionError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    if any(not isinstance(t, Mapping) for t in tools):
        raise InvalidOptionError("each tool must be an object {'type': 'function', 'function': {...}}")
    return [dict(t) for t in tools] or None


@functools.lru_cache(maxsize=8)
def _variables(source: str) -> frozenset[str]:
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(template_environment().parse(source)))
    except Exception:  # noqa: BLE001 - a template that does not parse fails at render, in one line
        return frozenset()


def template_supports_tools(template: str) -> bool:
    """Whether a chat template renders tools itself (it reads a `tools` variable); otherwise
    edgeinfer's Hermes-style fallback is used (see the module)."""
    return "tools" in _variables(BUILTIN_TEMPLATES.get(template, template))


FALLBACK_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_FALLBACK_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>"
)


def _fallback_block(tools: Sequence[Mapping[str, Any]]) -> str:
    return FALLBACK_TOOLS_HEADER + "".join("\n" + _tojson(t) for t in tools) + _FALLBACK_TOOLS_FOOTER


def _fallback_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls written into the assistant's text, tool results as user turns (merged with the
    user turns around them, for templates that insist on alternating roles)."""
    out: list[dict[str, Any]] = []
    merged: list[bool] = []  # out[i] is a user turn that holds tool results
    for m in messages:
        if m["role"] == "tool":
            text = "<tool_response>\n" + m["content"] + "\n</tool_response>"
            if out and out[-1]["role"] == "user":
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
                merged[-1] = True
            else:
                out.append({"role": "user", "content": text})
                merged.append(True)
            continue
        if m["role"] == "user" and out and out[-1]["role"] == "user" and merged[-1]:
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
            continue
        calls = m.get("tool_calls")
        if calls:
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            text = "".join("\n<tool_call>\n" + _tojson({"name": c["function"]["name"],
                                                         "arguments": c["function"]["arguments"]}) + "\n</tool_call>"
                           for c in calls)
            m["content"] = (m["content"] + text) if m["content"] else text.lstrip("\n")
        out.append(m)
        merged.append(False)
    return out


def _render_messages(source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     bos_token: str, eos_token: str, name: str, limits: TemplateLimits | None) -> str:
    limits = (limits or TemplateLimits()).validate()
    if template_supports_tools(source):
        variables = {"messages": messages, "add_generation_prompt": True, "bos_token": bos_token,
                     "eos_token": eos_token}
        if tools is not None:
            variables["tools"] = tools
        return render_template(source, variables, name, limits)
    history = _fallback_history(messages)
    if not tools:
        return render_template(source, {"messages": history, "add_generation_prompt": True, "bos_token": bos_token,
                                        "eos_token": eos_token}, name, limits)
    block = _fallback_block(tools)
    if history and history[0]["role"] == "system":
        in_system = [{**history[0], "content": history[0]["content"] + "\n\n" + block}, *history[1:]]
    else:
        in_system = [{"role": "system", "content": block}, *history]
    first_user = next((i for i, m in enumerate(history) if m["role"] == "user"), None)
    try:
        return render_template(source, {"messages": in_system, "add_generation_prompt": True,
                                        "bos_token": bos_token, "eos_token": eos_token}, name, limits)
    except ChatTemplateError:
        if first_user is None or (history and history[0]["role"] == "system"):
            raise
        # the template refuses a system role (Gemma): the tools go before the first user turn
        in_user = list(history)
        in_user[first_user] = {**history[first_user], "content": block + "\n\n" + history[first_user]["content"]}
        return render_template(source, {"messages": in_user, "add_generation_prompt": True,
                                        "bos_token": bos_token, "eos_token": eos_token}, name, limits)


def render_chat(
    template: str,
    messages: Sequence[Message],
    bos_token: str,
    eos_token: str,
    *,
    name: str = "this model",
    limits: TemplateLimits | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Render `messages` (and `tools`, see the module) with a chat template; ChatTemplateError (one
    line) on any failure. `template` is the template text or the name of a built-in one ("chatml")."""
    msgs = normalize_messages(messages)
    tool_list = _tool_list(tools)
    (limits or TemplateLimits()).validate()
    return _render_messages(BUILTIN_TEMPLATES.get(template, template), msgs, tool_list, bos_token, eos_token,
                            name, limits)


@dataclass(frozen=True)
class ChatVocab:
    """What rendering and tokenizing a chat needs of a model's vocabulary."""

    bos_text: str
    eos_text: str
    bos_id: int
    add_bos: bool
    tokenize: Callable[[str, bool], list[int]]  # (text, parse_special) -> ids, no BOS added


def chat_tokens(template: str, messages: Sequence[Message], vocab: ChatVocab, *, name: str = "this model",
                limits: TemplateLimits | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The prompt tokens of a conversation rendered with `template` (BOS added when the model
    wants one and the template did not write it). The template's markup is tokenized with special
    tokens parsed, the text of messages and tools without (see the module)."""
    try:
        return _chat_tokens(template, messages, vocab, name, limits, tools)
    except UnicodeEncodeError as e:  # a lone surrogate: valid in a Python str, not in UTF-8
        raise InvalidOptionError(f"chat text is not valid Unicode: {e.reason} (U+{ord(e.object[e.start]):04X})") from None


def _chat_tokens(template: str, messages: Sequence[Message], vocab: ChatVocab, name: str,
                 limits: TemplateLimits | None, tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
    msgs = normalize_messages(messages)
    tool_list = _tool_list(tools)
    source = BUILTIN_TEMPLATES.get(template, template)
    guard = _SpecialGuard(vocab.tokenize, markup=(source, vocab.bos_text, vocab.eos_text),
                          user=[*_strings(msgs), *_strings(tool_list)])
    msgs = guard.protect(msgs)
    tool_list = guard.protect(tool_list)
    rendered = _render_messages(source, msgs, tool_list, vocab.bos_text, vocab.eos_text, name, limits)
    add_bos = vocab.add_bos and vocab.bos_id >= 0 and not (vocab.bos_text and rendered.startswith(vocab.bos_text))
    return ([vocab.bos_id] if add_bos else []) + guard.tokenize(rendered)


# -- special tokens in user text -----------------------------------------------------------------

_PRIVATE_USE = re.compile("[\ue000-\uf8ff\U000f0000-\U000ffffd]")
_SEARCH_WINDOW = 256  # the longest special-token text looked for
_SCAN_WINDOW = 4096  # user text is searched for special text in windows of this many characters


def _strings(value: Any) -> Iterator[str]:
    """Every string in nested lists and dicts (keys included)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def _narrow(lo: int, hi: int, turned: Callable[[int], bool]) -> tuple[int, int]:
    """Bisection: `turned` is False at lo and True at hi; the two neighbours where it turns."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if turned(mid):
            hi = mid
        else:
            lo = mid
    return lo, hi


class _SpecialGuard:
    """Finds the spans of user strings that the tokenizer would read as control tokens, wraps them
    in two marker characters that appear nowhere else, and tokenizes a rendered prompt piece by
    piece: marked spans as plain text, the rest with special tokens parsed."""

    def __init__(self, tokenize: Callable[[str, bool], list[int]], *, markup: Sequence[str], user: Sequence[str]):
        self._tokenize = tokenize
        self._cache: dict[str, str] = {}
        self.used = False
        user = [t for t in user if t]
        # one check of all user text first: a conversation without special text costs two tokenizations
        joined = "\n".join(dict.fromkeys(user))
        self._active = bool(user) and self._find(joined, 0, len(joined)) is not None
        if self._active:
            taken: set[str] = set()
            for t in (*markup, *user):
                taken.update(_PRIVATE_USE.findall(t))
            free = (chr(c) for c in (*range(0xE000, 0xF900), *range(0xF0000, 0xFFFFE)) if chr(c) not in taken)
            try:
                self.open, self.close = next(free), next(free)
            except StopIteration:
                raise InvalidOptionError("the messages use every private-use character; "
                                         "cannot tell their text from the template's") from None

    def _differs(self, text: str) -> bool:
        return self._tokenize(text, True) != self._tokenize(text, False)

    def protect(self, value: Any) -> Any:
        if not self._active:
            return value
        if isinstance(value, str):
            return self._protect(value)
        if isinstance(value, Mapping):
            return {self.protect(k): self.protect(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.protect(v) for v in value]
        return value

    def _protect(self, s: str) -> str:
        done = self._cache.get(s)
        if done is not None:
            return done
        spans: list[tuple[int, int]] = []
        if s:
            known: list[str] = []
            pattern: re.Pattern[str] | None = None
            pos = 0
            while pos < len(s):
                hit = pattern.search(s, pos) if pattern is not None else None
                found = self._find(s, pos, hit.start() if hit else len(s))
                if found is None and hit is None:
                    break
                if found is None:  # a special text seen before, with nothing special before it
                    assert hit is not None
                    found = hit.span()
                else:
                    known.append(s[found[0] : found[1]])
                    pattern = re.compile("|".join(map(re.escape, sorted(set(known), key=len, reverse=True))))
                spans.append(found)
                pos = found[1]
            if not spans and self._differs(s):  # a special text longer than the window: all plain text
                spans.append((0, len(s)))
        if spans:
            self.used = True
            parts, last = [], 0
            for b, e in spans:
                parts += [s[last:b], self.open, s[b:e], self.close]
                last = e
            parts.append(s[last:])
            out = "".join(parts)
        else:
            out = s
        self._cache[s] = out
        return out

    def _find(self, s: str, lo: int, hi: int) -> tuple[int, int] | None:
        """The first span of s[lo:hi] that the tokenizer reads as a special token: windows of the
        text overlapping by the longest special text looked for, then a bisection in the window."""
        a = lo
        while True:
            end = min(hi, a + _SCAN_WINDOW)
            if end - a > 0 and self._differs(s[a:end]):
                break
            if end >= hi:
                return None
            a = end - _SEARCH_WINDOW
        # the smallest end e with s[a:e] special, then the largest start b with s[b:e] special
        _, e = _narrow(a, end, lambda m: self._differs(s[a:m]))
        b, _ = _narrow(a, e, lambda m: not self._differs(s[m:e]))
        return b, e

    def tokenize(self, rendered: str) -> list[int]:
        if not self.used:
            return self._tokenize(rendered, True)
        ids: list[int] = []
        for piece, special in self._segments(rendered):
            if piece:
                ids += self._tokenize(piece, special)
        return ids

    def _segments(self, text: str) -> Iterator[tuple[str, bool]]:
        """(piece, parse_special) in order; a marked span whose close marker the template dropped
        runs to the next open marker or the end."""
        o, c = self.open, self.close
        pos = 0
        while True:
            i = text.find(o, pos)
            if i < 0:
                yield text[pos:].replace(c, ""), True
                return
            yield text[pos:i].replace(c, ""), True
            j, k = text.find(c, i + 1), text.find(o, i + 1)
            if j < 0 or 0 <= k < j:
                end = k if k >= 0 else len(text)
                yield text[i + 1 : end], False
                pos = end
            else:
                yield text[i + 1 : j], False
                pos = j + 1
