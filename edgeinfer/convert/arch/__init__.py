"""Supported architectures, keyed by the `architectures` entry of config.json.

Adding one: write a module with an `Architecture` subclass and list it in `_ALL`.
"""

from __future__ import annotations

from typing import Any

from ...errors import ConversionError
from .base import Architecture, HParams, TensorSpec
from .llama import Llama
from .qwen2 import Qwen2
from .qwen3 import Qwen3

__all__ = ["Architecture", "HParams", "TensorSpec", "ARCHITECTURES", "supported_architectures", "architecture_for"]

_ALL: tuple[type[Architecture], ...] = (Llama, Qwen2, Qwen3)
ARCHITECTURES: dict[str, type[Architecture]] = {name: cls for cls in _ALL for name in cls.hf_names}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_for(config: dict[str, Any]) -> Architecture:
    names = config.get("architectures") or []
    if not isinstance(names, list) or not names:
        raise ConversionError(
            f"config.json names no architecture; supported: {', '.join(supported_architectures())}"
        )
    for n in names:
        if n in ARCHITECTURES:
            return ARCHITECTURES[n]()
    raise ConversionError(
        f"unsupported architecture {', '.join(map(str, names))}; supported: {', '.join(supported_architectures())}"
    )
