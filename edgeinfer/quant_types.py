"""The names of llama.cpp's quantization types, shared by the quantizer and the quant profiles.

A bottom module (no imports from the package) so that `profiles` can validate a recipe without
importing the quantizer, and the quantizer can read profiles without a circle.
"""

from __future__ import annotations

__all__ = ["QUANT_TYPES", "TENSOR_TYPES", "TYPE_RECIPES", "IMATRIX_REQUIRED", "IMATRIX_USED"]

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
    "IQ3_M": (27, "IQ3_S"),
    "IQ3_S": (26, "IQ3_S"),
    "IQ3_XS": (22, "IQ3_S"),
    "IQ3_XXS": (23, "IQ3_XXS"),
    "Q2_K": (10, "Q2_K"),
    "IQ2_M": (29, "IQ2_S"),
    "IQ2_S": (28, "IQ2_XS"),
    "IQ2_XS": (20, "IQ2_XS"),
    "IQ2_XXS": (19, "IQ2_XXS"),
    "IQ1_M": (31, "IQ1_M"),
    "IQ1_S": (24, "IQ1_S"),
    # 4-bit floats: E2M1 values with an E4M3 scale per 16 (NVFP4) or an E8M0 one per 32 (MXFP4)
    "NVFP4": (39, "NVFP4"),
    "MXFP4": (38, "MXFP4"),
}

# Types the pinned llama.cpp's quantizer has no plain recipe for: it knows no default tensor type
# for LLAMA_FTYPE_MOSTLY_NVFP4, and MXFP4_MOE gives MXFP4 to MoE experts only (everything else
# Q8_0). They are made as (the base ftype llama.cpp quantizes by, a tensor-type override that gives
# every weight of the blocks the type); token_embd/output keep the base's choice (Q8_0), and the file
# type QUANT_TYPES names is written over the base's.
TYPE_RECIPES: dict[str, tuple[int, str]] = {
    "NVFP4": (7, r"^blk\.\d+\..*weight$"),  # base Q8_0
    "MXFP4": (38, r"^blk\.\d+\..*weight$"),  # base MXFP4_MOE
}

# Types whose quantization llama.cpp refuses without an importance matrix (tensor_requires_imatrix)
# and those whose quantizer uses one when given (the i-quants, and the k-quants below 4 bits).
# (IQ3_XS gives some tensors IQ3_XXS, IQ2_M IQ2_S.)
IMATRIX_REQUIRED: frozenset[str] = frozenset({"IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M",
                                              "IQ1_S"})
IMATRIX_USED: frozenset[str] = IMATRIX_REQUIRED | {"IQ3_S", "IQ3_M", "IQ4_XS", "IQ4_NL", "Q2_K", "Q3_K_S", "Q3_K_M",
                                                   "Q3_K_L"}

# ggml tensor types a single tensor may be given (output, embedding, overrides).
TENSOR_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0",
    "IQ4_NL", "IQ4_XS", "NVFP4", "MXFP4", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XS", "IQ2_XXS",
    "IQ1_M", "IQ1_S",
)  # fmt: skip
