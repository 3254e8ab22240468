"""The dense transformers we convert (llama, qwen2, qwen3): the tensors every layer needs, named as
llama.cpp's loader (llama-model.cpp `load_arch_tensors`) asks for them."""

from __future__ import annotations

from typing import Any

from ...gguf_file import GGUFInfo
from ..metadata import fail, get_int

__all__ = ["LAYER_TENSORS", "check_tensors"]

# Tensors every layer needs, per architecture we convert (names as llama.cpp's loader asks).
LAYER_TENSORS = {
    "llama": ("attn_norm", "attn_output", "ffn_norm"),
    "qwen2": ("attn_norm", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"),
    "qwen3": ("attn_norm", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "attn_q_norm", "attn_k_norm"),
}
_DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")
_MOE_FFN = ("ffn_gate_inp", "ffn_up_exps", "ffn_down_exps")


def check_tensors(info: GGUFInfo, by_name: dict[str, Any], n_layer: int, n_vocab: int) -> None:
    """The embedding, output and every layer's tensors of a llama, qwen2 or qwen3 file (a llama
    with experts: the MoE feed-forward instead of the dense one)."""
    arch = info.architecture
    p = f"{arch}."
    n_embd = info.metadata[p + "embedding_length"]
    expect = {"token_embd.weight": (n_embd, n_vocab), "output_norm.weight": (n_embd,), "output.weight": (n_embd, n_vocab)}
    for name, shape in expect.items():
        t = by_name.get(name)
        if t is None:
            if name != "output.weight":  # absent: the embedding is tied
                raise fail(info, f"tensor {name!r} is missing")
        elif t.shape != shape:
            raise fail(info, f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    moe = (get_int(info, p + "expert_count") or 0) > 0
    for i in range(n_layer):
        needed = list(LAYER_TENSORS[arch])
        if arch == "llama":
            needed += _MOE_FFN if moe else _DENSE_FFN
        for role in needed:
            name = f"blk.{i}.{role}.weight"
            if name not in by_name:
                raise fail(info, f"tensor {name!r} is missing")
        if f"blk.{i}.attn_qkv.weight" not in by_name:
            for role in ("attn_q", "attn_k", "attn_v"):
                if f"blk.{i}.{role}.weight" not in by_name:
                    raise fail(info, f"tensor 'blk.{i}.{role}.weight' is missing")
        norm = by_name[f"blk.{i}.attn_norm.weight"]
        if norm.shape != (n_embd,):
            raise fail(info, f"tensor {norm.name!r} has shape {list(norm.shape)}, expected [{n_embd}]")
