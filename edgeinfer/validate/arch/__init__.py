"""Validation rules per architecture, beside each other as convert/arch/ holds the converters: the
tensors each layer needs and what llama.cpp's graph for the architecture asserts on. An architecture
without rules here gets the generic checks only (hyperparameters.py, vocabulary.py, tensors.py); a
new one is a module here and its line in TENSOR_RULES.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...gguf_file import GGUFInfo
from . import dense, eagle3, qwen35

__all__ = ["CHECKED", "TENSOR_RULES", "TensorRule"]

# (the file, its tensors by name, n_layer, n_vocab) -> None, or InvalidModelError naming the tensor
TensorRule = Callable[[GGUFInfo, dict[str, Any], int, int], None]

TENSOR_RULES: dict[str, TensorRule] = {
    **dict.fromkeys(dense.LAYER_TENSORS, dense.check_tensors),
    "qwen35": qwen35.check_tensors,
    "eagle3": eagle3.check_tensors,
}
# Architectures whose semantics are checked here (the others: the generic checks only).
CHECKED = tuple(TENSOR_RULES)
