"""Grammar-constrained sampling: a `Grammar` is GBNF text or a JSON schema.

Two engines enforce them. A user's grammar or JSON schema (`Grammar(gbnf)`, `Grammar.from_json_schema`)
runs on llguidance (llg.py: bounded, fast masks, forced tokens). The tool-call grammars that
engine/chat/tools.py builds (`native=True`, and every lazy grammar) run on llama.cpp's own grammar
sampler, as described below.

A native `Grammar` is GBNF text (llama.cpp's grammar format) with its start rule, optionally *lazy*: it
constrains nothing until the output matches one of `trigger_patterns` (regular expressions, matched
against all the output so far; the grammar is fed the output from the pattern's first capture group
on) or a `trigger_tokens` token is sampled (fed from that token on) — how a tool call is forced once
it starts. `json_schema.json_schema_to_grammar` compiles a JSON schema into a Grammar.

The sampler (engine/core/sampler.py) applies the grammar first, before penalties and the top-k →
top-p → min-p → temperature chain, as llama.cpp orders it: every token the grammar forbids gets
probability 0, and every other transform sees only what the grammar allows.

Why this is lossless with speculation. The grammar's state is advanced only by committed tokens:
sample-and-match verification samples row i of a verified draft with the chain, from the state
after the tokens committed before it, and every token it samples is committed (a kept draft token
or the token that replaces the first rejected one); the rejection rule of speculative sampling
draws from the *constrained* distribution p (`Sampler.distribution`, the grammar's mask applied)
and accepts each token it keeps before computing the next row's p. So the state never needs a
rollback, and a drafted token the grammar forbids has p = 0 and is never kept. A draft model
drafts with a fork of the request's sampler (`Sampler.fork`: a copy of the grammar state that
follows its own drafted tokens and is then thrown away), so its q is constrained too.

llama.cpp reports a GBNF syntax error on stderr (not through its log) and aborts the process on an
invalid trigger regex or on accepting a token the grammar forbids: this module checks both before
llama.cpp sees them, and captures the parser's message for a one-line error.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidOptionError
from ...llama_backend import backend, log_capture
from .bounds import load_schema
from .llg import llguidance_grammar

__all__ = ["Grammar", "check_gbnf", "MAX_GBNF_BYTES"]

MAX_GBNF_BYTES = 512 << 10  # a grammar larger than this is refused (llama.cpp parses it per request)

_MAX_TRIGGERS = 64


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar and its start rule; lazy when triggers are given (see the module docstring).

    `trigger_patterns` are ECMAScript regular expressions (llama.cpp's std::regex): matched against
    the whole output so far when the pattern is `^…$`, searched in it otherwise; the grammar
    constrains from the first non-empty capture group on (from the match's start if none)."""

    gbnf: str
    root: str = "root"
    trigger_patterns: tuple[str, ...] = ()
    trigger_tokens: tuple[int, ...] = ()
    # llama.cpp's grammar sampler enforces it (tool-call grammars), not llguidance.
    native: bool = False
    # A JSON schema (canonical JSON text) that llguidance enforces; `gbnf` is then empty.
    json_schema: str | None = None

    @classmethod
    def from_json_schema(cls, schema: Any) -> Grammar:
        """The grammar of the JSON texts that validate against `schema` (a mapping or JSON text),
        enforced by llguidance (see `validate` for what is refused)."""
        loaded, _text = load_schema(schema)
        return cls("", json_schema=json.dumps(loaded, ensure_ascii=False, sort_keys=False))

    @property
    def lazy(self) -> bool:
        return bool(self.trigger_patterns or self.trigger_tokens)

    @property
    def on_llguidance(self) -> bool:
        """Whether llguidance enforces it (a user's grammar or schema) rather than llama.cpp."""
        return not self.native and not self.lazy

    def validate(self) -> Grammar:
        """Refuse wrong types, sizes, trigger regexes llama.cpp cannot compile, and grammars that do
        not compile: on llguidance, bounded first (bounds.py: size, nesting, rules, alternatives,
        repetitions, no token references) and then checked by its compiler, which names the
        schema keywords it cannot enforce; native GBNF by llama.cpp's parser (without a
        vocabulary: token references `<…>` are checked at load)."""
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str) or self.lazy or self.native:
                raise InvalidOptionError("a JSON-schema grammar is JSON text, neither lazy nor native")
            llguidance_grammar(self)
            return self
        if not isinstance(self.gbnf, str):
            raise InvalidOptionError(f"grammar must be GBNF text (a str), got {type(self.gbnf).__name__}")
        if not isinstance(self.root, str) or not re.fullmatch(r"[A-Za-z0-9-]+", self.root):
            raise InvalidOptionError(f"grammar root must be a rule name ([A-Za-z0-9-]+), got {self.root!r}")
        for name, value, kind in (("trigger_patterns", self.trigger_patterns, str),
                                  ("trigger_tokens", self.trigger_tokens, int)):
            if not isinstance(value, tuple) or any(not isinstance(v, kind) or isinstance(v, bool) for v in value):
                raise InvalidOptionError(f"grammar {name} must be a tuple of {kind.__name__}, got {value!r}")
            if len(value) > _MAX_TRIGGERS:
                raise InvalidOptionError(f"grammar has {len(value)} {name}: at most {_MAX_TRIGGERS}")
        for pattern in self.trigger_patterns:
            _check_trigger_pattern(pattern)
        for t in self.trigger_tokens:
            if not 0 <= t < 2**31:
                raise InvalidOptionError(f"grammar trigger token {t} is not a token id")
        if self.on_llguidance:
            if not self.gbnf.strip():
                raise InvalidOptionError("grammar is empty")
            if "\x00" in self.gbnf:
                raise InvalidOptionError("grammar contains a NUL character")
            llguidance_grammar(self)
            if self.root not in _productive_rules(self.gbnf):
                raise InvalidOptionError(f"invalid grammar: rule '{self.root}' matches no finite text "
                                         "(each of its alternatives recurses without end)")
            return self
        check_gbnf(self.gbnf, self.root)
        return self


# -- llama.cpp's parser, checked ---------------------------------------------------------------------

_stderr_lock = threading.Lock()


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """Capture what C code writes to file descriptor 2 while the block runs (llama.cpp's GBNF parser
    prints its error there). Text that is not the parser's (another thread's) is written back."""
    out: list[str] = []
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            try:
                yield out
            finally:
                os.dup2(saved, 2)
        finally:
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode("utf-8", errors="replace")
    ours = re.search(r"[^\n]*error parsing grammar: ", text)
    if ours is not None:
        out.append(text[ours.end():].split("\n", 1)[0].strip())
        text = text[: ours.start()]
    if text:
        os.write(2, text.encode())


def _new_sampler(grammar: Grammar, vocab: Any, capture: bool = False) -> Any:
    """llama.cpp's grammar sampler for `grammar` on `vocab` (None: a parse check only), or an
    InvalidOptionError with the parser's message. The parser prints its message on stderr: with
    `capture` (or on a second attempt after a failure) file descriptor 2 is redirected for the call;
    check_gbnf captures, a sampler for an already checked grammar does not."""
    ll = backend()
    errors: list[str] = []
    gbnf, root = grammar.gbnf.encode(), grammar.root.encode()
    stderr = _captured_stderr() if capture else contextlib.nullcontext([])
    with log_capture(lambda level, text: errors.append(text) if level == 4 else None), stderr as parse:
        if grammar.lazy:
            patterns = (ctypes.c_char_p * max(1, len(grammar.trigger_patterns)))(
                *[p.encode() for p in grammar.trigger_patterns])
            tokens = (ll.llama_token * max(1, len(grammar.trigger_tokens)))(*grammar.trigger_tokens)
            smpl = ll.llama_sampler_init_grammar_lazy_patterns(
                vocab, gbnf, root, patterns, len(grammar.trigger_patterns), tokens, len(grammar.trigger_tokens))
        else:
            smpl = ll.llama_sampler_init_grammar(vocab, gbnf, root)
    if not smpl:
        if not capture:
            return _new_sampler(grammar, vocab, capture=True)
        why = parse[0] if parse else next((e.strip() for e in errors if e.strip() and "failed to parse" not in e), "")
        raise InvalidOptionError(f"invalid grammar: {why or 'llama.cpp could not parse it'}")
    return smpl


def check_gbnf(gbnf: str, root: str = "root") -> None:
    """Raise InvalidOptionError (one line, llama.cpp's parser message) unless `gbnf` parses and has
    the rule `root`. Token references (`<[123]>`, `<|tag|>`) need a vocabulary: they are checked
    when a model's sampler is made."""
    if not isinstance(gbnf, str):
        raise InvalidOptionError(f"grammar must be GBNF text (a str), got {type(gbnf).__name__}")
    size = len(gbnf.encode("utf-8", errors="replace"))
    if size > MAX_GBNF_BYTES:
        raise InvalidOptionError(f"grammar is too large: {size} bytes (at most {MAX_GBNF_BYTES})")
    if not gbnf.strip():
        raise InvalidOptionError("grammar is empty")
    if "\x00" in gbnf:
        raise InvalidOptionError("grammar contains a NUL character")
    key = (hashlib.blake2b(gbnf.encode("utf-8", errors="surrogatepass"), digest_size=16).digest(), root)
    if key in _checked:
        _checked.move_to_end(key)
        return
    try:
        smpl = _new_sampler(Grammar(gbnf, root), None, capture=True)
    except InvalidOptionError as e:
        if "no vocab to parse token" not in str(e):
            raise
        # token references: checked against the model's vocabulary when its sampler is made
    else:
        backend().llama_sampler_free(smpl)
    if root not in _productive_rules(gbnf):
        raise InvalidOptionError(f"invalid grammar: rule '{root}' matches no finite text "
                                 "(each of its alternatives recurses without end)")
    _checked[key] = None
    while len(_checked) > 256:
        _checked.popitem(last=False)


# Grammars that passed check_gbnf (a request that sends the same schema again is not parsed twice).
_checked: OrderedDict[tuple[bytes, str], None] = OrderedDict()


# A GBNF lexer just good enough for the productivity check (llama.cpp has parsed the text already).
_GBNF_TOKEN = re.compile(r"""
    (?P<skip>[ \t\r\n]+|\#[^\n]*)
  | (?P<lit>"(?:\\.|[^"\\])*")
  | (?P<cls>\[(?:\\.|[^\]\\])*\])
  | (?P<tok>!?<(?:\[[0-9]+\]|[^>]*)>)
  | (?P<def>::=)
  | (?P<name>[A-Za-z0-9-]+)
  | (?P<rep>[*+?]|\{[ \t]*[0-9]+[^}]*\})
  | (?P<op>[()|.])
""", re.VERBOSE | re.DOTALL)


def _productive_rules(gbnf: str) -> set[str]:
    """The rules that derive at least one finite text: a rule like `root ::= "a" root` has none
    (llama.cpp accepts it and then never lets the output end)."""
    toks = [(m.lastgroup, m.group()) for m in _GBNF_TOKEN.finditer(gbnf) if m.lastgroup != "skip"]
    # Split into rules at each `name ::=`.
    rules: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    i = 0
    while i < len(toks):
        if toks[i][0] == "name" and i + 1 < len(toks) and toks[i + 1][0] == "def":
            current = rules[toks[i][1]] = []  # a rule defined again replaces the first (as in llama.cpp)
            i += 2
            continue
        if current is not None:
            current.append(toks[i])
        i += 1

    def finite(body: list[tuple[str, str]], known: set[str]) -> bool:
        """Whether some alternative of `body` is a sequence of items that each can derive a finite text."""
        pos = 0

        def alternatives() -> bool:
            nonlocal pos
            ok = sequence()
            while pos < len(body) and body[pos] == ("op", "|"):
                pos += 1
                ok = sequence() or ok
            return ok

        def sequence() -> bool:
            nonlocal pos
            ok = True
            while pos < len(body) and body[pos] not in (("op", "|"), ("op", ")")):
                kind, text = body[pos]
                pos += 1
                if kind == "op" and text == "(":
                    item = alternatives()
                    pos += 1  # ")"
                else:
                    item = kind != "name" or text in known
                optional = False
                while pos < len(body) and body[pos][0] == "rep":
                    rep = body[pos][1]
                    optional = optional or rep in ("*", "?") or re.match(r"\{[ \t]*0[ \t]*[,}]", rep) is not None
                    pos += 1
                ok = ok and (item or optional)
            return ok

        return alternatives()

    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in productive and finite(body, productive):
                productive.add(name)
                changed = True
    return productive


# std::regex (ECMAScript) compiles neither lookbehind, named groups nor inline flags, and llama.cpp
# would abort the process on the exception: such patterns are refused here.
_UNSUPPORTED_REGEX = re.compile(r"\(\?(?![:=!])|\\[AZzpPhHQE]")


def _check_trigger_pattern(pattern: str) -> None:
    if not pattern:
        raise InvalidOptionError("grammar trigger pattern is empty")
    if "\x00" in pattern:
        raise InvalidOptionError("grammar trigger pattern contains a NUL character")
    bad = _UNSUPPORTED_REGEX.search(pattern)
    if bad is not None:
        raise InvalidOptionError(f"grammar trigger pattern {pattern!r}: {bad.group(0)!r} is not ECMAScript regex "
                                 "syntax (no lookbehind, named groups or inline flags)")
    try:
        re.compile(pattern)
    except re.error as e:
        raise InvalidOptionError(f"grammar trigger pattern {pattern!r} is not a valid regex: {e}") from None
