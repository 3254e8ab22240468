"""Squared input activations of every matmul, collected from llama.cpp's own forward pass.

llama-imatrix (tools/imatrix/imatrix.cpp) gives the context an eval callback (`cb_eval` of
llama_context_params, which ggml's scheduler calls for every graph node: first to ask whether the
node is wanted, then, once it is computed, with its data) and sums, for every weight matrix W of the
layers (`blk.*`) that a MUL_MAT node multiplies with activations X of at least 16 rows, x_j² over
the rows for every input column j (per matrix of a 3-D weight), and counts the rows. The binding
(llama-cpp-python 0.3.36) exposes `cb_eval` as a ctypes field, so the same callback is written
here: it reads `ggml_tensor` through its C layout (ggml.h of the pinned llama.cpp, checked against
libggml's own `ggml_tensor_overhead` and `ggml_get_name` before use) and libggml-base's functions.
Sums are kept in float64 (llama-imatrix: float32), so values agree with its file within float32's
rounding of a long sum. Mixture-of-experts matmuls (MUL_MAT_ID) are refused: nothing here tests them.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from .errors import InvalidModelError

__all__ = ["ActivationCollector", "ggml_library"]

_GGML_MAX_DIMS, _GGML_MAX_SRC, _GGML_MAX_NAME, _GGML_MAX_OP_PARAMS = 4, 10, 64, 64
_GGML_OP_MUL_MAT, _GGML_OP_MUL_MAT_ID = 29, 30  # enum ggml_op of the pinned ggml.h
_GGML_TYPE_F32 = 0
_GGML_OBJECT_SIZE = 32  # sizeof(struct ggml_object): ggml_tensor_overhead() is this plus the tensor
_MIN_ROWS = 16  # llama-imatrix skips matmuls of fewer rows (one-token decodes)


class GGMLTensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (_GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * _GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * _GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


_lib: Any = None


def ggml_library() -> Any:
    """libggml-base of the installed llama-cpp-python, with the signatures used here, checked
    against the layout above."""
    global _lib
    if _lib is not None:
        return _lib
    import llama_cpp

    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so")
    lib = ctypes.CDLL(path)
    lib.ggml_op_name.argtypes, lib.ggml_op_name.restype = [ctypes.c_int], ctypes.c_char_p
    lib.ggml_get_name.argtypes, lib.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    lib.ggml_nbytes.argtypes, lib.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
    lib.ggml_tensor_overhead.argtypes, lib.ggml_tensor_overhead.restype = [], ctypes.c_size_t
    lib.ggml_backend_buffer_is_host.argtypes, lib.ggml_backend_buffer_is_host.restype = [ctypes.c_void_p], ctypes.c_bool
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    size = lib.ggml_tensor_overhead() - _GGML_OBJECT_SIZE
    names = (lib.ggml_op_name(_GGML_OP_MUL_MAT), lib.ggml_op_name(_GGML_OP_MUL_MAT_ID))
    if size != ctypes.sizeof(GGMLTensor) or names != (b"MUL_MAT", b"MUL_MAT_ID"):
        raise InvalidModelError(f"this llama.cpp's ggml_tensor ({size} bytes, ops {names}) is not the one edgeinfer "
                                f"reads ({ctypes.sizeof(GGMLTensor)} bytes): reinstall llama-cpp-python==0.3.36")
    _lib = lib
    return lib


def _weight_name(raw: bytes) -> str:
    """`CUDA0#blk.0.attn_k.weight#0` -> `blk.0.attn_k.weight` (llama-imatrix's filter_tensor_name)."""
    name = raw.decode("utf-8", errors="replace")
    if "#" in name:
        name = name.split("#", 2)[1]
    return name


class ActivationCollector:
    """The eval callback: `callback` goes into llama_context_params.cb_eval; `sums[name]` is
    float64 [n_mat, n_cols] (sum of x_j² over rows), `counts[name]` the rows per matrix.

    An exception cannot cross into C: it is kept in `error` and the callback returns False, which
    stops the graph (llama_decode then fails); the caller raises `error`."""

    def __init__(self, cb_type: Any):
        self.lib = ggml_library()
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}
        self.error: BaseException | None = None
        self._buf = np.empty(0, np.uint8)
        self.callback = cb_type(self._on_node)  # keep a reference while the context lives

    def _on_node(self, ptr: int, ask: bool, _user: Any) -> bool:
        try:
            return self._wanted(ptr) if ask else self._collect(ptr)
        except BaseException as e:  # noqa: BLE001 - handed to the caller after llama_decode returns
            self.error = e
            return False

    def _wanted(self, ptr: int) -> bool:
        t = GGMLTensor.from_address(ptr)
        if t.op == _GGML_OP_MUL_MAT_ID:
            raise InvalidModelError("computing an importance matrix for a mixture-of-experts model is not supported")
        if t.op != _GGML_OP_MUL_MAT or not t.src[0] or not t.src[1]:
            return False
        src0, src1 = GGMLTensor.from_address(t.src[0]), GGMLTensor.from_address(t.src[1])
        if src1.ne[1] < _MIN_ROWS or src1.type != _GGML_TYPE_F32:
            return False
        return _weight_name(src0.name).startswith("blk.")

    def _activations(self, ptr: int, src1: GGMLTensor) -> np.ndarray:
        """src1's float32 values, [ne3, ne2, ne1, ne0] (a strided view of host memory, or a copy)."""
        ne = [int(src1.ne[i]) for i in range(4)]
        nb = [int(src1.nb[i]) for i in range(4)]
        if nb[0] != 4:
            raise InvalidModelError(f"activations of {self.lib.ggml_get_name(ptr)!r} are not contiguous rows")
        extent = sum((n - 1) * s for n, s in zip(ne, nb)) + 4
        if self.lib.ggml_backend_buffer_is_host(src1.buffer):
            buf: Any = (ctypes.c_char * extent).from_address(src1.data)
        else:  # on a device: copy it out (llama-imatrix does the same)
            size = self.lib.ggml_nbytes(ctypes.addressof(src1))
            if self._buf.size < size:
                self._buf = np.empty(size, np.uint8)
            self.lib.ggml_backend_tensor_get(ctypes.addressof(src1), self._buf.ctypes.data, 0, size)
            buf = self._buf
        return np.ndarray(ne[::-1], np.float32, buffer=buf, strides=nb[::-1])

    def _collect(self, ptr: int) -> bool:
        t = GGMLTensor.from_address(ptr)
        src0, src1 = GGMLTensor.from_address(t.src[0]), GGMLTensor.from_address(t.src[1])
        name = _weight_name(src0.name)
        n_mat = int(src0.ne[2] * src0.ne[3])
        x = self._activations(ptr, src1).astype(np.float64)
        ne0 = x.shape[3]
        acc = self.sums.get(name)
        if acc is None:
            acc = self.sums[name] = np.zeros((n_mat, ne0), np.float64)
            self.counts[name] = 0
        elif acc.shape != (n_mat, ne0):
            raise InvalidModelError(f"{name}: activations of width {ne0} after {acc.shape[1]}")
        sq = (x * x).sum(axis=2)  # [ne3, ne2, ne0]: over the rows of each matrix's slice
        for i3 in range(sq.shape[0]):
            for i2 in range(sq.shape[1]):  # llama-imatrix: mat_id = (i3 % ne3(W)) * ne2(W) + i2 % ne2(W)
                acc[(i3 % int(src0.ne[3])) * int(src0.ne[2]) + i2 % int(src0.ne[2])] += sq[i3, i2]
        if not np.isfinite(acc).all():
            raise InvalidModelError(f"non-finite activations reach {name}")
        self.counts[name] += int(src1.ne[1] * src1.ne[2] * src1.ne[3]) // n_mat
        return True
