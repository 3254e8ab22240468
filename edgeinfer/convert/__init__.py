"""Hugging Face safetensors -> GGUF, with numpy and gguf only (no torch, no transformers).

    from edgeinfer.convert import convert_model
    result = convert_model("./SmolLM2-360M-Instruct", "f16")   # into the store as smollm2-360m-instruct:f16

Architectures live in `edgeinfer.convert.arch` (one small module each); the tokenizer in
`tokenizer` (byte-level BPE tokenizer.json, SentencePiece tokenizer.model); the bounds-checked
safetensors reader in `safetensors`.
"""

from __future__ import annotations

from .arch import supported_architectures
from .converter import OUTTYPES, ConvertProgress, ConvertResult, NonFiniteWeightWarning, convert_model

__all__ = [
    "convert_model",
    "ConvertProgress",
    "ConvertResult",
    "NonFiniteWeightWarning",
    "OUTTYPES",
    "supported_architectures",
]
