"""The names of llama.cpp's quantization types, shared by the quantizer and the quant profiles.

A bottom module (no imports from the package) so that `profiles` can validate a recipe without
importing the quantizer, and the quantizer can read profiles without a circle.
"""

from __future__ import annotations

__all__ = ["QUANT_TYPES", "TENSOR_TYPES"]

# Quant (file) types: name -> (llama_ftype, the ggml type most weights get). The k-quant mixes
# (_S/_M/_L) give some tensors a larger k-type by recipe; rows whose length is not a multiple of
# the block size fall back to other types (see quantize.find_fallbacks).
QUANT_TYPES: dict[str, tuple[int, str]] = {
    "F32": (0, "F32"),
    "F16": (1, "F16"),
    "BF16": (32, "BF16"),
    "Q8_0": (7, "Q8_0"),
    "Q6_K": (18, "Q6_K"),
    "Q5_K_M": (17, "Q5_K"),
    "Q5_K_S": (16, "Q5_K"),
    "Q5_1": (9, "Q5_1"),
    "Q5_0": (8, "Q5_0"),
    "Q4_K_M": (15, "Q4_K"),
    "Q4_K_S": (14, "Q4_K"),
    "Q4_1": (3, "Q4_1"),
    "Q4_0": (2, "Q4_0"),
    "IQ4_NL": (25, "IQ4_NL"),
    "IQ4_XS": (30, "IQ4_XS"),
    "Q3_K_L": (13, "Q3_K"),
    "Q3_K_M": (12, "Q3_K"),
    "Q3_K_S": (11, "Q3_K"),
    "Q2_K": (10, "Q2_K"),
}

# ggml tensor types a single tensor may be given (output, embedding, overrides).
TENSOR_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0",
    "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K",
)  # fmt: skip
