"""Quantized Hugging Face checkpoints (FP8, AWQ, GPTQ, compressed-tensors), dequantized in numpy.

`config.json`'s `quantization_config` names the method; `scheme_for(config, folder)` turns it into a
`QuantScheme`, which groups each quantized linear layer's stored parts (packed integers, scales,
zero points, group indices) into one `QuantizedTensor` that stands for the layer's `weight`:
`tensor.rows(r0, r1)` gives its float32 rows (output features) r0..r1, exactly as the format's own
reference code computes them (integer differences are exact; one float32 rounding of the product).
Every part is checked (dtype, shape, group size) before a byte of data is read.

Where a GGUF block type holds the checkpoint's numbers as they are — 4-bit groups of a multiple of
32 along the input are Q4_1 blocks (d = scale, m = -scale * zero), or Q4_0 when every zero is 8;
8-bit symmetric groups are Q8_0 — `tensor.direct_type()` names it and `tensor.direct_rows()` packs
the GGUF blocks without a second rounding (only the f16 rounding of d and m), with the max error
against the dequantized rows.

Packings (as their reference implementations write them):
- FP8 (`fp8`, `fbgemm_fp8`, compressed-tensors `float-quantized`): F8_E4M3/F8_E5M2 `weight` times
  `weight_scale_inv` (128x128 blocks, `weight_block_size`) or `weight_scale` (tensor, channel,
  group or block).
- AWQ GEMM: `qweight` int32 [in, out/8] packed along the output in the order [0,2,4,6,1,3,5,7],
  `qzeros` int32 [in/g, out/8] (same order), `scales` [in/g, out]; w = (q - z) * s.
- GPTQ: `qweight` int32 [in*bits/32, out] packed along the input (element j in bits j*bits..),
  `qzeros` int32 [groups, out*bits/32] packed along the output, stored as zero - 1 by the legacy
  `gptq` checkpoint format (not by `gptq_v2`), `scales` [groups, out], `g_idx` [in] (act-order).
- compressed-tensors `pack-quantized`: `weight_packed` int32 [out, in*bits/32] of unsigned values
  (signed + 2^(bits-1)) packed along the input, `weight_scale` [out, groups] (or [out, 1]),
  `weight_zero_point` packed along the output (int32) or plain int8, `weight_shape`, optional
  `weight_g_idx`; `int-quantized`: int8 `weight` with `weight_scale`/`weight_zero_point`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import ConversionError
from .safetensors import Checkpoint, SafetensorsFile, TensorEntry

__all__ = [
    "QuantScheme",
    "QuantizedTensor",
    "SUPPORTED_METHODS",
    "scheme_for",
    "fp8_to_float32",
]

SUPPORTED_METHODS = (
    "fp8 (block or channel scales), fbgemm_fp8, awq (gemm, 4-bit), gptq (2/4/8-bit), "
    "compressed-tensors (float-quantized, pack-quantized, int-quantized, naive-quantized, "
    "nvfp4-pack-quantized, mxfp4-pack-quantized), modelopt (NVFP4, FP8)"
)
_AWQ_REVERSE_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # inverse of AWQ's packing order [0,2,4,6,1,3,5,7]
_FLOAT_DTYPES = ("F32", "F16", "BF16")
_BLOCK = 32  # GGUF's Q4_0/Q4_1/Q8_0 block length


# -- element decoding ----------------------------------------------------------------------------
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


def _float(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def _unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their 32/bits unsigned fields (field j at bits j*bits..), spread along `axis`."""
    pf = 32 // bits
    u = words.view(np.uint32) if words.dtype == np.int32 else words.astype(np.uint32)
    shifts = (np.arange(pf, dtype=np.uint32) * bits)
    mask = np.uint32((1 << bits) - 1)
    if axis == 1:  # [r, c] -> [r, c * pf]
        out = (u[:, :, None] >> shifts) & mask
        return out.reshape(u.shape[0], -1).astype(np.uint8)
    out = (u[:, None, :] >> shifts[None, :, None]) & mask  # [r, c] -> [r * pf, c]
    return out.reshape(-1, u.shape[1]).astype(np.uint8)


# -- tensors -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Part:
    file: SafetensorsFile
    entry: TensorEntry

    def array(self) -> np.ndarray:
        return self.file.array(self.entry.name)


@dataclass(frozen=True)
class DirectBlocks:
    """GGUF block bytes of a row block and how far they are from the dequantized rows."""

    data: np.ndarray  # uint8 [rows, bytes per row]
    max_error: float


class QuantizedTensor:
    """One quantized linear layer's weight, [out, in] like the float tensor it stands for."""

    row_align: int = 1  # row blocks start at multiples of this (packing along the output)

    def __init__(self, name: str, method: str, shape: tuple[int, int], parts: dict[str, _Part]):
        self.name = name
        self.method = method
        self.shape = shape
        self.parts = parts

    @property
    def source_bytes(self) -> int:
        return sum(p.entry.n_bytes for p in self.parts.values())

    def release(self) -> None:
        for p in self.parts.values():
            p.file.release(p.entry.begin, p.entry.end)

    def rows(self, r0: int, r1: int) -> np.ndarray:  # pragma: no cover - every format overrides
        raise NotImplementedError

    def direct_type(self) -> QT | None:
        return None

    def tensor_scale(self) -> float | None:
        """A per-tensor multiplier GGUF must carry beside the direct blocks (`<name>.scale`), if any."""
        return None

    def direct_rows(self, qtype: QT, r0: int, r1: int) -> DirectBlocks:  # pragma: no cover
        raise NotImplementedError

    def _bad(self, what: str) -> ConversionError:
        return ConversionError(f"{self.method} tensor {self.name}: {what}")

    def _part(self, key: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None = None) -> _Part:
        p = self.parts.get(key)
        if p is None:
            raise self._bad(f"missing {key}")
        if p.entry.dtype not in dtypes:
            raise self._bad(f"{key} has dtype {p.entry.dtype}, expected {' or '.join(dtypes)}")
        if shape is not None and p.entry.shape != shape:
            raise self._bad(f"{key} has shape {list(p.entry.shape)}, expected {list(shape)}")
        return p


class FP8Tensor(QuantizedTensor):
    """FP8 weight times a float scale per tensor, output channel, input group or 2-D block."""

    def __init__(self, name: str, method: str, parts: dict[str, _Part], scale_key: str,
                 block: tuple[int, int] | None = None, group: int | None = None):
        w = parts.get("weight")
        if w is None or w.entry.dtype not in _FP8_TABLES or len(w.entry.shape) != 2:
            raise ConversionError(f"{method} tensor {name}: the weight is not a 2-D F8_E4M3/F8_E5M2 tensor")
        super().__init__(name, method, (w.entry.shape[0], w.entry.shape[1]), parts)
        out, inp = self.shape
        s = self._part(scale_key, _FLOAT_DTYPES)
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
        scale = _float(s.array(), s.entry.dtype)
        out, inp = self.shape
        bo, bi = self.block
        if self.kind == "tensor":
            return x * scale.reshape(1, 1)
        if self.kind == "channel":
            return x * scale.reshape(out, 1)[r0:r1]
        per_row = scale.reshape(-(-out // bo), -1)[np.arange(r0, r1) // bo]  # [r, blocks or groups]
        return x * np.repeat(per_row, bi, axis=1)[:, :inp]


class IntTensor(QuantizedTensor):
    """Integer weights: w[o, i] = (q[o, i] - zero[o, g(i)]) * scale[o, g(i)], q and zero unsigned."""

    bits: int
    groups: np.ndarray  # g(i) for every input column

    def q(self, r0: int, r1: int) -> np.ndarray:  # uint8 [r, in]
        raise NotImplementedError

    def scales(self, r0: int, r1: int) -> np.ndarray:  # float32 [r, G]
        raise NotImplementedError

    def zeros(self, r0: int, r1: int) -> np.ndarray:  # float32 [r, G], unsigned
        raise NotImplementedError

    def rows(self, r0: int, r1: int) -> np.ndarray:
        g = self.groups
        q = self.q(r0, r1).astype(np.float32)
        return (q - self.zeros(r0, r1)[:, g]) * self.scales(r0, r1)[:, g]

    def _check_groups(self, n_groups: int) -> None:
        g = self.groups
        if g.shape != (self.shape[1],):
            raise self._bad(f"g_idx has {g.shape[0]} entries for an input dimension of {self.shape[1]}")
        if g.size and (g.min() < 0 or g.max() >= n_groups):
            raise self._bad(f"g_idx names groups outside 0..{n_groups - 1}")

    def direct_type(self) -> QT | None:
        inp = self.shape[1]
        if inp % _BLOCK:
            return None
        blocks = self.groups.reshape(-1, _BLOCK)
        if not (blocks == blocks[:, :1]).all():
            return None  # an act-order permutation mixes groups within a 32-block
        zeros = self.zeros(0, self.shape[0])
        half = 1 << (self.bits - 1)
        if self.bits == 4:
            return QT.Q4_0 if (zeros == half).all() else QT.Q4_1
        if self.bits == 8 and (zeros == half).all():
            return QT.Q8_0
        return None

    def direct_rows(self, qtype: QT, r0: int, r1: int) -> DirectBlocks:
        bg = self.groups[::_BLOCK]
        q = self.q(r0, r1)
        rows = q.shape[0]
        nb = self.shape[1] // _BLOCK
        s = self.scales(r0, r1)[:, bg]
        z = self.zeros(r0, r1)[:, bg]
        d = s.astype(np.float16)
        qb = q.reshape(rows, nb, _BLOCK)
        if qtype == QT.Q8_0:
            out = np.empty((rows, nb, 34), np.uint8)
            out[..., :2] = d[..., None].view(np.uint8)
            qs = (qb.astype(np.int16) - 128).astype(np.int8)
            out[..., 2:] = qs.view(np.uint8)
            recon = qs.astype(np.float32) * d.astype(np.float32)[..., None]
        else:
            packed = qb[..., :16] | (qb[..., 16:] << 4)
            if qtype == QT.Q4_1:
                m = (-(s * z)).astype(np.float16)
                out = np.empty((rows, nb, 20), np.uint8)
                out[..., 0:2] = d[..., None].view(np.uint8)
                out[..., 2:4] = m[..., None].view(np.uint8)
                out[..., 4:] = packed
                recon = qb.astype(np.float32) * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]
            else:
                out = np.empty((rows, nb, 18), np.uint8)
                out[..., :2] = d[..., None].view(np.uint8)
                out[..., 2:] = packed
                recon = (qb.astype(np.float32) - 8.0) * d.astype(np.float32)[..., None]
        exact = (qb.astype(np.float32) - z[..., None]) * s[..., None]
        err = float(np.abs(recon - exact).max()) if recon.size else 0.0
        return DirectBlocks(out.reshape(rows, -1), err)


def _group_index(inp: int, group: int, what: str, name: str, method: str) -> np.ndarray:
    if group <= 0 or group >= inp:
        return np.zeros(inp, dtype=np.int64)
    if inp % group:
        raise ConversionError(f"{method} tensor {name}: group size {group} does not divide the input dimension {inp} ({what})")
    return np.arange(inp) // group


class AWQTensor(IntTensor):
    row_align = 8

    def __init__(self, name: str, parts: dict[str, _Part], bits: int, group: int):
        qw = parts.get("qweight")
        if qw is None or qw.entry.dtype != "I32" or len(qw.entry.shape) != 2:
            raise ConversionError(f"awq tensor {name}: qweight must be a 2-D int32 tensor")
        inp, out8 = qw.entry.shape
        super().__init__(name, "awq", (out8 * 8, inp), parts)
        self.bits = bits
        self.groups = _group_index(inp, group, "group_size", name, "awq")
        n_g = int(self.groups.max()) + 1 if inp else 1
        self._part("qzeros", ("I32",), (n_g, out8))
        self._part("scales", _FLOAT_DTYPES, (n_g, out8 * 8))

    def _unpack_out(self, words: np.ndarray) -> np.ndarray:  # [k, c] words -> [c*8, k] in column order
        nib = _unpack(words, 4, axis=1).reshape(words.shape[0], -1, 8)[:, :, _AWQ_REVERSE_ORDER]
        return nib.reshape(words.shape[0], -1).T

    def q(self, r0: int, r1: int) -> np.ndarray:
        return self._unpack_out(self.parts["qweight"].array()[:, r0 // 8 : r1 // 8])

    def zeros(self, r0: int, r1: int) -> np.ndarray:
        return self._unpack_out(self.parts["qzeros"].array()[:, r0 // 8 : r1 // 8]).astype(np.float32)

    def scales(self, r0: int, r1: int) -> np.ndarray:
        s = self.parts["scales"]
        return _float(s.array()[:, r0:r1], s.entry.dtype).T


class GPTQTensor(IntTensor):
    def __init__(self, name: str, parts: dict[str, _Part], bits: int, group: int, zero_offset: int):
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
        s = self._part("scales", _FLOAT_DTYPES)
        if "g_idx" in parts:  # act-order: any input column may belong to any group
            n_g = s.entry.shape[0] if len(s.entry.shape) == 2 else 0
            self._part("g_idx", ("I32", "I64"), (inp,))
            self.groups = parts["g_idx"].array().astype(np.int64)
            self._check_groups(n_g)
        else:
            self.groups = _group_index(inp, group, "group_size", name, "gptq")
            n_g = int(self.groups.max()) + 1 if inp else 1
        self._part("scales", _FLOAT_DTYPES, (n_g, out))
        self._part("qzeros", ("I32",), (n_g, out // pf))

    def q(self, r0: int, r1: int) -> np.ndarray:
        return _unpack(self.parts["qweight"].array()[:, r0:r1], self.bits, axis=0).T

    def zeros(self, r0: int, r1: int) -> np.ndarray:
        pf = 32 // self.bits
        z = _unpack(self.parts["qzeros"].array()[:, r0 // pf : r1 // pf], self.bits, axis=1)
        return z.T.astype(np.float32) + self.zero_offset

    def scales(self, r0: int, r1: int) -> np.ndarray:
        s = self.parts["scales"]
        return _float(s.array()[:, r0:r1], s.entry.dtype).T


class PackedTensor(IntTensor):
    """compressed-tensors pack-quantized (int32 `weight_packed`) and int-quantized (int8 `weight`)."""

    def __init__(self, name: str, parts: dict[str, _Part], bits: int, symmetric: bool, group: int | None):
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
        s = self._part("weight_scale", _FLOAT_DTYPES)
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
            return _unpack(self.parts["weight_packed"].array()[r0:r1], self.bits, axis=1)[:, : self.shape[1]]
        return (self.parts["weight"].array()[r0:r1].astype(np.int16) + self._half).astype(np.uint8)

    def scales(self, r0: int, r1: int) -> np.ndarray:
        s = self.parts["weight_scale"]
        v = _float(s.array(), s.entry.dtype)
        if not self._scale_rows:
            return np.broadcast_to(v.reshape(1, 1), (r1 - r0, 1))
        return v.reshape(self.shape[0], -1)[r0:r1]

    def zeros(self, r0: int, r1: int) -> np.ndarray:
        if self._zp is None:
            return np.full((r1 - r0, self._n_g), float(self._half), np.float32)
        zp = self.parts["weight_zero_point"].array()
        if self._zp == "packed":
            pf = 32 // self.bits
            z = _unpack(zp[r0 // pf : -(-r1 // pf)], self.bits, axis=0)[: r1 - r0]
            return z.astype(np.float32)
        z = zp.reshape(-1, self._n_g)
        z = np.broadcast_to(z, (self.shape[0], self._n_g)) if z.shape[0] == 1 else z
        return z[r0:r1].astype(np.float32) + self._half


# -- schemes -------------------------------------------------------------------------------------
def _int(qc: dict[str, Any], key: str, default: Any, method: str, *aliases: str) -> int:
    value = next((qc[k] for k in (key, *aliases) if k in qc), default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConversionError(f"quantization_config ({method}): {key} must be an integer, got {value!r}")
    return value


@dataclass
class QuantScheme:
    """How a checkpoint's quantized layers are stored; `tensors(ckpt)` groups their parts."""

    method: ClassVar[str] = ""
    suffixes: ClassVar[tuple[str, ...]] = ()  # stored parts of one layer, after its module name
    skipped: ClassVar[tuple[str, ...]] = ()  # parts GGUF does not need (activation scales)
    config: dict[str, Any] = field(default_factory=dict)

    def make(self, name: str, parts: dict[str, _Part]) -> QuantizedTensor | None:  # pragma: no cover
        raise NotImplementedError

    def is_quantized(self, module: str, parts: dict[str, _Part]) -> bool:
        return True

    def tensors(self, ckpt: Checkpoint) -> tuple[dict[str, QuantizedTensor], set[str]]:
        """{logical "<module>.weight": tensor}, and every stored name they (or skipping) consume."""
        by_module: dict[str, dict[str, _Part]] = {}
        consumed: set[str] = set()
        for name in ckpt.names:
            module, _, suffix = name.rpartition(".")
            if suffix in self.skipped:
                consumed.add(name)
            elif suffix in self.suffixes:
                by_module.setdefault(module, {})[suffix] = _Part(ckpt.where[name], ckpt.entry(name))
        out: dict[str, QuantizedTensor] = {}
        for module, parts in by_module.items():
            if not self.is_quantized(module, parts):
                continue
            t = self.make(f"{module}.weight", parts)
            if t is None:
                continue
            out[t.name] = t
            consumed.update(f"{module}.{s}" for s in parts)
        return out, consumed


@dataclass
class FP8Scheme(QuantScheme):
    method: ClassVar[str] = "fp8"
    suffixes: ClassVar[tuple[str, ...]] = ("weight", "weight_scale_inv", "weight_scale")
    skipped: ClassVar[tuple[str, ...]] = ("input_scale", "input_scale_inv", "activation_scale_ub")

    def is_quantized(self, module: str, parts: dict[str, _Part]) -> bool:
        return "weight" in parts and parts["weight"].entry.dtype in _FP8_TABLES

    def make(self, name: str, parts: dict[str, _Part]) -> QuantizedTensor:
        block = self.config.get("weight_block_size")
        if block is not None and not (isinstance(block, list) and len(block) == 2
                                      and all(isinstance(b, int) and b > 0 for b in block)):
            raise ConversionError(f"quantization_config (fp8): weight_block_size must be two positive integers, got {block!r}")
        key = "weight_scale_inv" if "weight_scale_inv" in parts else "weight_scale"
        if key not in parts:
            raise ConversionError(f"fp8 tensor {name}: missing weight_scale_inv (or weight_scale)")
        return FP8Tensor(name, "fp8", parts, key, block=tuple(block) if block else None)  # type: ignore[arg-type]


@dataclass
class AWQScheme(QuantScheme):
    method: ClassVar[str] = "awq"
    suffixes: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")

    def __post_init__(self) -> None:
        qc = self.config
        self.bits = _int(qc, "bits", 4, "awq", "w_bit")
        self.group = _int(qc, "group_size", 128, "awq", "q_group_size")
        version = str(qc.get("version", "gemm")).lower()
        if self.bits != 4:
            raise ConversionError(f"awq with {self.bits} bits is not supported; supported: 4-bit awq (gemm)")
        if version != "gemm":
            raise ConversionError(f"awq version {version!r} is not supported; supported: awq gemm")
        if qc.get("zero_point", True) is False:
            raise ConversionError("awq without zero points (zero_point: false) is not supported; supported: awq gemm with zero points")

    def make(self, name: str, parts: dict[str, _Part]) -> QuantizedTensor:
        return AWQTensor(name, parts, self.bits, self.group)


@dataclass
class GPTQScheme(QuantScheme):
    method: ClassVar[str] = "gptq"
    suffixes: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales", "g_idx")

    def __post_init__(self) -> None:
        qc = self.config
        self.bits = _int(qc, "bits", 4, "gptq")
        self.group = _int(qc, "group_size", 128, "gptq")
        fmt = str(qc.get("checkpoint_format") or (qc.get("meta") or {}).get("checkpoint_format") or "gptq").lower()
        if self.bits not in (2, 4, 8):
            raise ConversionError(f"gptq with {self.bits} bits is not supported; supported: gptq with 2, 4 or 8 bits")
        if fmt not in ("gptq", "gptq_v2"):
            raise ConversionError(f"gptq checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
        # The legacy format (AutoGPTQ, gptqmodel's "gptq") stores every zero point minus one.
        self.zero_offset = 1 if fmt == "gptq" else 0

    def make(self, name: str, parts: dict[str, _Part]) -> QuantizedTensor:
        return GPTQTensor(name, parts, self.bits, self.group, self.zero_offset)


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
                raise ConversionError(f"compressed-tensors format {gfmt!r} is not supported; supported: {SUPPORTED_METHODS}")
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

    def is_quantized(self, module: str, parts: dict[str, _Part]) -> bool:
        if "weight_packed" in parts:
            return True
        w = parts.get("weight")
        return w is not None and w.entry.dtype not in _FLOAT_DTYPES

    def make(self, name: str, parts: dict[str, _Part]) -> QuantizedTensor:
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


_SCHEMES: dict[str, type[QuantScheme]] = {
    "fp8": FP8Scheme,
    "fbgemm_fp8": FP8Scheme,
    "awq": AWQScheme,
    "gptq": GPTQScheme,
    "compressed-tensors": CompressedTensorsScheme,
}


def scheme_for(config: dict[str, Any], folder: Path) -> QuantScheme | None:
    """The checkpoint's quantization (config.json's quantization_config, or an AutoGPTQ
    quantize_config.json), or None for a float checkpoint. Unknown methods are one-line errors."""
    qc = config.get("quantization_config")
    if qc is None:
        legacy = Path(folder) / "quantize_config.json"
        if not legacy.is_file():
            return None
        try:
            qc = json.loads(legacy.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConversionError(f"quantize_config.json is not valid JSON: {e}") from None
        if isinstance(qc, dict):
            qc.setdefault("quant_method", "gptq")
    if not isinstance(qc, dict):
        raise ConversionError("config.json: quantization_config must be an object")
    method = str(qc.get("quant_method") or "").lower()
    if method == "compressed_tensors":
        method = "compressed-tensors"
    cls = _SCHEMES.get(method)
    if cls is None:
        raise ConversionError(f"quantization method {method or '(none)'!r} is not supported; supported: {SUPPORTED_METHODS}")
    return cls(config=qc)
