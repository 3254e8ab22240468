"""llguidance as the constrained-sampling engine: user grammars (GBNF, through llguidance's converter)
and JSON schemas (llguidance's own compiler) become token masks and forced continuations.

Why llguidance (issue 46): its JSON-schema compiler accepts what Pydantic v2 emits (prefixItems,
oneOf/anyOf + const, discriminators, pattern, formats, multipleOf, $ref including recursion) and
names what it cannot enforce ("Unimplemented keys: [...]": not, uniqueItems, …); a mask costs
≈0.1-1.5 ms on Qwen2.5's 152k vocabulary (llama.cpp's grammar sampler over a whole vocabulary is
tens of ms, and seconds for some grammars: issue 45 item 2); it computes the forced continuation
(`compute_ff_tokens`, forced tokens as drafts); its parser has per-step budgets (`LLParserLimits`)
that bound the cost of every mask of any accepted grammar; and it installs as one 3 MB abi3 wheel
with no dependencies.

What stays on llama.cpp's grammar sampler: the tool-call grammars engine/chat/tools.py generates
(lazy ones start at a trigger, and their literals match special tokens such as `<tool_call>` by
text, which llguidance deliberately never does). Those are ours, not a user's text.

Costs. The tokenizer llguidance needs is built once per loaded model (≈2.5 s for Qwen2.5's vocabulary),
lazily, by the first constrained request, in the thread that checks it (the server's worker pool,
never its event loop nor the scheduler thread). A grammar is compiled once per request in that same
thread; every mask after that is bounded by LIMITS.
"""

from __future__ import annotations

import json
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from ...errors import GrammarError, InvalidOptionError
from .bounds import check_gbnf_bounds, check_schema_bounds

# (A runtime is an engine/llama/runtime.py LlamaRuntime and a grammar a grammar.py Grammar: typed
# as Any here, since grammar.py imports this module.)
LlamaRuntime = Any
Grammar = Any

__all__ = ["Constraint", "llguidance_grammar", "with_practical_defaults", "LIMITS", "JSON_OPTIONS"]

# The parser's budgets: grammar size, lexer states, and per mask (step) the lexer's fuel and the
# Earley items. A grammar that needs more fails with a clear error — at its first mask, when the
# request is checked (a 400), or mid-generation (that request ends, the others go on).
# Measured worst mask within these: see benchmarks/RESULTS.md ("Structured output: bounds").
_LIMIT_VALUES = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=100_000,
                     step_max_items=20_000, max_lexer_states=100_000, max_grammar_size=200_000)


def _limits() -> Any:
    from llguidance import LLParserLimits
    return LLParserLimits(**_LIMIT_VALUES)


LIMITS = _LIMIT_VALUES

# JSON as models write it: `{"a": 1, "b": [2, 3]}` — fixed separators, no free whitespace (so a
# sampled model cannot run away in blanks, and every separator is a forced token).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}


def _first_line(text: str) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line[:300]


# -- grammar text → llguidance's grammar (checked without a vocabulary, cached) ----------------------

_compiled: OrderedDict[tuple[str, str, str], str] = OrderedDict()
_compiled_lock = threading.Lock()
_KEPT = 32


def llguidance_grammar(grammar: Grammar) -> str:
    """llguidance's grammar for `grammar` (its JSON schema, or its GBNF), bounded first and checked
    (without a vocabulary); an InvalidOptionError (one line) otherwise. Cached by text."""
    from llguidance import LLMatcher

    key = ("schema", grammar.json_schema, "") if grammar.json_schema is not None else ("gbnf", grammar.gbnf,
                                                                                       grammar.root)
    with _compiled_lock:
        if key in _compiled:
            _compiled.move_to_end(key)
            return _compiled[key]
    if grammar.json_schema is not None:
        schema = json.loads(grammar.json_schema)
        check_schema_bounds(schema)
        try:
            text = LLMatcher.grammar_from_json_schema(json.dumps(with_practical_defaults(schema)),
                                                      overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as e:
            raise InvalidOptionError(f"JSON schema: {_first_line(str(e))}") from None
        what = "JSON schema"
    else:
        check_gbnf_bounds(grammar.gbnf)
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
        gbnf = grammar.gbnf if grammar.root == "root" else grammar.gbnf + f"\nroot ::= {grammar.root}\n"
        try:
            lark = gbnf_to_lark(gbnf)
        except RecursionError:  # (the bounds keep it from recursing this deep)
            raise InvalidOptionError("invalid grammar: it nests too deeply") from None
        except (GbnfToLarkError, Exception) as e:  # noqa: BLE001 - it raises bare Exception for a missing rule
            raise InvalidOptionError(f"invalid grammar: {_first_line(str(e))}") from None
        text = LLMatcher.grammar_from_lark(lark)
        what = "invalid grammar"
    error = LLMatcher.validate_grammar(text, None, limits=_limits())
    if error and not error.startswith("WARNING"):
        raise InvalidOptionError(f"{what}: {_first_line(error)}")
    with _compiled_lock:
        _compiled[key] = text
        while len(_compiled) > _KEPT:
            _compiled.popitem(last=False)
    return text


# Values, not schemas: an object inside them is data and keeps every key it has.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# An integer without a bound on a side gets at most this many digits there (llama.cpp's
# json-schema-to-grammar and our earlier compiler cap integers at 16 digits the same way).
_INT_BOUND = 10**16 - 1


def with_practical_defaults(schema: Any) -> Any:
    """A copy of `schema` with two defaults that JSON Schema leaves open and a small model runs
    away with (until max_tokens): an object schema with `properties` and no `additionalProperties`
    allows only its declared properties (as OpenAI's strict mode and vLLM's guidance backend do; a
    Pydantic model never sets it), and an integer without `minimum`/`maximum` has at most 16 digits
    on that side. What comes out validates against the original schema. (Bounded first: depth ≤ 32.)"""
    if isinstance(schema, list):
        return [with_practical_defaults(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else with_practical_defaults(value) for key, value in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    kind = schema.get("type")
    if kind == "integer" or (isinstance(kind, list) and kind == ["integer"]):
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = _INT_BOUND
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -_INT_BOUND
    return out


# -- the tokenizer of a loaded model (built once, lazily) -------------------------------------------

_tokenizers: weakref.WeakKeyDictionary[LlamaRuntime, Any] = weakref.WeakKeyDictionary()
_tokenizer_lock = threading.Lock()


def _tokenizer(runtime: LlamaRuntime) -> Any:
    """llguidance's tokenizer for the runtime's vocabulary; every end-of-generation token counts as
    its EOS (any of them ends a complete output, as with llama.cpp's grammar sampler)."""
    with _tokenizer_lock:
        tok = _tokenizers.get(runtime)
        if tok is None:
            from llguidance.llamacpp import lltokenizer_from_vocab
            eog = [t for t in range(runtime.facts.n_vocab) if runtime.is_eog(t)] or [runtime.eos]
            with warnings.catch_warnings():  # (it calls a deprecated alias once per token)
                warnings.simplefilter("ignore", DeprecationWarning)
                tok = lltokenizer_from_vocab(runtime.vocab, n_vocab=runtime.facts.n_vocab, eos_token=eog)
            _tokenizers[runtime] = tok
        return tok


class Constraint:
    """One request's llguidance matcher: the allowed-token mask of its current state (computed once
    per state, ~0.1-1.5 ms), the forced continuation, and the state's advance by committed tokens."""

    def __init__(self, runtime: LlamaRuntime, grammar: Grammar, _matcher: Any = None):
        from llguidance import LLMatcher
        import llguidance.numpy as lln

        self._runtime = runtime
        self._grammar = grammar
        self._n = runtime.facts.n_vocab
        tok = _tokenizer(runtime)
        self._m = _matcher if _matcher is not None else LLMatcher(tok, llguidance_grammar(grammar),
                                                                  limits=_limits(), log_level=0)
        self._check()
        self._bits = lln.allocate_token_bitmask(1, tok.vocab_size)
        self._fill = lln.fill_next_token_bitmask
        self._mask: np.ndarray | None = None

    def _check(self) -> None:
        if self._m.is_error():  # (a parser budget exhausted, in LIMITS: the request's grammar, not the engine)
            raise GrammarError(f"grammar: {_first_line(self._m.get_error())}")

    def mask(self) -> np.ndarray:
        """Which tokens the grammar allows next (bool, one per token of the vocabulary)."""
        if self._mask is None:
            self._fill(self._m, self._bits)
            self._check()
            bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
            mask = np.zeros(self._n, dtype=bool)
            k = min(self._n, len(bits))
            mask[:k] = bits[:k].astype(bool)
            self._mask = mask
        return self._mask

    def allows(self, token: int) -> bool:
        return 0 <= token < self._n and bool(self.mask()[token])

    def consume(self, token: int) -> None:
        """Advance by a committed token (one the mask allows)."""
        self._mask = None
        self._m.consume_token(int(token))
        self._check()

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (each the only one allowed, in turn): drafts that
        cannot be rejected. Empty when more than one token is possible next."""
        return list(self._m.compute_ff_tokens())

    def fork(self) -> Constraint:
        twin = Constraint.__new__(Constraint)
        twin.__dict__.update(self.__dict__)
        twin._m = self._m.deep_copy()
        twin._bits = self._bits.copy()
        return twin
