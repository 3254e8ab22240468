"""Which quantization a checkpoint uses: the one door the converter asks.

`quantized` knows FP8, AWQ, GPTQ and compressed-tensors' integer and FP8 formats; `fp4` knows
NVFP4/MXFP4 (compressed-tensors' FP4 formats, ModelOpt) and builds on `quantized`'s base classes,
so the choice between them is made here, above both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import quantized
from .fp4 import fp4_scheme_for
from .quantized import QuantScheme

__all__ = ["scheme_for"]


def scheme_for(config: dict[str, Any], folder: Path) -> QuantScheme | None:
    """The checkpoint's quantization scheme, or None for a float checkpoint; unknown methods are
    one-line ConversionErrors."""
    return fp4_scheme_for(config, folder) or quantized.scheme_for(config, folder)
