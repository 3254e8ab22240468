"""AWQ GEMM: `qweight` int32 [in, out/8] packed along the output in the order [0,2,4,6,1,3,5,7],
`qzeros` int32 [in/g, out/8] (same order), `scales` [in/g, out]; w = (q - z) * s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...errors import ConversionError
from .base import FLOAT_DTYPES, Part, QuantScheme, QuantizedTensor, config_int, unpack_fields
from .integer import IntTensor, group_index

__all__ = ["AWQScheme", "AWQTensor"]

_AWQ_REVERSE_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # inverse of AWQ's packing order [0,2,4,6,1,3,5,7]


class AWQTensor(IntTensor):
    row_align = 8

    def __init__(self, name: str, parts: dict[str, Part], bits: int, group: int):
        qw = parts.get("qweight")
        if qw is None or qw.entry.dtype != "I32" or len(qw.entry.shape) != 2:
            raise ConversionError(f"awq tensor {name}: qweight must be a 2-D int32 tensor")
        inp, out8 = qw.entry.shape
        super().__init__(name, "awq", (out8 * 8, inp), parts)
        self.bits = bits
        self.groups = group_index(inp, group, "group_size", name, "awq")
        n_g = int(self.groups.max()) + 1 if inp else 1
        self._part("qzeros", ("I32",), (n_g, out8))
        self._part("scales", FLOAT_DTYPES, (n_g, out8 * 8))

    def _unpack_out(self, words: np.ndarray) -> np.ndarray:  # [k, c] words -> [c*8, k] in column order
        nib = unpack_fields(words, 4, axis=1).reshape(words.shape[0], -1, 8)[:, :, _AWQ_REVERSE_ORDER]
        return nib.reshape(words.shape[0], -1).T

    def q(self, r0: int, r1: int) -> np.ndarray:
        return self._unpack_out(self.parts["qweight"].array()[:, r0 // 8 : r1 // 8])

    def zeros(self, r0: int, r1: int) -> np.ndarray:
        return self._unpack_out(self.parts["qzeros"].array()[:, r0 // 8 : r1 // 8]).astype(np.float32)


@dataclass
class AWQScheme(QuantScheme):
    method: ClassVar[str] = "awq"
    supported: ClassVar[str] = "awq (gemm, 4-bit)"
    suffixes: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")

    def __post_init__(self) -> None:
        qc = self.config
        self.bits = config_int(qc, "bits", 4, "awq", "w_bit")
        self.group = config_int(qc, "group_size", 128, "awq", "q_group_size")
        version = str(qc.get("version", "gemm")).lower()
        if self.bits != 4:
            raise ConversionError(f"awq with {self.bits} bits is not supported; supported: 4-bit awq (gemm)")
        if version != "gemm":
            raise ConversionError(f"awq version {version!r} is not supported; supported: awq gemm")
        if qc.get("zero_point", True) is False:
            raise ConversionError("awq without zero points (zero_point: false) is not supported; supported: awq gemm with zero points")

    def make(self, name: str, parts: dict[str, Part]) -> QuantizedTensor:
        return AWQTensor(name, parts, self.bits, self.group)
