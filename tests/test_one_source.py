"""One source for each default and fact (issue 13, point 6): where a second spelling of a list or a
default has to exist (a typing Literal, a function's default argument), it is tied to the one source."""

from __future__ import annotations

import typing

from edgeinfer.kv_types import KV_TYPE_NAMES


def test_the_kv_type_literal_is_the_kv_types_list():
    """`KVType` is a Literal for type checkers, which cannot be built from a tuple: it must name
    exactly edgeinfer.kv_types' types, in the same order."""
    from edgeinfer.engine.core.options import KV_TYPES, KVType

    assert typing.get_args(KVType) == KV_TYPE_NAMES == KV_TYPES


def test_break_even_draft_cost_takes_draft_max_from_the_speculation_default():
    """`break_even_draft_cost(draft_max=...)` defaults to DEFAULT_SPECULATION.draft_max, read from it
    rather than repeated as a number that would drift when SpeculationOptions' default moves."""
    import ast
    import inspect

    from edgeinfer import DEFAULT_SPECULATION
    from edgeinfer.engine.speculation import break_even_draft_cost

    assert inspect.signature(break_even_draft_cost).parameters["draft_max"].default == DEFAULT_SPECULATION.draft_max
    fn = ast.parse(inspect.getsource(break_even_draft_cost)).body[0]
    assert isinstance(fn, ast.FunctionDef)
    default = dict(zip((a.arg for a in fn.args.kwonlyargs), fn.args.kw_defaults))["draft_max"]
    assert ast.unparse(default) == "DEFAULT_SPECULATION.draft_max"
