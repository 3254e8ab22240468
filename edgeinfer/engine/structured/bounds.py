"""Bounds on untrusted grammars and JSON schemas, checked in one linear pass before anything
recursive or super-linear sees them (issue 45).

llguidance's own GBNF converter (`llguidance.gbnf_to_lark`) is a recursive-descent Python parser
whose rule resolution grows faster than linearly (measured: 1,000 chained rules 1.5 s, 2,000 5.6 s,
5,000 38 s and then a SIGSEGV in the Rust grammar check), and it recurses once per parenthesis.
So GBNF is scanned here first — size, parenthesis depth, rule count, alternatives, repetition counts,
token references — and refused with the limit named. A JSON schema is measured the same way (size,
nesting depth, subschema count) without recursion.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ...errors import InvalidOptionError

__all__ = ["check_gbnf_bounds", "check_schema_bounds", "load_schema", "MAX_GBNF_BYTES", "MAX_GBNF_DEPTH", "MAX_GBNF_RULES",
           "MAX_GBNF_ALTERNATIVES", "MAX_GROUP_ALTERNATIVES", "MAX_REPETITION", "MAX_SCHEMA_BYTES", "MAX_SCHEMA_DEPTH", "MAX_SCHEMA_NODES"]

MAX_GBNF_BYTES = 64 << 10  # a user's grammar (llama.cpp's json.gbnf is 0.6 KB)
MAX_GBNF_DEPTH = 32  # parentheses inside each other
MAX_GBNF_RULES = 256  # gbnf_to_lark: 256 rules ≈ 0.1 s; its cost grows faster than linearly
MAX_GBNF_ALTERNATIVES = 4096  # `|` in the whole grammar
MAX_GROUP_ALTERNATIVES = 128  # `|` in one rule body or group (each costs llguidance's parser items per step)
MAX_REPETITION = 2000  # the largest n in x{m,n} (as llama.cpp's MAX_REPETITION_THRESHOLD)
MAX_SCHEMA_BYTES = 128 << 10  # a JSON schema, serialized
MAX_SCHEMA_DEPTH = 32  # subschemas inside each other (llguidance's own JSON recursion limit is 128)
MAX_SCHEMA_NODES = 20_000  # objects, arrays and values in the schema


def _refuse(what: str, value: int, limit: int) -> InvalidOptionError:
    return InvalidOptionError(f"grammar has {what} {value}: at most {limit}")


_REPEAT = re.compile(r"\{\s*([0-9]*)\s*(?:,\s*([0-9]*)\s*)?\}")


def check_gbnf_bounds(gbnf: str) -> None:
    """Refuse GBNF over the bounds above (one InvalidOptionError line naming the limit), and token
    references (`<|im_end|>`, `<[123]>`): a grammar constrains text, the special tokens a chat
    template uses are never part of an answer. One pass over the characters."""
    size = len(gbnf.encode("utf-8", errors="replace"))
    if size > MAX_GBNF_BYTES:
        raise InvalidOptionError(f"grammar is too large: {size} bytes (at most {MAX_GBNF_BYTES})")
    depth = deepest = rules = alternatives = 0
    in_group = [0]  # alternatives of each open group (the rule body at the bottom)
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c == '"' or c == "[":  # a literal or a character class: skipped with its escapes
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
            if i >= n:
                raise InvalidOptionError("invalid grammar: unterminated " + ("literal" if c == '"' else
                                                                            "character class"))
        elif c == "#":
            while i < n and gbnf[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            if depth > MAX_GBNF_DEPTH:
                raise _refuse("parentheses nested", depth, MAX_GBNF_DEPTH)
            deepest = max(deepest, depth)
            in_group.append(0)
        elif c == ")":
            depth -= 1
            if depth < 0:
                raise InvalidOptionError("invalid grammar: ')' without '('")
            in_group.pop()
        elif c == "|":
            alternatives += 1
            in_group[-1] += 1
            if alternatives > MAX_GBNF_ALTERNATIVES:
                raise _refuse("alternatives ('|')", alternatives, MAX_GBNF_ALTERNATIVES)
            if in_group[-1] > MAX_GROUP_ALTERNATIVES:
                raise InvalidOptionError(f"grammar has more than {MAX_GROUP_ALTERNATIVES} alternatives in one "
                                         f"group or rule (at most {MAX_GROUP_ALTERNATIVES})")
        elif c == ":" and gbnf.startswith("::=", i):
            in_group[-1] = 0  # a new rule's body (at depth 0)
            rules += 1
            if rules > MAX_GBNF_RULES:
                raise _refuse("rules", rules, MAX_GBNF_RULES)
            i += 2
        elif c == "<":
            end = gbnf.find(">", i)
            ref = gbnf[i:end + 1] if 0 <= end - i < 40 else gbnf[i:i + 12] + "…"
            raise InvalidOptionError(f"grammar names a token ({ref}): token references are not supported, "
                                     "a grammar constrains the text of the answer")
        elif c == "{":
            m = _REPEAT.match(gbnf, i)
            if m is not None:
                for bound in m.groups():
                    if bound and int(bound[:9]) > MAX_REPETITION:
                        raise _refuse("a repetition count of", int(bound[:9]), MAX_REPETITION)
        i += 1
    if depth:
        raise InvalidOptionError("invalid grammar: '(' without ')'")


def check_schema_bounds(schema: Any) -> None:
    """Refuse a loaded JSON schema nested deeper than MAX_SCHEMA_DEPTH or with more than
    MAX_SCHEMA_NODES values (an explicit stack: no recursion)."""
    stack: list[tuple[Any, int]] = [(schema, 0)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise InvalidOptionError(f"JSON schema has more than {MAX_SCHEMA_NODES} values")
        if isinstance(value, Mapping):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth >= 2 * MAX_SCHEMA_DEPTH:  # (a subschema is an object inside an object or a list)
            raise InvalidOptionError(f"JSON schema nests deeper than {MAX_SCHEMA_DEPTH} subschemas")
        stack.extend((child, depth + 1) for child in children)


def load_schema(schema: Mapping | str) -> tuple[Any, str]:
    """The schema as data, and as JSON text (what names its compilation)."""
    if isinstance(schema, (bytes, bytearray)):
        schema = schema.decode("utf-8", errors="replace")
    if isinstance(schema, str):
        size = len(schema.encode("utf-8", errors="replace"))
        if size > MAX_SCHEMA_BYTES:
            raise InvalidOptionError(f"JSON schema is too large: {size} bytes (at most {MAX_SCHEMA_BYTES})")
        try:
            return json.loads(schema), schema
        except RecursionError:
            raise InvalidOptionError("JSON schema nests too deeply") from None
        except ValueError as e:
            raise InvalidOptionError(f"JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, Mapping) and not isinstance(schema, bool):
        raise InvalidOptionError(f"json_schema must be a mapping or JSON text, got {type(schema).__name__}")
    try:
        text = json.dumps(schema, ensure_ascii=False)
        size = len(text.encode("utf-8", errors="replace"))
    except RecursionError:
        raise InvalidOptionError("JSON schema nests too deeply") from None
    except (TypeError, ValueError) as e:
        raise InvalidOptionError(f"JSON schema is not JSON data: {e}") from None
    if size > MAX_SCHEMA_BYTES:
        raise InvalidOptionError(f"JSON schema is too large: {size} bytes (at most {MAX_SCHEMA_BYTES})")
    return schema, text
