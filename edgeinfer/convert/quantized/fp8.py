"""FP8 (`fp8`, `fbgemm_fp8`, compressed-tensors `float-quantized`): F8_E4M3/F8_E5M2 `weight` times
`weight_scale_inv` (128x128 blocks, `weight_block_size`) or `weight_scale` (tensor, channel, group
or block)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...errors import ConversionError
from .base import FLOAT_DTYPES, Part, QuantizedTensor, QuantScheme, to_float32

__all__ = ["FP8Scheme", "FP8Tensor", "fp8_to_float32"]


def _fp8_table(exp_bits: int, man_bits: int, finite_only: bool) -> np.ndarray:
    """All 256 values of an 8-bit float format (E4M3FN: no infinities, S.1111.111 is NaN)."""
    bias = (1 << (exp_bits - 1)) - 1
    b = np.arange(256)
    sign = np.where(b >> 7, -1.0, 1.0)
    e = (b >> man_bits) & ((1 << exp_bits) - 1)
    m = b & ((1 << man_bits) - 1)
    frac = m / float(1 << man_bits)
    value = np.where(e == 0, frac * 2.0 ** (1 - bias), (1 + frac) * 2.0 ** (e.astype(np.float64) - bias))
    top = (1 << exp_bits) - 1
    if finite_only:
        value = np.where((e == top) & (m == (1 << man_bits) - 1), np.nan, value)
    else:
        value = np.where(e == top, np.where(m == 0, np.inf, np.nan), value)
    return (sign * value).astype(np.float32)


_FP8_TABLES = {"F8_E4M3": _fp8_table(4, 3, True), "F8_E5M2": _fp8_table(5, 2, False)}


def fp8_to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values of FP8 bits (uint8), `dtype` "F8_E4M3" or "F8_E5M2"; exact."""
    return _FP8_TABLES[dtype][raw]


class FP8Tensor(QuantizedTensor):
    """FP8 weight times a float scale per tensor, output channel, input group or 2-D block."""

    def __init__(self, name: str, method: str, parts: dict[str, Part], scale_key: str,
                 block: tuple[int, int] | None = None, group: int | None = None):
        w = parts.get("weight")
        if w is None or w.entry.dtype not in _FP8_TABLES or len(w.entry.shape) != 2:
            raise ConversionError(f"{method} tensor {name}: the weight is not a 2-D F8_E4M3/F8_E5M2 tensor")
        super().__init__(name, method, (w.entry.shape[0], w.entry.shape[1]), parts)
        out, inp = self.shape
        s = self._part(scale_key, FLOAT_DTYPES)
        ss = s.entry.shape
        self._scale_key = scale_key
        if math.prod(ss) == 1:
            self.kind, self.block = "tensor", (out, inp)
        elif ss in ((out,), (out, 1)):
            self.kind, self.block = "channel", (1, inp)
        elif block is not None:
            bo, bi = block
            if ss != (-(-out // bo), -(-inp // bi)):
                raise self._bad(f"{scale_key} has shape {list(ss)}; {bo}x{bi} blocks of {out}x{inp} need "
                                f"[{-(-out // bo)}, {-(-inp // bi)}]")
            self.kind, self.block = "block", (bo, bi)
        elif group is not None:
            if inp % group:
                raise self._bad(f"group size {group} does not divide the input dimension {inp}")
            if ss != (out, inp // group):
                raise self._bad(f"{scale_key} has shape {list(ss)}, expected [{out}, {inp // group}]")
            self.kind, self.block = "group", (1, group)
        else:
            raise self._bad(f"{scale_key} has shape {list(ss)}, which is neither per-tensor nor per-channel "
                            f"(and the config gives no block or group size)")

    def rows(self, r0: int, r1: int) -> np.ndarray:
        w = self.parts["weight"]
        x = fp8_to_float32(w.array()[r0:r1], w.entry.dtype)
        s = self.parts[self._scale_key]
        scale = to_float32(s.array(), s.entry.dtype)
        out, inp = self.shape
        bo, bi = self.block
        if self.kind == "tensor":
            return x * scale.reshape(1, 1)
        if self.kind == "channel":
            return x * scale.reshape(out, 1)[r0:r1]
        per_row = scale.reshape(-(-out // bo), -1)[np.arange(r0, r1) // bo]  # [r, blocks or groups]
        return x * np.repeat(per_row, bi, axis=1)[:, :inp]


@dataclass
class FP8Scheme(QuantScheme):
    method: ClassVar[str] = "fp8"
    supported: ClassVar[str] = "fp8 (block or channel scales), fbgemm_fp8"
    suffixes: ClassVar[tuple[str, ...]] = ("weight", "weight_scale_inv", "weight_scale")
    skipped: ClassVar[tuple[str, ...]] = ("input_scale", "input_scale_inv", "activation_scale_ub")

    def is_quantized(self, module: str, parts: dict[str, Part]) -> bool:
        return "weight" in parts and parts["weight"].entry.dtype in _FP8_TABLES

    def make(self, name: str, parts: dict[str, Part]) -> QuantizedTensor:
        block = self.config.get("weight_block_size")
        if block is not None and not (isinstance(block, list) and len(block) == 2
                                      and all(isinstance(b, int) and b > 0 for b in block)):
            raise ConversionError(f"quantization_config (fp8): weight_block_size must be two positive integers, got {block!r}")
        key = "weight_scale_inv" if "weight_scale_inv" in parts else "weight_scale"
        if key not in parts:
            raise ConversionError(f"fp8 tensor {name}: missing weight_scale_inv (or weight_scale)")
        return FP8Tensor(name, "fp8", parts, key, block=tuple(block) if block else None)  # type: ignore[arg-type]
