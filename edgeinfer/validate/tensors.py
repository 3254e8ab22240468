"""The tensors of any file: norms and 1-D tensors in F32, no layer past block_count; then the rules
of its architecture (arch/), where there are any."""

from __future__ import annotations

import re

from ..gguf_file import GGUFInfo
from .arch import TENSOR_RULES
from .metadata import fail, split_count

__all__ = ["check_tensors"]

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def check_tensors(info: GGUFInfo, n_layer: int, n_vocab: int) -> None:
    by_name = {t.name: t for t in info.tensors}
    for t in info.tensors:
        if t.name == "d2t" and t.type_name == "I64":
            pass  # a drafter's draft-to-target id table (checked with its architecture)
        elif (len(t.shape) == 1 or t.name.endswith("norm.weight")) and t.type_name != "F32":
            raise fail(info, f"tensor {t.name!r} is {t.type_name}; norms and 1-D tensors must be F32")
        m = _BLOCK_RE.match(t.name)
        if m and int(m.group(1)) >= n_layer:
            raise fail(info, f"tensor {t.name!r} belongs to a layer past block_count ({n_layer})")
    rule = TENSOR_RULES.get(info.architecture)
    if rule is None or split_count(info) > 1:
        # an architecture we do not convert, or one part of a split file (the tensors are spread
        # over the parts): llama.cpp's own checks of shapes and counts apply
        return
    rule(info, by_name, n_layer, n_vocab)
