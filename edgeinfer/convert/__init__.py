"""Hugging Face safetensors -> GGUF, with numpy and gguf only (no torch, no transformers).

    from edgeinfer.convert import convert_model
    result = convert_model("./SmolLM2-360M-Instruct", "f16")   # into the store as smollm2-360m-instruct:f16

Architectures live in `edgeinfer.convert.arch` (one small module each); the tokenizer in
`tokenizer` (byte-level BPE tokenizer.json, SentencePiece tokenizer.model); the bounds-checked
safetensors reader in `safetensors`; quantized checkpoints (FP8, AWQ, GPTQ, compressed-tensors) in
`quantized` (NVFP4/MXFP4 from compressed-tensors and ModelOpt in `quantized.fp4`).
"""

from __future__ import annotations

from .arch import supported_architectures
from .converter import (
    OUTTYPE_CHOICES,
    OUTTYPES,
    ConvertProgress,
    ConvertResult,
    DirectTensor,
    NonFiniteWeightWarning,
    convert_model,
)
from .quantized import SUPPORTED_METHODS as SUPPORTED_QUANTIZATIONS

__all__ = [
    "convert_model",
    "ConvertProgress",
    "ConvertResult",
    "DirectTensor",
    "NonFiniteWeightWarning",
    "OUTTYPES",
    "OUTTYPE_CHOICES",
    "SUPPORTED_QUANTIZATIONS",
    "supported_architectures",
]
