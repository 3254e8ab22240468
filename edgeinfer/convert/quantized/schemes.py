"""Which scheme reads a checkpoint: config.json's `quantization_config` (or an AutoGPTQ
`quantize_config.json`) by its `quant_method`.

A new format family is a module beside fp8.py, awq.py, gptq.py and compressed_tensors.py — a
QuantizedTensor subclass for its stored parts (integer.py's IntTensor where the weights are integers
with a scale and a zero point), a QuantScheme subclass with its `method`, `supported`, `suffixes`
and `make` — and its line in SCHEMES here. FP4 (fp4.py) is asked first: its formats live inside
compressed-tensors' method, and ModelOpt's older exports name theirs in hf_quant_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import ConversionError
from .awq import AWQScheme
from .base import QuantScheme
from .compressed_tensors import CompressedTensorsScheme
from .fp4 import CompressedFP4Scheme, ModelOptScheme, MXFP4Scheme, fp4_scheme_for
from .fp8 import FP8Scheme
from .gptq import GPTQScheme

__all__ = ["SCHEMES", "SUPPORTED_METHODS", "scheme_for"]

# quant_method -> the scheme that reads it
SCHEMES: dict[str, type[QuantScheme]] = {
    "fp8": FP8Scheme,
    "fbgemm_fp8": FP8Scheme,
    "awq": AWQScheme,
    "gptq": GPTQScheme,
    "compressed-tensors": CompressedTensorsScheme,
    "modelopt": ModelOptScheme,
    "mxfp4": MXFP4Scheme,
}
SUPPORTED_METHODS = ", ".join(scheme.supported for scheme in dict.fromkeys((*SCHEMES.values(), CompressedFP4Scheme)))


def scheme_for(config: dict[str, Any], folder: Path) -> QuantScheme | None:
    """The checkpoint's quantization (config.json's quantization_config, or an AutoGPTQ
    quantize_config.json), or None for a float checkpoint. Unknown methods are one-line errors."""
    fp4 = fp4_scheme_for(config, folder)
    if fp4 is not None:
        return fp4
    qc = config.get("quantization_config")
    if qc is None:
        legacy = Path(folder) / "quantize_config.json"
        if not legacy.is_file():
            return None
        try:
            qc = json.loads(legacy.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConversionError(f"quantize_config.json is not valid JSON: {e}") from None
        if isinstance(qc, dict):
            qc.setdefault("quant_method", "gptq")
    if not isinstance(qc, dict):
        raise ConversionError("config.json: quantization_config must be an object")
    method = str(qc.get("quant_method") or "").lower()
    if method == "compressed_tensors":
        method = "compressed-tensors"
    cls = SCHEMES.get(method)
    if cls is None:
        raise ConversionError(f"quantization method {method or '(none)'!r} is not supported; supported: {SUPPORTED_METHODS}")
    return cls(config=qc)
