"""JSON schema → GBNF: a schema compiled to a `Grammar` whose every complete output validates
against the schema. What it cannot guarantee it refuses with one InvalidOptionError line naming
the keyword (SUPPORTED_KEYWORDS); sizes, nesting and repetition counts are bounded, so a hostile
schema costs a clear error, never a hang."""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from ...errors import InvalidOptionError
from .grammar import MAX_GBNF_BYTES, Grammar

__all__ = ["json_schema_to_grammar", "SUPPORTED_KEYWORDS", "MAX_SCHEMA_BYTES", "MAX_REPETITIONS"]

MAX_SCHEMA_BYTES = 128 << 10  # a JSON schema larger than this (serialized) is refused
MAX_SCHEMA_DEPTH = 64  # nesting of subschemas
# llama.cpp's GBNF parser silently turns an {m,n} with n > 2000 into {m,} (MAX_REPETITION_THRESHOLD):
# a maxLength/maxItems beyond it could not be enforced, so it is refused.
MAX_REPETITIONS = 2000


# -- JSON schema → GBNF ------------------------------------------------------------------------------

# Keywords that only annotate (ignored), and those the compiler enforces. Anything else is refused.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly", "writeOnly",
    "deprecated", "$defs", "definitions", "strict",
})
_BY_TYPE = {
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "minItems", "maxItems", "uniqueItems"}),
    "string": frozenset({"minLength", "maxLength", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
}
_GENERAL = frozenset({"type", "enum", "const", "anyOf", "allOf", "$ref"})
SUPPORTED_KEYWORDS: frozenset[str] = _GENERAL | frozenset().union(*_BY_TYPE.values())
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_FORMATS = {
    "date": r'[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )',
    "time": r'( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,6} )? '
            r'( "Z" | [+-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
    "date-time": "fmt-date [Tt ] fmt-time",
    "uuid": ' "-" '.join(f"[0-9a-fA-F]{{{n}}}" for n in (8, 4, 4, 4, 12)),
}
# Whitespace between tokens: none, a space, or a line break and an indent, bounded so that a model
# cannot run away in it (the form llama.cpp's own converter uses).
_BASE_RULES = {
    "ws": r'| " " | "\n" [ \t]{0,20}',
    "char": r'[^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )',
    "string": r'"\"" char* "\""',
    # at most 16 digits before and after the point, 3 in an exponent: a number cannot run away
    "int": r'"-"? ( "0" | [1-9] [0-9]{0,15} )',
    "number": r'int ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?',
    "boolean": r'"true" | "false"',
    "null": r'"null"',
    "value": "object | array | string | number | boolean | null",
    "object": r'"{" ws ( string ws ":" ws value ( ws "," ws string ws ":" ws value )* ws )? "}"',
    "array": r'"[" ws ( value ( ws "," ws value )* ws )? "]"',
}
_BASE_DEPS = {"string": ("char",), "number": ("int",), "value": ("object", "array", "string", "number", "boolean", "null"),
              "object": ("ws", "string", "value"), "array": ("ws", "value")}
_INT_DIGITS = 16  # an unbounded side of an integer range is capped at this many digits


def _literal(text: str) -> str:
    """A GBNF string literal matching exactly `text`."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _json_literal(value: Any) -> str:
    return _literal(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _digits_range(lo: str, hi: str) -> str:
    """GBNF for the digit strings of length len(lo) == len(hi) from lo to hi (inclusive)."""
    if not lo:
        return ""
    if lo == hi:
        return _literal(lo)
    if lo[0] == hi[0]:
        return f"{_literal(lo[0])} ( {_digits_range(lo[1:], hi[1:])} )" if len(lo) > 1 else _literal(lo)
    rest = len(lo) - 1
    any_rest = f" [0-9]{{{rest}}}" if rest else ""
    if lo[1:] == "0" * rest and hi[1:] == "9" * rest:
        return f"[{lo[0]}-{hi[0]}]{any_rest}"
    alts = []
    if lo[1:] == "0" * rest:
        alts.append(f"[{lo[0]}]{any_rest}")
    else:
        alts.append(f"{_literal(lo[0])} ( {_digits_range(lo[1:], '9' * rest)} )")
    if int(lo[0]) + 1 <= int(hi[0]) - 1:
        alts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}]{any_rest}")
    if hi[1:] == "9" * rest:
        alts.append(f"[{hi[0]}]{any_rest}")
    else:
        alts.append(f"{_literal(hi[0])} ( {_digits_range('0' * rest, hi[1:])} )")
    return " | ".join(alts)


def _natural_range(lo: int, hi: int | None) -> str | None:
    """GBNF for the decimal integers in [lo, hi] (0 <= lo; hi None: up to 16 digits, or lo's length),
    without leading zeros; None when the range is empty."""
    if hi is None:
        hi = max(lo, 10**_INT_DIGITS - 1) if lo < 10**_INT_DIGITS else 10 ** len(str(lo)) - 1
    if lo > hi:
        return None
    alts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = min(hi, 10**n - 1)
        if a <= b:
            alts.append(f"( {_digits_range(str(a), str(b))} )")
    return " | ".join(alts)


def _magnitude(lo: int, lo_incl: bool, hi: int | None, hi_incl: bool, fraction: bool) -> list[str]:
    """Alternatives for non-negative decimals v (no sign) with lo <= v <= hi (or < / > per the flags;
    hi None: unbounded), lo and hi whole. With `fraction` a decimal part may follow; without, only
    whole numbers (the bounds already adjusted to be inclusive)."""
    if not fraction:
        r = _natural_range(lo, hi)
        return [r] if r is not None else []
    anyf = '( "." [0-9]{1,16} )?'
    zero = '( "." "0"{1,16} )?'
    nonzero = '"." "0"{0,15} [1-9] [0-9]{0,15}'
    alts = []
    if hi is not None and lo == hi:
        return [f'{_literal(str(lo))} {zero}'] if lo_incl and hi_incl else []
    # integer part == lo: v in [lo, lo + 1), > lo needs a non-zero decimal part
    alts.append(f'{_literal(str(lo))} {anyf if lo_incl else nonzero}')
    mid = _natural_range(lo + 1, None if hi is None else hi - 1)
    if mid is not None:
        alts.append(f"( {mid} ) {anyf}")
    if hi is not None and hi_incl:
        alts.append(f'{_literal(str(hi))} {zero}')
    return alts


class _Compiler:
    def __init__(self, root_schema: Any):
        self.root_schema = root_schema
        self.rules: dict[str, str] = {}
        self.ref_rules: dict[str, str] = {}
        self.expanding: list[str] = []
        self.n = 0

    # -- rules
    def base(self, name: str) -> str:
        if name not in self.rules:
            self.rules[name] = _BASE_RULES[name]
            for dep in _BASE_DEPS.get(name, ()):
                self.base(dep)
        return name

    def add(self, hint: str, body: str) -> str:
        self.n += 1
        name = f"{re.sub(r'[^A-Za-z0-9]+', '-', hint).strip('-')[:40] or 'schema'}-{self.n}"
        self.rules[name] = body
        if sum(len(k) + len(v) for k, v in self.rules.items()) > MAX_GBNF_BYTES:
            raise InvalidOptionError(f"JSON schema compiles to a grammar larger than {MAX_GBNF_BYTES} bytes")
        return name

    # -- schema
    def visit(self, schema: Any, path: str, depth: int) -> str:
        """The name of a rule matching the JSON texts that validate against `schema`."""
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidOptionError(f"JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels at {path}")
        if schema is True or schema == {}:
            return self.base("value")
        if schema is False:
            raise InvalidOptionError(f"JSON schema at {path} is `false`: nothing validates against it")
        if not isinstance(schema, Mapping):
            raise InvalidOptionError(f"JSON schema at {path} must be an object or a boolean, got {type(schema).__name__}")
        for key in schema:
            if not isinstance(key, str):
                raise InvalidOptionError(f"JSON schema at {path} has a non-string key {key!r}")
            if key not in SUPPORTED_KEYWORDS and key not in _ANNOTATIONS:
                raise InvalidOptionError(f'unsupported JSON schema keyword "{key}" at {path}')
        keys = {k for k in schema if k not in _ANNOTATIONS}
        if "$ref" in schema:
            if keys != {"$ref"}:
                raise InvalidOptionError(f'unsupported JSON schema keyword "{min(keys - {"$ref"})}" '
                                         f"beside $ref at {path}")
            return self.ref(schema["$ref"], path, depth)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or keys != {"allOf"}:
                raise InvalidOptionError(f'unsupported JSON schema keyword "allOf" at {path} '
                                         "(only a single-element allOf is supported)")
            return self.visit(parts[0], f"{path}/allOf/0", depth + 1)
        if "const" in schema:
            return self.add(path, _json_literal(schema["const"]))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise InvalidOptionError(f"JSON schema enum at {path} must be a non-empty array")
            return self.add(path, " | ".join(_json_literal(v) for v in values))
        if "anyOf" in schema:
            alts = schema["anyOf"]
            if not isinstance(alts, list) or not alts:
                raise InvalidOptionError(f"JSON schema anyOf at {path} must be a non-empty array")
            if keys != {"anyOf"}:
                raise InvalidOptionError(f'unsupported JSON schema keyword "{min(keys - {"anyOf"})}" '
                                         f"beside anyOf at {path}")
            return self.add(path, " | ".join(self.visit(s, f"{path}/anyOf/{i}", depth + 1) for i, s in enumerate(alts)))
        types = schema.get("type")
        if types is None:
            types = self.implied_type(schema, keys, path)
            if types is None:
                return self.base("value")
        names = [types] if isinstance(types, str) else types
        if not isinstance(names, list) or not names or any(t not in _TYPES for t in names):
            raise InvalidOptionError(f"JSON schema type at {path} must be one of {', '.join(_TYPES)} "
                                     f"(or a list of them), got {types!r}")
        alts = [self.typed(t, schema, path, depth) for t in dict.fromkeys(names)]
        return alts[0] if len(alts) == 1 else self.add(path, " | ".join(alts))

    @staticmethod
    def implied_type(schema: Mapping, keys: set[str], path: str) -> str | None:
        for t in ("object", "array"):
            if keys & _BY_TYPE[t]:
                return t
        if keys - {"type"}:
            raise InvalidOptionError(f'JSON schema at {path} uses "{min(keys)}" without a "type"')
        return None

    def ref(self, ref: Any, path: str, depth: int) -> str:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise InvalidOptionError(f"unsupported JSON schema $ref {ref!r} at {path} (only local refs: #/...)")
        if ref in self.ref_rules:
            return self.ref_rules[ref]
        if ref in self.expanding:
            cycle = " → ".join(self.expanding[self.expanding.index(ref):] + [ref])
            raise InvalidOptionError(f"recursive JSON schemas are not supported ($ref cycle {cycle})")
        target: Any = self.root_schema
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, Mapping) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise InvalidOptionError(f"JSON schema $ref {ref!r} at {path} points to nothing")
        self.expanding.append(ref)
        try:
            name = self.visit(target, ref, depth + 1)
        finally:
            self.expanding.pop()
        self.ref_rules[ref] = name
        return name

    def typed(self, t: str, schema: Mapping, path: str, depth: int) -> str:
        if t in ("boolean", "null"):
            return self.base(t)
        if t == "string":
            return self.string(schema, path)
        if t in ("number", "integer"):
            return self.number(schema, path, integer=t == "integer")
        if t == "array":
            return self.array(schema, path, depth)
        return self.object(schema, path, depth)

    def count(self, schema: Mapping, key: str, path: str, default: int | None) -> int | None:
        v = schema.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0:
            raise InvalidOptionError(f"JSON schema {key} at {path} must be a non-negative integer, got {v!r}")
        if v > MAX_REPETITIONS:
            raise InvalidOptionError(f"JSON schema {key} {v} at {path} is above {MAX_REPETITIONS}, "
                                     "the most a llama.cpp grammar can count")
        return int(v)

    def string(self, schema: Mapping, path: str) -> str:
        fmt = schema.get("format")
        if fmt is not None:
            if fmt not in _FORMATS:
                raise InvalidOptionError(f'unsupported JSON schema "format": {fmt!r} at {path} '
                                         f"(supported: {', '.join(_FORMATS)})")
            if "minLength" in schema or "maxLength" in schema:
                raise InvalidOptionError(f'unsupported JSON schema keyword "minLength"/"maxLength" beside "format" at {path}')
            for dep in ("date", "time") if fmt == "date-time" else ():
                self.rules.setdefault(f"fmt-{dep}", _FORMATS[dep])
            self.rules.setdefault(f"fmt-{fmt}", _FORMATS[fmt])
            return self.add(path, f'"\\"" fmt-{fmt} "\\""')
        lo = self.count(schema, "minLength", path, 0) or 0
        hi = self.count(schema, "maxLength", path, None)
        if hi is None and lo == 0:
            return self.base("string")
        if hi is not None and hi < lo:
            raise InvalidOptionError(f"JSON schema at {path}: maxLength {hi} < minLength {lo}")
        self.base("char")
        return self.add(path, f'"\\"" char{{{lo},{"" if hi is None else hi}}} "\\""')

    def number(self, schema: Mapping, path: str, integer: bool) -> str:
        bounds = {}
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if key in schema:
                v = schema[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise InvalidOptionError(f"JSON schema {key} at {path} must be a finite number, got {v!r}")
                bounds[key] = v
        if not bounds:
            return self.base("int" if integer else "number")
        lo = lo_incl = hi = hi_incl = None
        # the tighter of minimum / exclusiveMinimum (and of the maxima)
        for key, incl in (("minimum", True), ("exclusiveMinimum", False)):
            if key in bounds and (lo is None or bounds[key] > lo or (bounds[key] == lo and not incl)):
                lo, lo_incl = bounds[key], incl
        for key, incl in (("maximum", True), ("exclusiveMaximum", False)):
            if key in bounds and (hi is None or bounds[key] < hi or (bounds[key] == hi and not incl)):
                hi, hi_incl = bounds[key], incl
        if integer:  # whole bounds, inclusive
            if lo is not None:
                lo, lo_incl = (math.ceil(lo) if lo_incl else math.floor(lo) + 1), True
            if hi is not None:
                hi, hi_incl = (math.floor(hi) if hi_incl else math.ceil(hi) - 1), True
        else:
            for key in bounds:
                if bounds[key] != int(bounds[key]):
                    raise InvalidOptionError(f"unsupported JSON schema {key} {bounds[key]!r} at {path}: "
                                             "bounds of a number must be whole (use an integer type or whole bounds)")
            lo = None if lo is None else int(lo)
            hi = None if hi is None else int(hi)
        alts: list[str] = []
        frac = not integer
        # v >= 0 (what "-0" would add, 0 itself, is here too)
        if hi is None or hi > 0 or (hi == 0 and hi_incl):
            a, a_incl = (0, True) if lo is None or lo < 0 else (lo, bool(lo_incl))
            alts += _magnitude(a, a_incl, hi, bool(hi_incl), frac)
        # v < 0: "-" and a magnitude m = -v in (max(0, -hi), -lo]
        if lo is None or lo < 0:
            m_lo, m_lo_incl = (-hi, bool(hi_incl)) if hi is not None and hi < 0 else (0, False)
            m_hi = None if lo is None else -lo
            if not frac and not m_lo_incl:
                m_lo, m_lo_incl = m_lo + 1, True
            neg = _magnitude(m_lo, m_lo_incl, m_hi, bool(lo_incl), frac)
            alts += [f'"-" ( {a} )' for a in neg]
        if not alts:
            raise InvalidOptionError(f"JSON schema at {path}: no {'integer' if integer else 'number'} "
                                     "lies within its bounds")
        return self.add(path, " | ".join(f"( {a} )" for a in alts))

    def array(self, schema: Mapping, path: str, depth: int) -> str:
        if schema.get("uniqueItems", False) is not False:
            raise InvalidOptionError(f'unsupported JSON schema keyword "uniqueItems" at {path}')
        items = schema.get("items", True)
        if isinstance(items, list):
            raise InvalidOptionError(f'unsupported JSON schema keyword "items" as an array at {path} (tuples)')
        item = self.visit(items, f"{path}/items", depth + 1)
        lo = self.count(schema, "minItems", path, 0) or 0
        hi = self.count(schema, "maxItems", path, None)
        if hi is not None and hi < lo:
            raise InvalidOptionError(f"JSON schema at {path}: maxItems {hi} < minItems {lo}")
        self.base("ws")
        if hi == 0:
            return self.add(path, '"[" ws "]"')
        # The repetition in a rule of its own: llama.cpp limits the rules a repetition inside a group makes.
        items = self.add(f"{path}-items", f'{item} ( ws "," ws {item} ){{{max(lo - 1, 0)},{"" if hi is None else hi - 1}}}')
        return self.add(path, f'"[" ws {items} ws "]"' if lo > 0 else f'"[" ws ( {items} ws )? "]"')

    def object(self, schema: Mapping, path: str, depth: int) -> str:
        props = schema.get("properties", {})
        if not isinstance(props, Mapping):
            raise InvalidOptionError(f"JSON schema properties at {path} must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            raise InvalidOptionError(f"JSON schema required at {path} must be an array of strings")
        for r in required:
            if r not in props:
                raise InvalidOptionError(f'JSON schema at {path} requires "{r}", which has no schema in "properties"')
        extra = schema.get("additionalProperties", True)
        self.base("ws")
        if not props:
            if extra is False:
                return self.add(path, '"{" ws "}"')
            if extra is True or extra == {}:
                return self.base("object")
            value = self.visit(extra, f"{path}/additionalProperties", depth + 1)
            kv = f'string ws ":" ws {value}'
            self.base("string")
            return self.add(path, f'"{{" ws ( {kv} ( ws "," ws {kv} )* ws )? "}}"')
        if not isinstance(extra, bool):
            raise InvalidOptionError(f'unsupported JSON schema keyword "additionalProperties" as a schema beside '
                                     f'"properties" at {path}')
        # Only the declared properties, in their order (a valid subset also where extras are allowed).
        kvs = {}
        for name, sub in props.items():
            value = self.visit(sub, f"{path}/properties/{name}", depth + 1)
            kvs[name] = f'{_json_literal(name)} ws ":" ws {value}'
        req = [k for k in props if k in required]
        opt = [k for k in props if k not in required]
        body = ' ws "," ws '.join(kvs[k] for k in req)
        if opt:
            if req:
                body += " " + " ".join(f'( ws "," ws {kvs[k]} )?' for k in opt)
            else:
                # the first present optional property, then any of the later ones
                tails = [" ".join(f'( ws "," ws {kvs[k]} )?' for k in opt[i + 1:]) for i in range(len(opt))]
                body = "( " + " | ".join(f"{kvs[k]} {tails[i]}".strip() for i, k in enumerate(opt)) + " )?"
        return self.add(path, f'"{{" ws {body} ws "}}"')


def _load_schema(schema: Mapping | str) -> tuple[Any, str]:
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


# The last schemas compiled, by their JSON text: a request's schema is read where it is parsed and
# where it is checked, and clients send the same response_format again and again.
_compiled: OrderedDict[str, Grammar] = OrderedDict()
_compiled_lock = threading.Lock()
_COMPILED_KEPT = 16


def json_schema_to_grammar(schema: Mapping | str) -> Grammar:
    """A Grammar whose complete outputs are JSON texts that validate against `schema` (a mapping or
    JSON text). Supported: type (and lists of types), properties, required, additionalProperties
    (false/true, or a schema for a map without properties), items, minItems, maxItems, enum, const,
    anyOf, a single-element allOf, local $ref ($defs, definitions; not recursive), minLength,
    maxLength, format (date, time, date-time, uuid), minimum/maximum/exclusive* (whole bounds for
    numbers); annotations (title, description, default, …) are ignored. Objects are generated with
    their declared properties only, in declared order. Anything else is an InvalidOptionError naming
    the keyword; so is a recursive schema, one over MAX_SCHEMA_BYTES, or one whose grammar would
    exceed MAX_GBNF_BYTES (compilation is linear in the schema's size)."""
    loaded, text = _load_schema(schema)
    with _compiled_lock:
        if text in _compiled:
            _compiled.move_to_end(text)
            return _compiled[text]
    compiler = _Compiler(loaded)
    top = compiler.visit(loaded, "#", 0)
    rules = {"root": top, **compiler.rules}
    grammar = Grammar("\n".join(f"{k} ::= {v}" for k, v in rules.items()) + "\n")
    with _compiled_lock:
        _compiled[text] = grammar
        while len(_compiled) > _COMPILED_KEPT:
            _compiled.popitem(last=False)
    return grammar
