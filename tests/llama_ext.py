"""Test helpers for llama.cpp's drafting-head API, through llama-cpp-python 0.3.36's ctypes bindings.

The functions that hand hidden states between contexts (`llama_set_embeddings_nextn`,
`llama_get_embeddings_nextn[_ith]`, `llama_set/get_embeddings_layer_inp`,
`llama_model_target_layer_ids[_n]`) are declared in llama.cpp's staging header `src/llama-ext.h`
without `extern "C"`: libllama exports them under C++-mangled names and the binding has none of
them. They take plain pointers and scalars, so ctypes calls them by those names.
`llama_batch_ext_set_embd_state` is bound but a stub in this llama.cpp (returns false): the hidden
state rides in `llama_batch_ext_set_embd_token` (or a llama_batch with both token and embd set).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

__all__ = ["ext", "threads", "context", "decode_tokens", "process_pairs", "logits_rows"]

_MANGLED = {
    "set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                             [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None),
    "get_embeddings_nextn": ("_Z26llama_get_embeddings_nextnP13llama_context",
                             [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)),
    "get_embeddings_nextn_ith": ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                                 [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)),
    "set_embeddings_layer_inp": ("_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                                 [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None),
    "get_embeddings_layer_inp": ("_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                                 [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
    "target_layer_ids": ("_Z28llama_model_target_layer_idsPK11llama_model",
                         [ctypes.c_void_p], ctypes.POINTER(ctypes.c_int32)),
    "target_layer_ids_n": ("_Z30llama_model_target_layer_ids_nPK11llama_model", [ctypes.c_void_p], ctypes.c_uint32),
}


class _Ext:
    def __init__(self) -> None:
        from llama_cpp import llama_cpp as ll

        self.ll = ll
        for name, (symbol, args, res) in _MANGLED.items():
            fn = ll._lib[symbol]
            fn.argtypes, fn.restype = args, res
            setattr(self, name, fn)


_ext: _Ext | None = None


def ext() -> _Ext:
    global _ext
    if _ext is None:
        _ext = _Ext()
        _ext.ll.llama_backend_init()
        _ext.ll.llama_log_set(_quiet, ctypes.c_void_p(0))  # llama.cpp's log would flood the test output
    return _ext


def _silent(_level: int, _text: bytes, _user: ctypes.c_void_p) -> None:
    pass


def _make_quiet() -> Any:
    from llama_cpp import llama_cpp as ll

    return ll.llama_log_callback(_silent)


_quiet = _make_quiet()  # kept alive for as long as llama.cpp may call it


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
