"""Qwen2ForCausalLM: the llama layout with q/k/v biases and NEOX rope (no row permutation)."""

from __future__ import annotations

import gguf

from .base import Architecture

__all__ = ["Qwen2"]


class Qwen2(Architecture):
    hf_names = ("Qwen2ForCausalLM",)
    gguf_arch = gguf.MODEL_ARCH.QWEN2
    qkv_bias = True
    default_rope_theta = 1000000.0
