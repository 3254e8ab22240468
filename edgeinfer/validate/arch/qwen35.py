"""qwen35 (Qwen3.5): hybrid Gated DeltaNet / attention layers and the MTP block (models/qwen35.cpp)."""

from __future__ import annotations

from typing import Any

from ...gguf_file import GGUFInfo
from ..metadata import MAX_EMBEDDING, check_shape, fail, get_int, ints

__all__ = ["check_tensors"]

# qwen35 (hybrid): what every layer has, then its token mixer's tensors; the MTP block's extras.
_COMMON = ("attn_norm", "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down")
_ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
_RECURRENT = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
              "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight")
_NEXTN = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm")
_SSM_KEYS = ("conv_kernel", "inner_size", "state_size", "time_step_rank", "group_count")


def check_tensors(info: GGUFInfo, by_name: dict[str, Any], n_layer: int, n_vocab: int) -> None:
    """Hybrid Gated DeltaNet / attention layers and the MTP block (models/qwen35.cpp): what its
    graph asserts on (head sizes, value heads per key head, an F32 conv kernel) and the tensors
    each layer's type needs."""
    p = "qwen35."
    n_embd = info.metadata[p + "embedding_length"]
    ssm = {}
    for key in _SSM_KEYS:
        value = get_int(info, f"{p}ssm.{key}", required=True)
        if not 0 < value <= MAX_EMBEDDING:
            raise fail(info, f"{p}ssm.{key} is {value}; it must be positive")
        ssm[key] = value
    if ssm["time_step_rank"] % ssm["group_count"]:
        raise fail(info, f"{p}ssm.time_step_rank {ssm['time_step_rank']} is not a multiple of {p}ssm.group_count {ssm['group_count']}")
    if ssm["inner_size"] != ssm["state_size"] * ssm["time_step_rank"]:
        raise fail(info, f"{p}ssm.inner_size {ssm['inner_size']} is not state_size x time_step_rank")
    k_len, v_len = get_int(info, p + "attention.key_length"), get_int(info, p + "attention.value_length")
    if k_len is not None and v_len is not None and k_len != v_len:
        raise fail(info, f"{p}attention.key_length {k_len} != {p}attention.value_length {v_len}")
    sections = ints(info.metadata.get(p + "rope.dimension_sections"))
    if sections is None or not isinstance(info.metadata.get(p + "rope.dimension_sections"), list) or len(sections) != 4:
        raise fail(info, f"{p}rope.dimension_sections must be 4 integers")
    nextn = get_int(info, p + "nextn_predict_layers") or 0
    trunk = n_layer - nextn
    if trunk < 1:
        raise fail(info, f"{p}nextn_predict_layers {nextn} leaves no layers of the model itself")
    flags = info.metadata.get(p + "attention.recurrent_layers")
    if flags is not None:
        if not isinstance(flags, list) or len(flags) != n_layer:
            raise fail(info, f"{p}attention.recurrent_layers must have one entry per layer ({n_layer})")
        recurrent = [bool(f) for f in flags]
    else:
        interval = get_int(info, p + "full_attention_interval") or 4
        if interval <= 0:
            raise fail(info, f"{p}full_attention_interval must be positive")
        recurrent = [i < trunk and (i + 1) % interval != 0 for i in range(n_layer)]
    check_shape(info, by_name, "token_embd.weight", (n_embd, n_vocab))
    check_shape(info, by_name, "output_norm.weight", (n_embd,))
    check_shape(info, by_name, "output.weight", (n_embd, n_vocab), required=False)
    conv_dim = 2 * ssm["group_count"] * ssm["state_size"] + ssm["inner_size"]
    for i in range(n_layer):
        for role in _COMMON:
            check_shape(info, by_name, f"blk.{i}.{role}.weight", (n_embd,) if role.endswith("norm") else None)
        if recurrent[i]:
            for name in _RECURRENT:
                check_shape(info, by_name, f"blk.{i}.{name}", None)
            conv = check_shape(info, by_name, f"blk.{i}.ssm_conv1d.weight", (ssm["conv_kernel"], conv_dim))
            if conv.type_name != "F32":  # ggml_ssm_conv asserts on anything else
                raise fail(info, f"tensor {conv.name!r} is {conv.type_name}; the conv kernel must be F32")
        else:
            for role in _ATTENTION:
                check_shape(info, by_name, f"blk.{i}.{role}.weight", None)
        if i >= trunk:
            for role in _NEXTN:
                check_shape(info, by_name, f"blk.{i}.{role}.weight", None)
