"""llama.cpp's drafting-head API, through llama-cpp-python 0.3.36's ctypes bindings, checked.

The functions that hand hidden states between contexts (`llama_set_embeddings_nextn`,
`llama_get_embeddings_nextn[_ith]`, `llama_set/get_embeddings_layer_inp`,
`llama_model_target_layer_ids[_n]`) are declared in llama.cpp's staging header `src/llama-ext.h`
without `extern "C"`: libllama exports them under C++-mangled names and the binding has none of
them. They take plain pointers and scalars, so ctypes calls them by those names; the mangled name
encodes the argument types, so a build whose signatures changed has no such symbol, and `ext()`
says so in one line instead of calling into the unknown. The rest (`llama_batch_ext_*`,
`llama_process`, `n_rs_seq`, `load_mtp`, `ctx_type`, `ctx_other`) is bound by llama-cpp-python and
checked by name. `llama_batch_ext_set_embd_state` is a stub in this llama.cpp (it returns false):
a hidden state rides in `llama_batch_ext_set_embd_token`, which copies the row.

llama.cpp aborts the process on some misuses of this API (an MTP context on a model loaded
without `load_mtp`, a layer-input read of a layer not extracted, a target layer id past the
target's depth); the callers (speculation/heads.py) check those in Python first.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ...errors import SpeculationError
from ...llama_backend import backend
from .runtime import require_fields

__all__ = ["HeadAPI", "ext", "ExtBatch", "PINNED_BINDING"]

PINNED_BINDING = "0.3.36"  # the llama-cpp-python whose llama.cpp these names and layouts are from

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
_BOUND = ("llama_batch_ext_init", "llama_batch_ext_free", "llama_batch_ext_clear", "llama_batch_ext_add_token",
          "llama_batch_ext_add_embd", "llama_batch_ext_set_embd_token", "llama_batch_ext_set_pos",
          "llama_batch_ext_set_output_logits", "llama_process", "llama_model_n_layer_nextn", "llama_n_rs_seq",
          "llama_embd", "llama_memory_seq_pos_max", "LLAMA_CONTEXT_TYPE_MTP", "LLAMA_PROCESS_TYPE_DECODE",
          "LLAMA_PROCESS_TYPE_ENCODE")


class HeadAPI:
    """The bound functions (mangled ones as attributes named as in `_MANGLED`) and `ll` itself."""

    def __init__(self, ll: Any):
        self.ll = ll
        version = getattr(ll, "__version__", None) or _binding_version()
        missing = [name for name in _BOUND if not hasattr(ll, name)]
        lib = getattr(getattr(ll, "llama_cpp", ll), "_lib", None)  # the package's CDLL lives in its llama_cpp module
        for name, (symbol, args, res) in _MANGLED.items():
            try:
                fn = lib[symbol]  # type: ignore[index]
            except (AttributeError, KeyError, TypeError):
                missing.append(symbol)
                continue
            fn.argtypes, fn.restype = args, res
            setattr(self, name, fn)
        try:
            require_fields(ll.llama_model_params, "load_mtp")
            require_fields(ll.llama_context_params, "n_rs_seq", "ctx_type", "ctx_other")
        except AttributeError as e:
            missing.append(str(e).split(":")[0])
        if missing:
            raise SpeculationError(
                f"drafting heads need llama-cpp-python {PINNED_BINDING} (this is {version}): its llama.cpp lacks "
                f"{', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}")


def _binding_version() -> str:
    try:
        import llama_cpp

        return str(llama_cpp.__version__)
    except Exception:  # noqa: BLE001 - only for the message
        return "an unknown version"


_api: HeadAPI | None = None


def ext() -> HeadAPI:
    """The checked head API of the installed binding (SpeculationError when it is not the pinned one)."""
    global _api
    if _api is None:
        _api = HeadAPI(backend())
    return _api


class ExtBatch:
    """A reusable `llama_batch_ext` of (token, position, sequence, hidden-state row, output) entries,
    or of embedding-only entries (an EAGLE-3 encoder's input). Rows are copied in when added."""

    def __init__(self, ctx: Any):
        self.api = ext()
        self.ctx = ctx
        self.ptr = self.api.ll.llama_batch_ext_init(ctx)
        if not self.ptr:
            raise SpeculationError("llama.cpp could not make a batch for a drafting head")
        self.n = 0
        self._pos = (ctypes.c_int32 * 4)()

    def clear(self) -> None:
        self.api.ll.llama_batch_ext_clear(self.ptr)
        self.n = 0

    @staticmethod
    def _embd(row: np.ndarray) -> Any:
        ll = ext().ll
        return ll.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[-1])

    def add(self, token: int | None, pos: int, seq: int, row: np.ndarray | None, output: bool) -> int:
        """One entry; returns its index (the row its logits and hidden state are read from)."""
        ll = self.api.ll
        if row is not None:
            row = np.ascontiguousarray(row, dtype=np.float32)
        if token is None:
            assert row is not None
            idx = ll.llama_batch_ext_add_embd(self.ptr, seq, self._embd(row))
            self._pos[0] = self._pos[1] = self._pos[2] = pos
        else:
            idx = ll.llama_batch_ext_add_token(self.ptr, seq, token)
            if idx >= 0 and row is not None and not ll.llama_batch_ext_set_embd_token(self.ptr, idx, self._embd(row)):
                idx = -2
            self._pos[0] = pos
        if idx < 0:
            raise SpeculationError(f"a drafting head's batch refused an entry (code {idx}: full, bad token or "
                                   "row width)")
        ll.llama_batch_ext_set_pos(self.ptr, idx, self._pos)
        ll.llama_batch_ext_set_output_logits(self.ptr, idx, output)
        self.n += 1
        return idx

    def process(self, *, encode: bool = False) -> None:
        """llama_process of the entries (then cleared); an error code is a SpeculationError."""
        ll = self.api.ll
        if self.n == 0:
            return
        kind = ll.LLAMA_PROCESS_TYPE_ENCODE if encode else ll.LLAMA_PROCESS_TYPE_DECODE
        rc = ll.llama_process(self.ctx, kind, self.ptr)
        self.clear()
        if rc != 0:
            raise SpeculationError(f"a drafting head's {'encode' if encode else 'decode'} failed (llama_process {rc})")

    def close(self) -> None:
        if self.ptr:
            self.api.ll.llama_batch_ext_free(self.ptr)
            self.ptr = None
