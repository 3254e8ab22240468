"""GPTQ: `qweight` int32 [in*bits/32, out] packed along the input (element j in bits j*bits..),
`qzeros` int32 [groups, out*bits/32] packed along the output, stored as zero - 1 by the legacy
`gptq` checkpoint format (not by `gptq_v2`), `scales` [groups, out], `g_idx` [in] (act-order)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...errors import ConversionError
from .base import FLOAT_DTYPES, Part, QuantScheme, QuantizedTensor, config_int, unpack_fields
from .integer import IntTensor, group_index

__all__ = ["GPTQScheme", "GPTQTensor"]


class GPTQTensor(IntTensor):
    def __init__(self, name: str, parts: dict[str, Part], bits: int, group: int, zero_offset: int):
        qw = parts.get("qweight")
        if qw is None or qw.entry.dtype != "I32" or len(qw.entry.shape) != 2:
            raise ConversionError(f"gptq tensor {name}: qweight must be a 2-D int32 tensor")
        pf = 32 // bits
        in_pf, out = qw.entry.shape
        inp = in_pf * pf
        super().__init__(name, "gptq", (out, inp), parts)
        self.bits, self.row_align, self.zero_offset = bits, pf, zero_offset
        if out % pf:
            raise self._bad(f"output dimension {out} is not a multiple of {pf} (qzeros packing)")
        s = self._part("scales", FLOAT_DTYPES)
        if "g_idx" in parts:  # act-order: any input column may belong to any group
            n_g = s.entry.shape[0] if len(s.entry.shape) == 2 else 0
            self._part("g_idx", ("I32", "I64"), (inp,))
            self.groups = parts["g_idx"].array().astype(np.int64)
            self._check_groups(n_g)
        else:
            self.groups = group_index(inp, group, "group_size", name, "gptq")
            n_g = int(self.groups.max()) + 1 if inp else 1
        self._part("scales", FLOAT_DTYPES, (n_g, out))
        self._part("qzeros", ("I32",), (n_g, out // pf))

    def q(self, r0: int, r1: int) -> np.ndarray:
        return unpack_fields(self.parts["qweight"].array()[:, r0:r1], self.bits, axis=0).T

    def zeros(self, r0: int, r1: int) -> np.ndarray:
        pf = 32 // self.bits
        z = unpack_fields(self.parts["qzeros"].array()[:, r0 // pf : r1 // pf], self.bits, axis=1)
        return z.T.astype(np.float32) + self.zero_offset


@dataclass
class GPTQScheme(QuantScheme):
    method: ClassVar[str] = "gptq"
    supported: ClassVar[str] = "gptq (2/4/8-bit)"
    suffixes: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales", "g_idx")

    def __post_init__(self) -> None:
        qc = self.config
        self.bits = config_int(qc, "bits", 4, "gptq")
        self.group = config_int(qc, "group_size", 128, "gptq")
        fmt = str(qc.get("checkpoint_format") or (qc.get("meta") or {}).get("checkpoint_format") or "gptq").lower()
        if self.bits not in (2, 4, 8):
            raise ConversionError(f"gptq with {self.bits} bits is not supported; supported: gptq with 2, 4 or 8 bits")
        if fmt not in ("gptq", "gptq_v2"):
            raise ConversionError(f"gptq checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
        # The legacy format (AutoGPTQ, gptqmodel's "gptq") stores every zero point minus one.
        self.zero_offset = 1 if fmt == "gptq" else 0

    def make(self, name: str, parts: dict[str, Part]) -> QuantizedTensor:
        return GPTQTensor(name, parts, self.bits, self.group, self.zero_offset)
