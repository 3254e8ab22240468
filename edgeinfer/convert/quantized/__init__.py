"""Quantized Hugging Face checkpoints (FP8, AWQ, GPTQ, compressed-tensors, NVFP4/MXFP4), dequantized in numpy.

`config.json`'s `quantization_config` names the method; `scheme_for(config, folder)` turns it into a
`QuantScheme`, which groups each quantized linear layer's stored parts (packed integers, scales,
zero points, group indices) into one `QuantizedTensor` that stands for the layer's `weight`:
`tensor.rows(r0, r1)` gives its float32 rows (output features) r0..r1, exactly as the format's own
reference code computes them (integer differences are exact; one float32 rounding of the product).
Every part is checked (dtype, shape, group size) before a byte of data is read.

One module per format family, each with its packing as the family's reference implementation
writes it:

    fp8.py                 FP8 (fp8, fbgemm_fp8; compressed-tensors float-quantized)
    awq.py                 AWQ GEMM, 4-bit
    gptq.py                GPTQ, 2/4/8-bit, act-order
    compressed_tensors.py  compressed-tensors (pack-, int-, naive-quantized; float-quantized through fp8.py)
    fp4.py                 NVFP4 and MXFP4 (compressed-tensors' FP4 formats, ModelOpt, transformers' mxfp4
                           of gpt-oss), carried into GGUF FP4 blocks
    integer.py             integer weights with scales and zero points, and the GGUF blocks that hold them as they are
    base.py                what they share: parts, QuantizedTensor, QuantScheme, element decoding
    schemes.py             which scheme reads a checkpoint (a new family: a module here and its line in SCHEMES)
"""

from __future__ import annotations

from .base import QuantizedTensor, QuantScheme
from .fp8 import fp8_to_float32
from .schemes import SUPPORTED_METHODS, scheme_for

__all__ = [
    "QuantScheme",
    "QuantizedTensor",
    "SUPPORTED_METHODS",
    "scheme_for",
    "fp8_to_float32",
]
