"""FP4 checkpoints: NVFP4 and MXFP4 weights, read and carried into GGUF without re-rounding.

Both formats store E2M1 codes (4 bits: sign, 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5,
1, 1.5, 2, 3, 4, 6), two to a byte, the element of even index in the low nibble, plus one scale per
group of input columns:
- NVFP4 (compressed-tensors `nvfp4-pack-quantized`, NVIDIA ModelOpt `quant_algo: NVFP4`): groups
  of 16 with an FP8 E4M3 scale each, times a per-tensor float32 scale. compressed-tensors stores
  `weight_packed` [out, in/2], `weight_scale` [out, in/16], `weight_global_scale` [1] and defines
  w = code * (scale / global_scale); ModelOpt stores `weight` [out, in/2], `weight_scale`,
  `weight_scale_2` and defines w = code * (scale * scale_2).
- MXFP4 (compressed-tensors `mxfp4-pack-quantized`): groups of 32 with an E8M0 scale (a biased
  power of two, 2^(e-127)): `weight_packed` [out, in/2], `weight_scale` uint8 [out, in/32].

GGUF has both types (llama.cpp's block_nvfp4, block_mxfp4) with the same code points (kvalues_fp4
holds them doubled, and the scales are read halved), so carrying a tensor only moves nibbles:
- MXFP4: a block of 32 is the E8M0 byte as it is and 16 bytes whose byte j holds elements j and
  j+16: bit for bit the checkpoint's numbers.
- NVFP4: a block of 64 is four groups of 16, their four E4M3 bytes (read by llama.cpp as unsigned
  UE4M3: a negative scale is carried by flipping its group's sign bits instead, which is exact) and
  32 bytes whose byte 8s+j holds elements j and j+8 of group s. The per-tensor scale cannot go into
  the blocks without rounding the E4M3 scales again, so it goes where llama.cpp's own converter
  puts it: a separate F32 tensor `<name>.scale` of one value that llama.cpp multiplies into the
  matmul's result (`build_lora_mm`). ModelOpt's scale_2 is that value exactly; compressed-tensors'
  1/global_scale is rounded to float32 once (relative error at most 2^-24). llama.cpp applies
  `.scale` only to tensors some graphs multiply it in (`SCALED_TENSORS`); elsewhere an NVFP4 layer
  with a scale other than 1 is dequantized and written as the converter's other layers are.

transformers' own `mxfp4` method (OpenAI gpt-oss: quantization_config `quant_method: mxfp4`) stores
stacked expert weights as `<name>_blocks` uint8 [..., rows, in/32, 16] (the same nibble order) and
`<name>_scales` uint8 [..., rows, in/32]; `StackedMXFP4Tensor` reads one as [prod(...) * rows, in],
or every `step`-th row of it (gpt-oss interleaves its gate and up rows), into the same blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from gguf import GGMLQuantizationType as QT

from ...errors import ConversionError
from .base import DirectBlocks, Part, QuantizedTensor, QuantScheme
from .fp8 import FP8Tensor, fp8_to_float32

__all__ = ["E2M1_VALUES", "FP4Tensor", "StackedMXFP4Tensor", "MXFP4Scheme", "fp4_scheme_for", "scale_applied",
           "FP4_FORMATS"]

# E2M1 code -> value (bit 3 is the sign), as the OCP MX specification and both formats define it.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=np.float32)
FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
_NVFP4_GROUP, _MXFP4_GROUP = 16, 32
_NVFP4_BLOCK = 64  # GGUF block_nvfp4: four groups of 16

# GGUF tensors whose `.scale` the pinned llama.cpp multiplies in, per architecture (models/*.cpp:
# build_qkv takes wq_s/wk_s/wv_s, build_lora_mm the rest). qwen2's graph passes no FFN scales.
_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")
_FFN = ("ffn_gate", "ffn_up", "ffn_down")
SCALED_TENSORS: dict[str, frozenset[str]] = {
    "llama": frozenset((*_ATTN, *_FFN, "output")),
    "qwen3": frozenset((*_ATTN, *_FFN, "output")),
    "qwen2": frozenset((*_ATTN, "output")),
}


def scale_applied(arch: str, gguf_name: str) -> bool:
    """Whether llama.cpp multiplies `<gguf_name minus .weight>.scale` into this tensor's matmul."""
    kind = gguf_name.removesuffix(".weight").split(".")[-1]
    return kind in SCALED_TENSORS.get(arch, frozenset())


def e8m0_to_float32(raw: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> 2^(e-127) (exact; 255 is NaN)."""
    e = raw.astype(np.int32)
    return np.where(e == 255, np.float32(np.nan), np.ldexp(np.float32(1.0), e - 127)).astype(np.float32)


def _codes(packed: np.ndarray) -> np.ndarray:
    """uint8 [r, in/2] -> E2M1 codes [r, in], element 2i from the low nibble, 2i+1 from the high one."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def _pack_halves(codes: np.ndarray) -> np.ndarray:
    """codes [..., 2n] -> bytes [..., n]: element j in the low nibble, element j+n in the high one
    (the order of llama.cpp's FP4 blocks)."""
    n = codes.shape[-1] // 2
    return codes[..., :n] | (codes[..., n:] << 4)


class FP4Tensor(QuantizedTensor):
    """One NVFP4 or MXFP4 linear layer, [out, in]."""

    def __init__(self, name: str, method: str, kind: str, parts: dict[str, Any], packed: str,
                 global_key: str | None = None, global_inverse: bool = False):
        p = parts.get(packed)
        if p is None or p.entry.dtype != "U8" or len(p.entry.shape) != 2:
            raise ConversionError(f"{method} tensor {name}: {packed} must be a 2-D uint8 tensor")
        out, half = p.entry.shape
        super().__init__(name, method, (out, half * 2), parts)
        self.kind = kind  # "nvfp4" or "mxfp4"
        self._packed = packed
        self.group = _NVFP4_GROUP if kind == "nvfp4" else _MXFP4_GROUP
        inp = self.shape[1]
        if inp % self.group:
            raise self._bad(f"input dimension {inp} is not a multiple of the {kind} group of {self.group}")
        scale_dtypes = ("F8_E4M3",) if kind == "nvfp4" else ("U8", "F8_E8M0")
        self._part("weight_scale", scale_dtypes, (out, inp // self.group))
        if "weight_shape" in parts:
            ws = self._part("weight_shape", ("I64", "I32"), (2,))
            if tuple(int(v) for v in ws.array()) != self.shape:
                raise self._bad(f"weight_shape {list(ws.array())} does not match {packed} {list(p.entry.shape)}")
        self._global = 1.0  # the per-tensor multiplier, float32
        self._global_raw: float | None = None  # as stored (compressed-tensors: the divisor)
        self._global_inverse = global_inverse
        if global_key is not None:
            g = parts.get(global_key)
            if g is None:
                raise self._bad(f"missing {global_key}")
            if g.entry.dtype not in ("F32", "F16", "BF16") or math.prod(g.entry.shape) != 1:
                raise self._bad(f"{global_key} must be one float, got {g.entry.dtype}{list(g.entry.shape)}")
            raw = g.array().reshape(-1)
            value = float(raw.astype(np.float32)[0]) if g.entry.dtype != "BF16" else \
                float((raw.astype(np.uint32) << 16).view(np.float32)[0])
            if not math.isfinite(value) or value <= 0:
                raise self._bad(f"{global_key} is {value}, not a positive finite number")
            self._global_raw = value
            self._global = float(np.float32(1.0) / np.float32(value)) if global_inverse else value

    # -- the checkpoint's own numbers ------------------------------------------------------------
    def codes(self, r0: int, r1: int) -> np.ndarray:
        return _codes(self.parts[self._packed].array()[r0:r1])

    def scale_bytes(self, r0: int, r1: int) -> np.ndarray:
        return self.parts["weight_scale"].array()[r0:r1]

    def group_scales(self, r0: int, r1: int) -> np.ndarray:
        raw = self.scale_bytes(r0, r1)
        return fp8_to_float32(raw, "F8_E4M3") if self.kind == "nvfp4" else e8m0_to_float32(raw)

    def rows(self, r0: int, r1: int) -> np.ndarray:
        """The format's own dequantization in float32: code * (scale / global) for compressed-tensors
        NVFP4, code * (scale * scale_2) for ModelOpt, code * 2^(e-127) for MXFP4."""
        s = self.group_scales(r0, r1)
        if self._global_raw is not None:
            g = np.float32(self._global_raw)
            s = s / g if self._global_inverse else s * g
        x = E2M1_VALUES[self.codes(r0, r1)].reshape(r1 - r0, -1, self.group)
        return (x * s[:, :, None]).reshape(r1 - r0, -1)

    def tensor_scale(self) -> float | None:
        """The float32 per-tensor multiplier GGUF carries as `<name>.scale` (None: none is needed)."""
        return None if self.kind == "mxfp4" or self._global == 1.0 else self._global

    # -- straight into GGUF blocks ---------------------------------------------------------------
    def direct_type(self) -> QT | None:
        inp = self.shape[1]
        if self.kind == "mxfp4":
            return QT.MXFP4
        return QT.NVFP4 if inp % _NVFP4_BLOCK == 0 else None

    def direct_rows(self, qtype: QT, r0: int, r1: int) -> DirectBlocks:
        rows, g = r1 - r0, self.group
        codes = self.codes(r0, r1).reshape(rows, -1, g)
        scales = self.scale_bytes(r0, r1).copy()
        if self.kind == "nvfp4":
            negative = (scales & 0x80) != 0  # UE4M3 has no sign: move it onto the group's codes
            codes = np.where(negative[:, :, None], codes ^ 0x08, codes)
            scales &= 0x7F
            nb = self.shape[1] // _NVFP4_BLOCK
            qs = _pack_halves(codes).reshape(rows, nb, 32)
            data = np.concatenate([scales.reshape(rows, nb, 4), qs], axis=2)
            step = fp8_to_float32(scales, "F8_E4M3").astype(np.float64) * self._global
        else:
            data = np.concatenate([scales[:, :, None], _pack_halves(codes)], axis=2)
            step = e8m0_to_float32(scales).astype(np.float64)
        # The values llama.cpp computes with (times `.scale`), in float64 where they are exact.
        held = E2M1_VALUES[codes].astype(np.float64) * step[:, :, None]
        exact = self.rows(r0, r1).astype(np.float64).reshape(held.shape)
        err = float(np.abs(held - exact).max()) if held.size else 0.0
        return DirectBlocks(np.ascontiguousarray(data.reshape(rows, -1)), err)


class StackedMXFP4Tensor(FP4Tensor):
    """transformers' `mxfp4` weights: `blocks` uint8 [*lead, rows, G, 16] and `scales` uint8
    [*lead, rows, G], read as the 2-D [prod(lead) * rows / step, G * 32] tensor of every `step`-th
    row from `offset` (rows of the stack flattened: expert e's row r is row e * rows + r)."""

    def __init__(self, name: str, method: str, blocks: Part, scales: Part, step: int = 1, offset: int = 0):
        b, s = blocks.entry, scales.entry
        QuantizedTensor.__init__(self, name, method, (0, 0), {"blocks": blocks, "scales": scales})
        if b.dtype != "U8" or len(b.shape) < 3 or b.shape[-1] != 16:
            raise self._bad(f"{b.name} must be uint8 [..., rows, in/32, 16], got {b.dtype}{list(b.shape)}")
        if s.dtype not in ("U8", "F8_E8M0") or s.shape != b.shape[:-1]:
            raise self._bad(f"{s.name} is {s.dtype}{list(s.shape)}, expected uint8 {list(b.shape[:-1])} "
                            f"(one E8M0 scale per 16 bytes of {b.name})")
        if b.shape[-3] % step:
            raise self._bad(f"{b.name} has {b.shape[-3]} rows per stack, not a multiple of {step}")
        # what FP4Tensor's reading uses; MXFP4 has no per-tensor scale
        self.kind, self.group, self._global, self._global_raw, self._global_inverse = "mxfp4", _MXFP4_GROUP, 1.0, None, False
        self.stack = (*b.shape[:-3], b.shape[-3] // step)  # the GGUF tensor's outer dimensions
        self._groups, self._step, self._offset = b.shape[-2], step, offset
        self._src_rows = math.prod(b.shape[:-2])
        self.shape = (self._src_rows // step, self._groups * _MXFP4_GROUP)

    def split(self, *names: str) -> list[StackedMXFP4Tensor]:
        """One tensor per name, of interleaved rows: row i of the k-th is row len(names) * i + k
        (gpt-oss: gate rows even, up rows odd)."""
        return [StackedMXFP4Tensor(n, self.method, self.parts["blocks"], self.parts["scales"], len(names), k)
                for k, n in enumerate(names)]

    def _rows_of(self, key: str, width: int, r0: int, r1: int) -> np.ndarray:
        a = self.parts[key].array().reshape(self._src_rows, width)
        return a[self._offset + self._step * r0 : self._offset + self._step * r1 : self._step]

    def codes(self, r0: int, r1: int) -> np.ndarray:
        return _codes(self._rows_of("blocks", self._groups * 16, r0, r1))

    def scale_bytes(self, r0: int, r1: int) -> np.ndarray:
        return np.ascontiguousarray(self._rows_of("scales", self._groups, r0, r1))


@dataclass
class MXFP4Scheme(QuantScheme):
    """transformers' `mxfp4` (gpt-oss): every `<name>_blocks` with its `<name>_scales` is one
    StackedMXFP4Tensor named `<name>`; which names an architecture expects is its business."""

    method: ClassVar[str] = "mxfp4"
    supported: ClassVar[str] = "mxfp4 (gpt-oss *_blocks/*_scales)"

    def tensors(self, ckpt: Any) -> tuple[dict[str, QuantizedTensor], set[str]]:
        names = set(ckpt.names)
        bases = sorted({n.rsplit("_", 1)[0] for n in names if n.endswith(("_blocks", "_scales"))})
        out: dict[str, QuantizedTensor] = {}
        for base in bases:
            b, s = base + "_blocks", base + "_scales"
            for have, need in ((b, s), (s, b)):
                if need not in names:
                    raise ConversionError(f"mxfp4 tensor {base}: {have} without {need}")
            out[base] = StackedMXFP4Tensor(base, self.method, Part(ckpt.where[b], ckpt.entry(b)),
                                           Part(ckpt.where[s], ckpt.entry(s)))
        return out, {base + sfx for base in bases for sfx in ("_blocks", "_scales")}

# -- schemes ---------------------------------------------------------------------------------------
_NVFP4_SKIPPED = ("input_scale", "input_global_scale", "k_scale", "v_scale", "output_scale")


def _is_fp4_packed(parts: dict[str, Any], key: str) -> bool:
    p = parts.get(key)
    return p is not None and p.entry.dtype == "U8" and "weight_scale" in parts


@dataclass
class CompressedFP4Scheme(QuantScheme):
    """compressed-tensors `nvfp4-pack-quantized` / `mxfp4-pack-quantized` config groups."""

    method: ClassVar[str] = "compressed-tensors"
    supported: ClassVar[str] = "compressed-tensors FP4 (nvfp4-pack-quantized, mxfp4-pack-quantized)"
    suffixes: ClassVar[tuple[str, ...]] = ("weight_packed", "weight_scale", "weight_global_scale", "weight_shape",
                                           "weight_zero_point")
    skipped: ClassVar[tuple[str, ...]] = _NVFP4_SKIPPED

    def __post_init__(self) -> None:
        kinds = set()
        fmt = str(self.config.get("format") or "")
        for gname, g in (self.config.get("config_groups") or {}).items():
            if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
                continue
            gfmt = str(g.get("format") or fmt)
            if gfmt == "dense":
                continue
            if gfmt not in FP4_FORMATS:
                raise ConversionError(f"compressed-tensors: config group {gname!r} is {gfmt!r}; a checkpoint that "
                                      f"mixes it with FP4 groups is not supported")
            w = g["weights"]
            if w.get("type", "float") != "float" or w.get("num_bits", 4) != 4:
                raise ConversionError(f"compressed-tensors {gfmt} group {gname!r} has weights "
                                      f"{w.get('type')}{w.get('num_bits')}, expected float4")
            kinds.add(gfmt.split("-")[0])
        if not kinds:
            raise ConversionError("quantization_config (compressed-tensors) has no FP4 config group with weights")
        self.kinds = kinds

    def is_quantized(self, module: str, parts: dict[str, Any]) -> bool:
        return _is_fp4_packed(parts, "weight_packed")

    def make(self, name: str, parts: dict[str, Any]) -> QuantizedTensor:
        zp = parts.get("weight_zero_point")
        if zp is not None and np.any(zp.array()):  # the formats are symmetric: a stored zero point is all zeros
            raise ConversionError(f"compressed-tensors tensor {name}: FP4 with a non-zero weight_zero_point")
        nvfp4 = parts["weight_scale"].entry.dtype == "F8_E4M3"
        if ("nvfp4" if nvfp4 else "mxfp4") not in self.kinds:
            raise ConversionError(f"compressed-tensors tensor {name}: a {'nvfp4' if nvfp4 else 'mxfp4'} packing, "
                                  f"but the config declares {', '.join(sorted(self.kinds))} only")
        if nvfp4:
            return FP4Tensor(name, self.method, "nvfp4", parts, "weight_packed", "weight_global_scale",
                             global_inverse=True)
        return FP4Tensor(name, self.method, "mxfp4", parts, "weight_packed")


@dataclass
class ModelOptScheme(QuantScheme):
    """NVIDIA ModelOpt exports: NVFP4 (uint8 `weight` + E4M3 `weight_scale` + `weight_scale_2`) and
    FP8 (E4M3 `weight` + per-tensor `weight_scale`) layers, per tensor (MIXED_PRECISION too)."""

    method: ClassVar[str] = "modelopt"
    supported: ClassVar[str] = "modelopt (NVFP4, FP8)"
    suffixes: ClassVar[tuple[str, ...]] = ("weight", "weight_scale", "weight_scale_2")
    skipped: ClassVar[tuple[str, ...]] = _NVFP4_SKIPPED

    def __post_init__(self) -> None:
        algo = str(self.config.get("quant_algo") or "").upper()
        if algo not in ("NVFP4", "W4A16_NVFP4", "FP8", "MIXED_PRECISION"):
            raise ConversionError(f"modelopt quant_algo {algo or '(none)'!r} is not supported; supported: NVFP4, "
                                  "W4A16_NVFP4, FP8, MIXED_PRECISION")
        group = self.config.get("group_size", _NVFP4_GROUP)
        if algo.endswith("NVFP4") and group != _NVFP4_GROUP:
            raise ConversionError(f"modelopt NVFP4 with group_size {group!r} is not supported (NVFP4 groups are 16)")

    def is_quantized(self, module: str, parts: dict[str, Any]) -> bool:
        w = parts.get("weight")
        return w is not None and w.entry.dtype in ("U8", "F8_E4M3") and "weight_scale" in parts

    def make(self, name: str, parts: dict[str, Any]) -> QuantizedTensor:
        if parts["weight"].entry.dtype == "F8_E4M3":
            return FP8Tensor(name, self.method, parts, "weight_scale")
        return FP4Tensor(name, self.method, "nvfp4", parts, "weight",
                         "weight_scale_2" if "weight_scale_2" in parts else None)


def _modelopt_config(folder: Path) -> dict[str, Any] | None:
    """hf_quant_config.json's `quantization` (older ModelOpt exports have no quantization_config)."""
    import json

    path = folder / "hf_quant_config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConversionError(f"hf_quant_config.json is not valid JSON: {e}") from None
    q = data.get("quantization") if isinstance(data, dict) else None
    if not isinstance(q, dict):
        raise ConversionError("hf_quant_config.json has no `quantization` object")
    return {"quant_method": "modelopt", **q}


def fp4_scheme_for(config: dict[str, Any], folder: Path) -> QuantScheme | None:
    """The FP4-aware scheme of a checkpoint (ModelOpt, compressed-tensors FP4), or None to let
    the other schemes decide."""
    qc = config.get("quantization_config")
    if qc is None:
        qc = _modelopt_config(Path(folder))
        return ModelOptScheme(config=qc) if qc is not None else None
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method") or "").lower().replace("_", "-")
    if method == "modelopt":
        return ModelOptScheme(config={**(_modelopt_config(Path(folder)) or {}), **qc})
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        formats = {str(g.get("format") or qc.get("format") or "") for g in groups.values() if isinstance(g, dict)}
        if formats & set(FP4_FORMATS) or str(qc.get("format") or "") in FP4_FORMATS:
            return CompressedFP4Scheme(config=qc)
    return None
