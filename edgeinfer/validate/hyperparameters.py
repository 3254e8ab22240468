"""The hyper-parameters llama.cpp reads (llama-model.cpp `load_hparams`): counts and sizes in range,
finite numbers, heads that divide what they split, experts that add up."""

from __future__ import annotations

import math

from ..gguf_file import GGUFInfo
from .arch import CHECKED
from .metadata import MAX_CONTEXT, MAX_EMBEDDING, MAX_EXPERTS, MAX_LAYERS, fail, get_float, get_int, ints_of, per_layer

__all__ = ["check_hyperparameters"]

_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


def check_hyperparameters(info: GGUFInfo) -> int:
    arch = info.architecture
    p = f"{arch}."
    for key, value in info.metadata.items():  # NaN/inf anywhere in the model's own parameters
        if key.startswith(p) and isinstance(value, (float, list)):
            floats = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in floats):
                raise fail(info, f"{key} is not a finite number")

    n_layer = get_int(info, p + "block_count", required=True)
    if not 1 <= n_layer <= MAX_LAYERS:
        raise fail(info, f"{p}block_count is {n_layer}; llama.cpp takes 1..{MAX_LAYERS}")
    n_ctx = get_int(info, p + "context_length", required=True)
    if not 1 <= n_ctx <= MAX_CONTEXT:
        raise fail(info, f"{p}context_length is {n_ctx}, not a plausible context size")
    n_embd = get_int(info, p + "embedding_length", required=True)
    if not 1 <= n_embd <= MAX_EMBEDDING:
        raise fail(info, f"{p}embedding_length is {n_embd}, not a plausible size")
    nextn = get_int(info, p + "nextn_predict_layers")
    if nextn is not None and not 0 <= nextn <= n_layer:
        raise fail(info, f"{p}nextn_predict_layers is {nextn}, more than the {n_layer} layers")

    _check_experts(info, p, n_layer)

    for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
        eps = get_float(info, p + key)
        if eps is not None and not eps > 0:
            raise fail(info, f"{p}{key} is {eps}; it must be a positive number")
    if arch in CHECKED and p + "attention.layer_norm_rms_epsilon" not in info.metadata:
        raise fail(info, f"{p}attention.layer_norm_rms_epsilon is missing")
    base = get_float(info, p + "rope.freq_base")
    if base is not None and not base > 0:
        raise fail(info, f"{p}rope.freq_base is {base}; it must be positive")
    scaling = info.metadata.get(p + "rope.scaling.type")
    if scaling is not None and scaling not in _ROPE_SCALING_TYPES:
        raise fail(info, f"{p}rope.scaling.type {scaling!r} is not one of {', '.join(_ROPE_SCALING_TYPES)}")

    heads = per_layer(info, p + "attention.head_count", n_layer)
    heads_kv = per_layer(info, p + "attention.head_count_kv", n_layer) or heads
    for key in ("feed_forward_length", "attention.key_length", "attention.value_length", "rope.dimension_count"):
        values = per_layer(info, p + key, n_layer) if key == "feed_forward_length" else ints_of(info, p + key)
        if values and any(not 0 <= v <= MAX_EMBEDDING * 64 for v in values):
            raise fail(info, f"{p}{key} is out of range")
    if arch in CHECKED:
        _check_heads(info, p, n_embd, heads, heads_kv)
    return n_layer


def _check_experts(info: GGUFInfo, p: str, n_layer: int) -> None:
    n_expert = get_int(info, p + "expert_count") or 0
    used = max(per_layer(info, p + "expert_used_count", n_layer) or [0])
    groups = get_int(info, p + "expert_group_count") or 0
    group_used = get_int(info, p + "expert_group_used_count") or 0
    if not 0 <= n_expert <= MAX_EXPERTS:
        raise fail(info, f"{p}expert_count is {n_expert}; llama.cpp takes 0..{MAX_EXPERTS}")
    if n_expert == 0:
        if used or groups:
            raise fail(info, f"{p}expert_used_count/expert_group_count are set but {p}expert_count is 0")
        return
    if not 0 < used <= n_expert:
        raise fail(info, f"{p}expert_used_count is {used}; it must be 1..{n_expert}")
    if not 0 <= groups < n_expert:
        raise fail(info, f"{p}expert_group_count is {groups}; it must be below {p}expert_count ({n_expert})")
    if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
        raise fail(info, f"{p}expert_group_count {groups} / expert_group_used_count {group_used} do not fit {n_expert} experts")


def _check_heads(info: GGUFInfo, p: str, n_embd: int, heads: list[int] | None, heads_kv: list[int] | None) -> None:
    if heads is None:
        return
    if not heads or any(h <= 0 for h in heads):
        raise fail(info, f"{p}attention.head_count must be positive")
    head_dim = get_int(info, p + "attention.key_length")
    for h, h_kv in zip(heads, heads_kv or heads):
        if head_dim is None and n_embd % h:
            raise fail(info, f"{p}attention.head_count {h} does not divide {p}embedding_length {n_embd}")
        if h_kv <= 0 or h % h_kv:
            raise fail(info, f"{p}attention.head_count_kv {h_kv} does not divide {p}attention.head_count {h}")
    n_rot = get_int(info, p + "rope.dimension_count")
    dim = head_dim if head_dim is not None else n_embd // heads[0]
    if n_rot is not None and (n_rot > dim or n_rot % 2):
        raise fail(info, f"{p}rope.dimension_count {n_rot} does not fit the head size {dim}")
