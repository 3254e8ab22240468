"""compressed-tensors: `pack-quantized` — `weight_packed` int32 [out, in*bits/32] of unsigned values
(signed + 2^(bits-1)) packed along the input, `weight_scale` [out, groups] (or [out, 1]),
`weight_zero_point` packed along the output (int32) or plain int8, `weight_shape`, optional
`weight_g_idx`; `int-quantized`: int8 `weight` with `weight_scale`/`weight_zero_point`;
`float-quantized`: FP8 (fp8.py). Which layers are quantized how: `config_groups` by target."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ...errors import ConversionError
from .base import FLOAT_DTYPES, Part, QuantScheme, QuantizedTensor, to_float32, unpack_fields
from .fp8 import FP8Tensor
from .integer import IntTensor

__all__ = ["CompressedTensorsScheme", "PackedTensor"]


class PackedTensor(IntTensor):
    """compressed-tensors pack-quantized (int32 `weight_packed`) and int-quantized (int8 `weight`)."""

    def __init__(self, name: str, parts: dict[str, Part], bits: int, symmetric: bool, group: int | None):
        packed = "weight_packed" in parts
        self._half = 1 << (bits - 1)
        self.bits = bits
        if packed:
            wp, ws = parts["weight_packed"], parts.get("weight_shape")
            if wp.entry.dtype != "I32" or len(wp.entry.shape) != 2:
                raise ConversionError(f"compressed-tensors tensor {name}: weight_packed must be a 2-D int32 tensor")
            if ws is None:
                raise ConversionError(f"compressed-tensors tensor {name}: missing weight_shape")
            shape = tuple(int(v) for v in ws.array().reshape(-1))
            pf = 32 // bits
            if len(shape) != 2 or shape[0] != wp.entry.shape[0] or -(-shape[1] // pf) != wp.entry.shape[1]:
                raise ConversionError(f"compressed-tensors tensor {name}: weight_shape {list(shape)} does not match "
                                      f"weight_packed {list(wp.entry.shape)} at {bits} bits")
        else:
            w = parts.get("weight")
            if w is None or w.entry.dtype != "I8" or len(w.entry.shape) != 2:
                raise ConversionError(f"compressed-tensors tensor {name}: weight must be a 2-D int8 tensor")
            shape = w.entry.shape
        super().__init__(name, "compressed-tensors", (shape[0], shape[1]), parts)
        out, inp = self.shape
        s = self._part("weight_scale", FLOAT_DTYPES)
        ss = s.entry.shape
        if math.prod(ss) == 1:
            n_g, self._scale_rows = 1, False
        elif len(ss) == 2 and ss[0] == out:
            n_g, self._scale_rows = ss[1], True
        elif ss == (out,):
            n_g, self._scale_rows = 1, True
        else:
            raise self._bad(f"weight_scale has shape {list(ss)}, expected [{out}, groups]")
        if "weight_g_idx" in parts:
            self._part("weight_g_idx", ("I32", "I64"), (inp,))
            self.groups = parts["weight_g_idx"].array().astype(np.int64)
            self._check_groups(n_g)
        elif n_g == 1:
            self.groups = np.zeros(inp, dtype=np.int64)
        else:
            g = group or inp // n_g
            if inp % g or inp // g != n_g:
                raise self._bad(f"group size {g} does not divide the input dimension {inp} into {n_g} groups")
            self.groups = np.arange(inp) // g
        self._n_g = n_g
        self._zp: str | None = None
        if not symmetric:
            zp = parts.get("weight_zero_point")
            if zp is None:
                raise self._bad("asymmetric, but missing weight_zero_point")
            pf = 32 // bits
            if zp.entry.dtype == "I32" and zp.entry.shape == (-(-out // pf), n_g):
                self._zp, self.row_align = "packed", pf
            elif zp.entry.dtype == "I8" and math.prod(zp.entry.shape) in (out * n_g, 1):
                self._zp = "int8"
            else:
                raise self._bad(f"weight_zero_point {zp.entry.dtype}{list(zp.entry.shape)} is neither packed int32 "
                                f"[{-(-out // pf)}, {n_g}] nor int8 [{out}, {n_g}]")

    def q(self, r0: int, r1: int) -> np.ndarray:
        if "weight_packed" in self.parts:
            return unpack_fields(self.parts["weight_packed"].array()[r0:r1], self.bits, axis=1)[:, : self.shape[1]]
        return (self.parts["weight"].array()[r0:r1].astype(np.int16) + self._half).astype(np.uint8)

    def scales(self, r0: int, r1: int) -> np.ndarray:
        s = self.parts["weight_scale"]
        v = to_float32(s.array(), s.entry.dtype)
        if not self._scale_rows:
            return np.broadcast_to(v.reshape(1, 1), (r1 - r0, 1))
        return v.reshape(self.shape[0], -1)[r0:r1]

    def zeros(self, r0: int, r1: int) -> np.ndarray:
        if self._zp is None:
            return np.full((r1 - r0, self._n_g), float(self._half), np.float32)
        zp = self.parts["weight_zero_point"].array()
        if self._zp == "packed":
            pf = 32 // self.bits
            z = unpack_fields(zp[r0 // pf : -(-r1 // pf)], self.bits, axis=0)[: r1 - r0]
            return z.astype(np.float32)
        z = zp.reshape(-1, self._n_g)
        z = np.broadcast_to(z, (self.shape[0], self._n_g)) if z.shape[0] == 1 else z
        return z[r0:r1].astype(np.float32) + self._half


def _matches(module: str, targets: list[str]) -> bool:
    for t in targets:
        if t == "Linear":
            return True  # every 2-D weight this converter reads is an nn.Linear or an embedding
        if t.startswith("re:"):
            if re.match(t[3:], module):
                return True
        elif module == t or module.endswith("." + t):
            return True
    return False


@dataclass
class CompressedTensorsScheme(QuantScheme):
    method: ClassVar[str] = "compressed-tensors"
    supported: ClassVar[str] = "compressed-tensors (float-quantized, pack-quantized, int-quantized, naive-quantized)"
    suffixes: ClassVar[tuple[str, ...]] = ("weight", "weight_packed", "weight_scale", "weight_zero_point",
                                           "weight_shape", "weight_g_idx")
    skipped: ClassVar[tuple[str, ...]] = ("input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale")

    def __post_init__(self) -> None:
        qc = self.config
        self.groups: list[tuple[list[str], dict[str, Any], str]] = []
        fmt = str(qc.get("format") or "")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ConversionError("quantization_config (compressed-tensors) has no config_groups")
        for gname, g in groups.items():
            if not isinstance(g, dict):
                raise ConversionError(f"quantization_config (compressed-tensors): group {gname!r} is not an object")
            w = g.get("weights")
            if not isinstance(w, dict):
                continue  # activation-only groups keep float weights
            targets = g.get("targets") or ["Linear"]
            gfmt = str(g.get("format") or fmt)
            if gfmt == "dense":
                continue  # stored unquantized
            if gfmt not in ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized"):
                raise ConversionError(f"compressed-tensors format {gfmt!r} is not supported; supported: {self.supported}")
            kind = str(w.get("type", "int"))
            bits = w.get("num_bits", 8)
            strategy = str(w.get("strategy", "tensor"))
            if strategy not in ("tensor", "channel", "group", "block"):
                raise ConversionError(f"compressed-tensors strategy {strategy!r} is not supported; supported: tensor, channel, group, block")
            if kind == "int" and bits not in (4, 8):
                raise ConversionError(f"compressed-tensors int{bits} weights are not supported; supported: int4, int8")
            if kind == "float" and bits != 8:
                raise ConversionError(f"compressed-tensors float{bits} weights are not supported; supported: float8")
            if kind not in ("int", "float"):
                raise ConversionError(f"compressed-tensors weight type {kind!r} is not supported; supported: int, float")
            self.groups.append((list(targets), w, gfmt))
        self.ignore = [str(i) for i in qc.get("ignore") or []]

    def _args(self, module: str) -> dict[str, Any] | None:
        if _matches(module, [i for i in self.ignore if i != "Linear"]):
            return None
        for targets, w, _fmt in self.groups:
            if _matches(module, targets):
                return w
        return None

    def is_quantized(self, module: str, parts: dict[str, Part]) -> bool:
        if "weight_packed" in parts:
            return True
        w = parts.get("weight")
        return w is not None and w.entry.dtype not in FLOAT_DTYPES

    def make(self, name: str, parts: dict[str, Part]) -> QuantizedTensor:
        module = name.rpartition(".")[0]
        w = self._args(module)
        if w is None:
            raise ConversionError(f"compressed-tensors tensor {name} is stored quantized, but no config group targets it")
        group = w.get("group_size")
        if w.get("type") == "float":
            block = w.get("block_structure")
            return FP8Tensor(name, "compressed-tensors", parts, "weight_scale",
                             block=tuple(block) if isinstance(block, list) and len(block) == 2 else None,
                             group=group if isinstance(group, int) and group > 0 else None)
        return PackedTensor(name, parts, int(w.get("num_bits", 8)), bool(w.get("symmetric", True)),
                            group if isinstance(group, int) and group > 0 else None)
