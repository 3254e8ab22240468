"""LlamaForCausalLM (Llama 2/3.x, SmolLM/SmolLM2, TinyLlama) and Mistral-style checkpoints.

llama.cpp runs llama with rope type NORM (adjacent pairs rotate together) while HF rotates the two
halves of each head (rotate_half), so q_proj/k_proj rows are permuted per head. Llama 3.1+ rope
scaling becomes a `rope_freqs` tensor of per-frequency factors.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from ...errors import ConversionError
from .base import Architecture, HParams

__all__ = ["Llama"]


class Llama(Architecture):
    hf_names = ("LlamaForCausalLM", "MistralForCausalLM")
    gguf_arch = gguf.MODEL_ARCH.LLAMA
    rope_permute = True

    def write_rope_scaling(self, w: gguf.GGUFWriter, hp: HParams) -> None:
        s = hp.rope_scaling or {}
        if str(s.get("rope_type") or s.get("type") or "").lower() == "llama3":
            return  # expressed as the rope_freqs tensor
        super().write_rope_scaling(w, hp)

    def extra_tensors(self, hp: HParams) -> dict[str, np.ndarray]:
        s = hp.rope_scaling or {}
        if str(s.get("rope_type") or s.get("type") or "").lower() != "llama3":
            return {}
        try:
            factor = float(s.get("factor", 8.0))
            low = float(s.get("low_freq_factor", 1.0))
            high = float(s.get("high_freq_factor", 4.0))
            old_ctx = float(s.get("original_max_position_embeddings", 8192))
        except (TypeError, ValueError):
            raise ConversionError("config.json: invalid llama3 rope_scaling values") from None
        if high <= low:
            raise ConversionError("config.json: llama3 rope_scaling needs high_freq_factor > low_freq_factor")
        dim = hp.head_dim
        freqs = 1.0 / (hp.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        out = []
        for freq in freqs.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                out.append(1.0)
            elif wavelen > low_wavelen:
                out.append(factor)
            else:
                smooth = (old_ctx / wavelen - low) / (high - low)
                out.append(1.0 / ((1 - smooth) / factor + smooth))
        return {gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight": np.asarray(out, dtype=np.float32)}
