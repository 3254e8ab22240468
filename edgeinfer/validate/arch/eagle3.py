"""eagle3: an EAGLE-3 drafter (models/eagle3.cpp), a one-layer head over three of its target's layers."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...gguf_file import GGUFInfo
from ..metadata import MAX_EMBEDDING, check_shape, fail, get_int, ints

__all__ = ["check_tensors"]

_LAYER = ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
          "ffn_gate", "ffn_up", "ffn_down")


def check_tensors(info: GGUFInfo, by_name: dict[str, Any], n_layer: int, n_vocab: int) -> None:
    """An EAGLE-3 drafter (models/eagle3.cpp): one layer (its graph asserts it), three target
    layers of a stated width, and a d2t table whose ids the graph writes logits at unchecked."""
    p = "eagle3."
    n_embd = info.metadata[p + "embedding_length"]
    if n_layer != 1:
        raise fail(info, f"{p}block_count is {n_layer}; an EAGLE-3 drafter has 1 layer")
    layers = info.metadata.get(p + "target_layers")
    ids = ints(layers)
    if not isinstance(layers, list) or ids is None or len(ids) != 3 or len(layers) != 3 or min(ids) < 0:
        raise fail(info, f"{p}target_layers must be 3 layer indices")
    tgt = get_int(info, p + "target_hidden_size", required=True)
    if not 0 < tgt <= MAX_EMBEDDING:
        raise fail(info, f"{p}target_hidden_size is {tgt}; it must be positive")
    check_shape(info, by_name, "fc.weight", (3 * tgt, n_embd))
    check_shape(info, by_name, "output_norm.weight", (n_embd,))
    check_shape(info, by_name, "token_embd.weight", (n_embd, n_vocab), required=False)
    if info.metadata.get(p + "norm_before_fc"):
        check_shape(info, by_name, "enc.output_norm.weight", (3 * tgt,))
    for role in _LAYER:
        check_shape(info, by_name, f"blk.0.{role}.weight", (n_embd,) if role.endswith(("norm", "norm_2")) else None)
    d2t = by_name.get("d2t")
    if d2t is None:
        return
    if d2t.type_name != "I64" or len(d2t.shape) != 1:
        raise fail(info, "tensor 'd2t' must be a 1-D I64 table")
    check_shape(info, by_name, "output.weight", (n_embd, d2t.shape[0]))  # the head the ids index
    table = np.fromfile(info.path, dtype="<i8", count=d2t.shape[0], offset=d2t.offset)
    if table.size != d2t.shape[0] or table.min() < 0 or table.max() >= n_vocab:
        raise fail(info, f"tensor 'd2t' maps draft ids outside the vocabulary (0..{n_vocab - 1})")
    if np.unique(table).size != table.size:
        raise fail(info, "tensor 'd2t' maps two draft ids to the same token")
