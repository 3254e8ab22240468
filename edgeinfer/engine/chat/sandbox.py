"""Chat templates rendered in a jinja2 sandbox with limits.

Templates come from downloaded files. The sandbox keeps them away from Python internals; on top
of it every render has a wall-time and an output-size limit (`TemplateLimits`), so a template can
neither hang (nested loops) nor take gigabytes ('x' * 10**8, `~` doubling, huge format widths),
and every failure of any kind is one line: "chat template of X failed: ...".

How the limits are enforced, cheapest first:
- operators that build big values in one C call (`*`, `**`, `+`, `%`, `~`) and calls or filters
  with a numeric argument beyond the output limit are refused before they run;
- the output is produced as a stream and counted;
- a trace function on the rendering thread, active only inside template code, checks the clock
  on every line, so even an empty nested loop stops at the deadline.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ...errors import ChatTemplateError, InvalidOptionError

__all__ = ["TemplateLimits", "render_template", "template_environment", "tojson"]


@dataclass(frozen=True)
class TemplateLimits:
    """Limits of one chat-template render."""

    seconds: float = 2.0
    max_chars: int = 1_000_000

    def validate(self) -> TemplateLimits:
        if not (isinstance(self.seconds, (int, float)) and 0 < self.seconds <= 3600):
            raise InvalidOptionError(f"template time limit must be in (0, 3600] seconds, got {self.seconds!r}")
        if not (isinstance(self.max_chars, int) and 0 < self.max_chars <= 1 << 30):
            raise InvalidOptionError(f"template output limit must be in 1..2^30 characters, got {self.max_chars!r}")
        return self


class _LimitExceeded(Exception):
    """A render went past one of its limits (turned into ChatTemplateError)."""


# Widths and precisions in %-format and str.format specs: each is an allocation size.
_PERCENT_SPEC_RE = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d*))?")
_FORMAT_SPEC_RE = re.compile(r"\{[^{}]*:([^{}]*)\}")
_DIGITS_RE = re.compile(r"\d+")
_SIZED_OPS = frozenset({"*", "**", "+", "%"})


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


def _check_widths(numbers: Sequence[str], limit: int) -> None:
    if any(n and (len(n) > 9 or int(n) > limit) for n in numbers):
        raise _LimitExceeded(f"a format width beyond the {limit}-character output limit")


def _fits(value: Any, budget: int) -> bool:
    """Whether str(value) stays within about `budget` characters, without building it: walks
    containers (shared and nested ones count each time, as str() would print them), stops early."""
    stack, total = [value], 0
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 2 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        else:
            total += 1
        if total > budget:
            return False
    return True


class _ConcatGenerator(CodeGenerator):
    """Compiles `a ~ b` to a size-checked join (the sandbox does not intercept `~`)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.limited_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with operators, calls, filters and output that refuse oversized values."""

    intercepted_binops = _SIZED_OPS
    code_generator_class = _ConcatGenerator

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=self._check_text)
        self.max_chars = TemplateLimits().max_chars  # set per render by `_render`
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = lambda fmt: _dt.datetime.now().strftime(str(fmt)[:200])
        self.filters["tojson"] = _tojson
        for name, func in list(self.filters.items()):
            self.filters[name] = self._guard_filter(func)

    def _check_text(self, value: Any) -> Any:
        if not _fits(value, self.max_chars):
            raise _LimitExceeded(f"a value beyond the {self.max_chars}-character output limit")
        return value

    def _check_ints(self, values: Sequence[Any]) -> None:
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.max_chars:
                raise _LimitExceeded(f"an argument of {value} is beyond the {self.max_chars}-character output limit")

    def _guard_filter(self, func: Any) -> Any:
        first = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # context/env/eval_ctx

        @functools.wraps(func)  # keeps jinja's pass_context/pass_environment marker
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if len(args) > first:
                self._check_text(args[first])  # the value being filtered (join, string, tojson...)
            self._check_ints([*args[first + 1 :], *kwargs.values()])  # widths, counts
            return func(*args, **kwargs)

        return guarded

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        __self._check_ints([*args, *kwargs.values()])
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            method = getattr(__obj, "__name__", "")
            for value in (*args, *kwargs.values()):
                __self._check_text(value)
            if method == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                if len(owner) + owner.count(args[0]) * len(args[1]) > __self.max_chars:
                    raise _LimitExceeded(f"a replace beyond the {__self.max_chars}-character output limit")
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        # str.format reaches templates wrapped by the sandbox, so its spec is checked here
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            widths = [d for spec in _FORMAT_SPEC_RE.findall(obj) for d in _DIGITS_RE.findall(spec)]
            _check_widths(widths, self.max_chars)
        return super().getattr(obj, attribute)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limit = self.max_chars
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                size = _size(seq)
                if size is not None and isinstance(n, int) and size * n > limit:
                    raise _LimitExceeded(f"a repetition of {size} × {n} is beyond the {limit}-character output limit")
        elif operator == "**":
            if isinstance(left, (int, float)) and isinstance(right, (int, float)) and abs(right) > 1 and abs(left) > 1:
                if abs(right) * math.log2(abs(left)) > 64 * 1024:
                    raise _LimitExceeded(f"{left} ** {right} is too large a number")
        elif operator == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None and a + b > limit:
                raise _LimitExceeded(f"a concatenation beyond the {limit}-character output limit")
        elif operator == "%" and isinstance(left, str):
            _check_widths([d for spec in _PERCENT_SPEC_RE.findall(left) for d in spec], limit)
            self._check_ints(right if isinstance(right, tuple) else [right])  # '*' widths
            self._check_text(right)
        return super().call_binop(context, operator, left, right)

    def limited_join(self, parts: Sequence[Any]) -> str:
        if not _fits(list(parts), self.max_chars):
            raise _LimitExceeded(f"a concatenation beyond the {self.max_chars}-character output limit")
        return "".join(str(p) for p in parts)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    return _LimitedEnvironment().from_string(template)


class _Deadline:
    """A trace function for the rendering thread: only frames of template code get a local tracer,
    which raises _LimitExceeded on the first line run after the deadline."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == "<template>":
            self.check()
            return self.local
        return None

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.check()
        return self.local

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise _LimitExceeded(f"it ran longer than {self.seconds:g} s")


def _render(template: jinja2.Template, limits: TemplateLimits, variables: dict[str, Any]) -> str:
    env = template.environment
    assert isinstance(env, _LimitedEnvironment)
    env.max_chars = limits.max_chars
    deadline = _Deadline(limits.seconds)
    previous = sys.gettrace()
    sys.settrace(deadline)
    try:
        out: list[str] = []
        size = 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > limits.max_chars:
                raise _LimitExceeded(f"its output passed the {limits.max_chars}-character output limit")
            out.append(chunk)
            deadline.check()
        return "".join(out)
    finally:
        sys.settrace(previous)


def template_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox's environment (to parse a template, e.g. for its variables)."""
    return _LimitedEnvironment()


tojson = _tojson


def render_template(source: str, variables: dict[str, Any], name: str, limits: TemplateLimits) -> str:
    """Render a template's `source` with `variables`; ChatTemplateError (one line, naming `name`) on
    any failure, a limit included."""
    try:
        compiled = _compile(source)
        return _render(compiled, limits, variables)
    except (InvalidOptionError, KeyboardInterrupt):
        raise
    except _LimitExceeded as e:
        raise ChatTemplateError(f"chat template of {name} failed: {e}{_HINT}") from None
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template of {name} failed: syntax error on line {e.lineno}: {_one_line(e)}{_HINT}") from None
    except RecursionError:
        raise ChatTemplateError(f"chat template of {name} failed: recursion too deep{_HINT}") from None
    except MemoryError:
        raise ChatTemplateError(f"chat template of {name} failed: out of memory{_HINT}") from None
    except Exception as e:  # noqa: BLE001 - any error inside a template is the template's failure
        raise ChatTemplateError(f"chat template of {name} failed: {type(e).__name__}: {_one_line(e)}{_HINT}") from None


_HINT = "; raw completion and the built-in 'chatml' template still work"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] + ("…" if len(text) > 300 else "")
