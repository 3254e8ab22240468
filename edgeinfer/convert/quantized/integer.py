"""Integer weights with a scale and a zero point per group of inputs (AWQ, GPTQ, compressed-tensors
int): their dequantization, and the GGUF blocks that hold them as they are.

Where a GGUF block type holds the checkpoint's numbers as they are — 4-bit groups of a multiple of
32 along the input are Q4_1 blocks (d = scale, m = -scale * zero), or Q4_0 when every zero is 8;
8-bit symmetric groups are Q8_0 — `tensor.direct_type()` names it and `tensor.direct_rows()` packs
the GGUF blocks without a second rounding (only the f16 rounding of d and m), with the max error
against the dequantized rows.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from ...errors import ConversionError
from .base import DirectBlocks, QuantizedTensor, to_float32

__all__ = ["IntTensor", "group_index"]

_BLOCK = 32  # GGUF's Q4_0/Q4_1/Q8_0 block length


class IntTensor(QuantizedTensor):
    """Integer weights: w[o, i] = (q[o, i] - zero[o, g(i)]) * scale[o, g(i)], q and zero unsigned."""

    bits: int
    groups: np.ndarray  # g(i) for every input column

    def q(self, r0: int, r1: int) -> np.ndarray:  # uint8 [r, in]
        raise NotImplementedError

    def scales(self, r0: int, r1: int) -> np.ndarray:  # float32 [r, G]
        """AWQ's and GPTQ's layout, a float `scales` part of [groups, out] (compressed-tensors overrides it)."""
        s = self.parts["scales"]
        return to_float32(s.array()[:, r0:r1], s.entry.dtype).T

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


def group_index(inp: int, group: int, what: str, name: str, method: str) -> np.ndarray:
    if group <= 0 or group >= inp:
        return np.zeros(inp, dtype=np.int64)
    if inp % group:
        raise ConversionError(f"{method} tensor {name}: group size {group} does not divide the input dimension {inp} ({what})")
    return np.arange(inp) // group
