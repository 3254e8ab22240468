"""One source for each default and fact (issue 13, point 6): where a second spelling of a list or a
default has to exist (a typing Literal, a function's default argument), it is tied to the one source."""

from __future__ import annotations

import typing

from edgeinfer.kv_types import KV_TYPE_NAMES


def test_the_kv_type_literal_is_the_kv_types_list():
    """`KVType` is a Literal for type checkers, which cannot be built from a tuple: it must name
    exactly edgeinfer.kv_types' types, in the same order."""
    from edgeinfer.engine.options import KV_TYPES, KVType

    assert typing.get_args(KVType) == KV_TYPE_NAMES == KV_TYPES
