"""FP4 checkpoints made by the tests, independently of edgeinfer's converter.

`fp4_folder(src, dst, layout, **options)` reads a float HF folder (e.g. from
`hf_models.make_random_hf_model`), quantizes every linear layer of its decoder blocks to FP4 by
round-to-nearest, the way the formats' tools do (the calibration they add changes the numbers, not
the storage), and packs it with the format's published layout, written here from the formats'
descriptions:
- "nvfp4-ct": compressed-tensors `nvfp4-pack-quantized` (llm-compressor): `weight_packed` uint8
  [out, in/2] (element 2i in the low nibble), `weight_scale` F8_E4M3 [out, in/16],
  `weight_global_scale` F32 [1] = 448 * 6 / amax; w = code * (scale / global_scale).
- "nvfp4-modelopt": NVIDIA ModelOpt: `weight` uint8, `weight_scale` F8_E4M3, `weight_scale_2`
  F32 [] = amax / (6 * 448); w = code * (scale * scale_2). `hf_quant_config=True` puts the
  quantization in hf_quant_config.json only (older exports).
- "mxfp4-ct": compressed-tensors `mxfp4-pack-quantized`: `weight_packed` uint8, `weight_scale`
  uint8 [out, in/32] of E8M0 exponents e = floor(log2 amax) - 2 + 127; w = code * 2^(e - 127).

It returns each layer's dequantization twice: exactly (float64: every product here is exact in
float64) and by the format's published formula in float32. `negative_scales=True` stores some
NVFP4 group scales negated with their codes' signs flipped (the same numbers). Nothing here
imports edgeinfer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from quant_checkpoints import _to_e4m3, e4m3_values, rewrite_folder

__all__ = ["fp4_folder", "E2M1", "LAYOUTS"]

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
LAYOUTS = ("nvfp4-ct", "nvfp4-modelopt", "mxfp4-ct")


def _nearest_codes(x: np.ndarray) -> np.ndarray:
    """E2M1 codes of the nearest representable values (|x| clamped to 6)."""
    mags = E2M1[:8]
    a = np.minimum(np.abs(x), 6.0)
    idx = np.abs(a[..., None] - mags).argmin(axis=-1).astype(np.uint8)
    return idx | (np.signbit(x).astype(np.uint8) << 3)


def _pack_pairs(codes: np.ndarray) -> np.ndarray:
    """[out, in] codes -> [out, in/2] bytes: element 2i low nibble, 2i+1 high nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def _nvfp4(w: np.ndarray, modelopt: bool, negative: bool, rng: np.random.Generator):
    out, inp = w.shape
    groups = np.abs(w.astype(np.float64)).reshape(out, inp // 16, 16).max(axis=2)
    amax = float(np.abs(w).max())
    if modelopt:
        s2 = np.float32(amax / (6.0 * 448.0))
        bits = _to_e4m3(np.minimum(groups / 6.0 / float(s2), 448.0))
        step = e4m3_values()[bits] * float(s2)
    else:
        g = np.float32(448.0 * 6.0 / amax)
        bits = _to_e4m3(np.minimum(groups / 6.0 * float(g), 448.0))
        step = e4m3_values()[bits] / float(g)
    step_full = np.repeat(step, 16, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = _nearest_codes(np.where(step_full > 0, w / step_full, 0.0))
    if negative:  # -scale with every code's sign flipped: the same numbers
        flip = rng.random(bits.shape) < 0.3
        bits = np.where(flip, bits | 0x80, bits).astype(np.uint8)
        codes = np.where(np.repeat(flip, 16, axis=1), codes ^ 0x08, codes).astype(np.uint8)
    scale = e4m3_values()[bits]  # signed now
    exact = E2M1[codes] * np.repeat(scale, 16, axis=1) * (float(s2) if modelopt else 1.0 / float(g))
    scale32 = np.repeat(scale.astype(np.float32), 16, axis=1)
    published = E2M1[codes].astype(np.float32) * (scale32 * s2 if modelopt else scale32 / g)
    if modelopt:
        parts = {"weight": ("U8", _pack_pairs(codes)), "weight_scale": ("F8_E4M3", bits),
                 "weight_scale_2": ("F32", np.array(s2, np.float32).reshape(())),
                 "input_scale": ("F32", np.array(1.0, np.float32).reshape(()))}
    else:
        parts = {"weight_packed": ("U8", _pack_pairs(codes)), "weight_scale": ("F8_E4M3", bits),
                 "weight_global_scale": ("F32", np.array([g], np.float32)),
                 "input_global_scale": ("F32", np.array([1.0], np.float32))}
    return parts, exact, published


def _mxfp4(w: np.ndarray):
    out, inp = w.shape
    groups = np.abs(w.astype(np.float64)).reshape(out, inp // 32, 32).max(axis=2)
    with np.errstate(divide="ignore"):
        e = np.where(groups > 0, np.floor(np.log2(np.where(groups > 0, groups, 1.0))) - 2 + 127, 0)
    e = np.clip(e, 0, 254).astype(np.uint8)
    step = np.repeat(np.ldexp(1.0, e.astype(np.int64) - 127), 32, axis=1)
    codes = _nearest_codes(w / step)
    exact = E2M1[codes] * step
    published = (E2M1[codes] * step).astype(np.float32)  # powers of two: exact in float32 too
    return {"weight_packed": ("U8", _pack_pairs(codes)), "weight_scale": ("U8", e)}, exact, published


def _config(layout: str) -> dict[str, Any]:
    if layout == "nvfp4-modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    fmt = "nvfp4-pack-quantized" if layout == "nvfp4-ct" else "mxfp4-pack-quantized"
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "tensor_group" if layout == "nvfp4-ct" else "group",
               "group_size": 16 if layout == "nvfp4-ct" else 32}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "format": fmt}},
            "ignore": ["lm_head"]}


def fp4_folder(src: Path, dst: Path, layout: str, *, seed: int = 0, negative_scales: bool = False,
               hf_quant_config: bool = False) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Write `src` quantized as `layout` into `dst`; returns ({HF weight name: exact float64},
    {HF weight name: the published float32 formula})."""
    if layout not in LAYOUTS:
        raise ValueError(layout)
    rng = np.random.default_rng(seed)
    exact: dict[str, np.ndarray] = {}
    published: dict[str, np.ndarray] = {}

    def layer(name: str, w: np.ndarray) -> dict[str, tuple[str, np.ndarray]]:
        if layout == "mxfp4-ct":
            parts, exact[name], published[name] = _mxfp4(w)
        else:
            parts, exact[name], published[name] = _nvfp4(w, layout == "nvfp4-modelopt", negative_scales, rng)
        return parts

    rewrite_folder(src, dst, layer, None if hf_quant_config else _config(layout))
    if hf_quant_config:  # older ModelOpt exports: the quantization only in hf_quant_config.json
        q = {k: v for k, v in _config(layout).items() if k != "quant_method"}
        (Path(dst) / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt", "version": "0.29"}, "quantization": q}))
    return exact, published
