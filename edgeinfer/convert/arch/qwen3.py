"""Qwen3ForCausalLM: the llama layout with per-head RMSNorm of q and k, explicit head_dim, NEOX rope."""

from __future__ import annotations

import gguf

from .base import Architecture

__all__ = ["Qwen3"]


class Qwen3(Architecture):
    hf_names = ("Qwen3ForCausalLM",)
    gguf_arch = gguf.MODEL_ARCH.QWEN3
    qk_norm = True
    default_rope_theta = 1000000.0
