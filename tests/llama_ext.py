"""Test helpers for llama.cpp's drafting-head API: contexts, batches and outputs through
llama-cpp-python 0.3.36's ctypes bindings. The C++-mangled hidden-state functions
(`set_embeddings_nextn`, `get_embeddings_nextn[_ith]`, `set/get_embeddings_layer_inp`,
`target_layer_ids[_n]`) come from the package, checked against the pinned build
(edgeinfer/engine/llama/heads_api.py): `ext()` is that API (`.ll` is llama_cpp, its log routed to
edgeinfer's logger). `llama_batch_ext_set_embd_state` is a stub in this llama.cpp (returns
false): the hidden state rides in `llama_batch_ext_set_embd_token`.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from edgeinfer.engine.llama.heads_api import HeadAPI
from edgeinfer.engine.llama.heads_api import ext as _package_ext

__all__ = ["ext", "threads", "context", "decode_tokens", "process_pairs", "logits_rows"]


def ext() -> HeadAPI:
    return _package_ext()


def threads() -> int:
    return int(os.environ.get("EDGEINFER_THREADS", "1"))


def context(model: Any, *, n_ctx: int = 128, mtp: bool = False, other: Any = None) -> Any:
    """A one-sequence context with an f32 KV cache (a 1e-3 comparison would see an f16 one)."""
    ll = ext().ll
    cp = ll.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_ctx, n_ctx, 1
    cp.n_threads = cp.n_threads_batch = threads()
    cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
    cp.flash_attn_type = 0
    if mtp:
        cp.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
    if other is not None:
        cp.ctx_other = other
    ctx = ll.llama_init_from_model(model, cp)
    assert ctx, "llama.cpp could not create the context"
    return ctx


def decode_tokens(ctx: Any, tokens: list[int], pos0: int = 0) -> None:
    """One llama_decode of `tokens` at positions pos0.., logits (and nextn states) for every row."""
    ll = ext().ll
    b = ll.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, True
            b.seq_id[i][0] = 0
        b.n_tokens = len(tokens)
        assert ll.llama_decode(ctx, b) == 0
    finally:
        ll.llama_batch_free(b)


def process_pairs(ctx: Any, tokens: list[int] | None, rows: np.ndarray, positions: list[int], *, encode: bool = False) -> int:
    """llama_process of one batch_ext: entry i is (tokens[i], rows[i]) at positions[i] (rows only
    when `tokens` is None), every entry an output. Returns llama_process's status."""
    ll = ext().ll
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    batch = ll.llama_batch_ext_init(ctx)
    try:
        for i, pos in enumerate(positions):
            embd = ll.llama_embd(rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, rows.shape[1])
            if tokens is None:
                idx = ll.llama_batch_ext_add_embd(batch, 0, embd)
                p = (ll.llama_pos * 4)(pos, pos, pos, 0)
            else:
                idx = ll.llama_batch_ext_add_token(batch, 0, tokens[i])
                assert idx >= 0 and ll.llama_batch_ext_set_embd_token(batch, idx, embd)
                p = (ll.llama_pos * 1)(pos)
            assert idx == i and ll.llama_batch_ext_set_pos(batch, idx, p)
            ll.llama_batch_ext_set_output_logits(batch, idx, True)
        return ll.llama_process(ctx, 0 if encode else 1, batch)
    finally:
        ll.llama_batch_ext_free(batch)


def logits_rows(ctx: Any, n: int, n_vocab: int) -> np.ndarray:
    ll = ext().ll
    return np.stack([np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy() for i in range(n)])
