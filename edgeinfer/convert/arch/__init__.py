"""Supported architectures, keyed by the `architectures` entry of config.json.

Adding one: write a module with an `Architecture` subclass and list it in `_ALL`.
"""

from __future__ import annotations

from typing import Any

from ...errors import ConversionError
from .base import Architecture, HParams, TensorSpec
from .eagle3 import Eagle3, is_eagle3_config
from .gpt_oss import GptOss
from .llama import Llama
from .qwen2 import Qwen2
from .qwen3 import Qwen3
from .qwen35 import REFUSED as _QWEN35_REFUSED
from .qwen35 import Qwen35

__all__ = ["Architecture", "HParams", "TensorSpec", "ARCHITECTURES", "supported_architectures", "architecture_for"]

_ALL: tuple[type[Architecture], ...] = (Llama, Qwen2, Qwen3, Qwen35, GptOss, Eagle3)
ARCHITECTURES: dict[str, type[Architecture]] = {name: cls for cls in _ALL for name in cls.hf_names}
# Architectures we know and do not convert, with the reason given instead of "unsupported".
_REFUSED: dict[str, str] = {**_QWEN35_REFUSED}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_for(config: dict[str, Any]) -> Architecture:
    names = config.get("architectures") or []
    if not isinstance(names, list) or not names:
        raise ConversionError(
            f"config.json names no architecture; supported: {', '.join(supported_architectures())}"
        )
    if is_eagle3_config(config):  # some drafters call themselves LlamaForCausalLM
        return Eagle3()
    for n in names:
        if n in ARCHITECTURES:
            return ARCHITECTURES[n]()
    for n in names:
        if n in _REFUSED:
            raise ConversionError(f"{n}: {_REFUSED[n]}")
    raise ConversionError(
        f"unsupported architecture {', '.join(map(str, names))}; supported: {', '.join(supported_architectures())}"
    )
