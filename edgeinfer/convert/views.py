"""Logical float tensors made of parts of stored ones, read row block by row block like a quantized
layer (`QuantizedTensor`), so the converter streams them without a whole-tensor copy.

gpt-oss stores its experts fused and, in its BF16 releases, transposed: `gate_up_proj` [E, H, 2I]
(input-major, gate and up columns interleaved), `down_proj` [E, I, H], `gate_up_proj_bias` [E, 2I].
llama.cpp wants separate [E, I, H] gate and up stacks, a [E, H, I] down stack and [E, I] biases.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConversionError
from .quantized.base import FLOAT_DTYPES, Part, QuantizedTensor, to_float32

__all__ = ["ColumnsView", "TransposedStack"]

_METHOD = "checkpoint"


def _float_part(part: Part, ndim: int) -> Part:
    e = part.entry
    if e.dtype not in FLOAT_DTYPES or len(e.shape) != ndim:
        raise ConversionError(f"tensor {e.name} is {e.dtype}{list(e.shape)}; expected a {ndim}-D F32, F16 or BF16 tensor")
    return part


class _Strided(QuantizedTensor):
    """A view of every `step`-th slice from `offset` along a stored float tensor's last axis."""

    def __init__(self, name: str, part: Part, shape: tuple[int, ...], step: int, offset: int, what: str):
        if part.entry.shape[-1] % step:
            raise ConversionError(f"tensor {part.entry.name} has {part.entry.shape[-1]} {what}, not a multiple of {step}")
        super().__init__(name, _METHOD, shape, {"src": part})
        self._step, self._offset = step, offset

    @property
    def source_bytes(self) -> int:
        return self.parts["src"].entry.n_bytes // self._step


class ColumnsView(_Strided):
    """Every `step`-th column from `offset` of a stored [R, C] float tensor: [R, C / step]."""

    def __init__(self, name: str, part: Part, step: int = 1, offset: int = 0):
        rows, cols = _float_part(part, 2).entry.shape
        super().__init__(name, part, (rows, cols // step), step, offset, "columns")

    def rows(self, r0: int, r1: int) -> np.ndarray:
        p = self.parts["src"]
        return to_float32(np.ascontiguousarray(p.array()[r0:r1, self._offset :: self._step]), p.entry.dtype)


class TransposedStack(_Strided):
    """A stored [E, In, Out] float stack (x @ W per expert) as the [E * Out / step, In] rows of its
    transposes, keeping every `step`-th output from `offset`; `stack` is (E, Out / step)."""

    def __init__(self, name: str, part: Part, step: int = 1, offset: int = 0):
        experts, inp, out = _float_part(part, 3).entry.shape
        self.stack = (experts, out // step)
        super().__init__(name, part, (experts * out // step, inp), step, offset, "outputs per expert")

    def rows(self, r0: int, r1: int) -> np.ndarray:
        p = self.parts["src"]
        src, per = p.array(), self.stack[1]
        out = []
        r = r0
        while r < r1:  # one expert at a time: its outputs j0..j1 are columns of src[e]
            e, j0 = divmod(r, per)
            j1 = min(per, j0 + r1 - r)
            cols = src[e, :, self._offset + self._step * j0 : self._offset + self._step * j1 : self._step]
            out.append(to_float32(np.ascontiguousarray(cols.T), p.entry.dtype))
            r += j1 - j0
        return np.concatenate(out) if out else np.empty((0, self.shape[1]), np.float32)
