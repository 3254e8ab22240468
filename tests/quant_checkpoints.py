"""Quantized Hugging Face checkpoints made by the tests, independently of edgeinfer's converter.

`quantize_folder(src, dst, fmt, **options)` reads a float HF folder (e.g. from
`hf_models.make_random_hf_model`), quantizes every linear layer of its decoder blocks the way the
format's own tools do (round-to-nearest; the calibration those tools add changes the numbers, not
the storage), packs it with the format's published layout, written here from the reference code's
description (AutoAWQ `pack`, AutoGPTQ/gptqmodel `pack`, compressed-tensors `pack_to_int32`,
transformers' finegrained FP8), and returns the test's own dequantization of each layer:
{HF name: float32 [out, in]}. Nothing here imports edgeinfer.

Formats: "fp8-block" (E4M3, weight_scale_inv per 128x128 block), "fp8-channel" (compressed-tensors
float-quantized, weight_scale [out, 1]), "awq" (GEMM, asymmetric), "gptq" (bits, sym, v2, act_order),
"ct-pack" (compressed-tensors pack-quantized: bits, sym, group or channel).
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["quantize_folder", "rewrite_folder", "write_raw_safetensors", "e4m3_values", "LINEAR"]

LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NP = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "I64": "<i8", "I8": "i1", "F8_E4M3": "u1", "U8": "u1"}


def write_raw_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> Path:
    """Write tensors given as (safetensors dtype code, array); BF16 arrays are given as uint16 bits."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, (code, arr) in tensors.items():
        raw = np.ascontiguousarray(arr, dtype=np.dtype(_NP.get(code, "<u2"))).tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for b in blobs:
            f.write(b)
    return Path(path)


def _read(folder: Path) -> dict[str, np.ndarray]:
    from numpy_reference import load_hf_weights

    return {name: w.astype(np.float32) for name, w in load_hf_weights(folder)[1].items()}  # float64 holds them exactly


# -- FP8 E4M3 (OCP "fn": no infinities, S.1111.111 is NaN) -------------------------------------------
@functools.lru_cache(maxsize=1)
def e4m3_values() -> np.ndarray:
    vals = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 15 and m == 7:
            vals.append(math.nan)
        elif e == 0:
            vals.append(sign * (m / 8) * 2.0**-6)
        else:
            vals.append(sign * (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


def _to_e4m3(x: np.ndarray) -> np.ndarray:
    """Nearest E4M3 bit pattern of each value (|x| <= 448 assumed)."""
    vals = e4m3_values()
    codes = np.flatnonzero(~np.isnan(vals))
    order = codes[np.argsort(vals[codes], kind="stable")]
    sorted_vals = vals[order]
    i = np.clip(np.searchsorted(sorted_vals, x), 1, len(sorted_vals) - 1)
    left, right = sorted_vals[i - 1], sorted_vals[i]
    pick = np.where(np.abs(x - left) <= np.abs(right - x), i - 1, i)
    return order[pick].astype(np.uint8)


# -- integer quantization (round to nearest, per group of input columns) -----------------------------
def _int_quantize(w: np.ndarray, group_of: np.ndarray, bits: int, sym: bool, min_zero: int = 0):
    """w [out, in] -> q uint8 [out, in], scale f16 [out, G], zero int [out, G] with w ~ (q - zero) * scale."""
    out, _ = w.shape
    n_g = int(group_of.max()) + 1
    top = (1 << bits) - 1
    q = np.zeros(w.shape, np.uint8)
    scale = np.zeros((out, n_g), np.float16)
    zero = np.zeros((out, n_g), np.int64)
    for g in range(n_g):
        cols = np.flatnonzero(group_of == g)
        block = w[:, cols].astype(np.float64)
        if sym:
            s = (np.abs(block).max(axis=1) / ((1 << (bits - 1)) - 1)).astype(np.float16)
            z = np.full(out, 1 << (bits - 1))
        else:
            lo, hi = np.minimum(block.min(axis=1), 0), np.maximum(block.max(axis=1), 0)
            s = ((hi - lo) / top).astype(np.float16)
            z = np.clip(np.round(-lo / s.astype(np.float64)), min_zero, top).astype(np.int64)
        qq = np.clip(np.round(block / s.astype(np.float64)[:, None]) + z[:, None], 0, top)
        q[:, cols] = qq.astype(np.uint8)
        scale[:, g], zero[:, g] = s, z
    return q, scale, zero


def _dequant(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, group_of: np.ndarray) -> np.ndarray:
    """The formats' own dequantization, (q - zero) * scale, in float32."""
    return (q.astype(np.float32) - zero[:, group_of].astype(np.float32)) * scale[:, group_of].astype(np.float32)


def _pack_fields(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Sequential packing (field j of a word in bits j*bits..) of unsigned values along `axis`."""
    pf = 32 // bits
    v = values.astype(np.uint32)
    if axis == 0:
        pad = -v.shape[0] % pf
        v = np.pad(v, ((0, pad), (0, 0)))
        out = np.zeros((v.shape[0] // pf, v.shape[1]), np.uint32)
        for j in range(pf):
            out |= v[j::pf, :] << np.uint32(bits * j)
    else:
        pad = -v.shape[1] % pf
        v = np.pad(v, ((0, 0), (0, pad)))
        out = np.zeros((v.shape[0], v.shape[1] // pf), np.uint32)
        for j in range(pf):
            out |= v[:, j::pf] << np.uint32(bits * j)
    return out.view(np.int32)


def _pack_awq(values: np.ndarray) -> np.ndarray:
    """AutoAWQ GEMM: 8 nibbles per int32 along the columns, column 8c + order[i] in bits 4i."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    v = values.astype(np.uint32)
    out = np.zeros((v.shape[0], v.shape[1] // 8), np.uint32)
    for i in range(8):
        out |= v[:, order[i] :: 8] << np.uint32(4 * i)
    return out.view(np.int32)


# -- the formats ----------------------------------------------------------------------------------
def _layer(name: str, w: np.ndarray, fmt: str, o: dict[str, Any], rng: np.random.Generator):
    """Stored tensors {suffix: (code, array)} and the test's dequantized weight."""
    out, inp = w.shape
    if fmt == "fp8-block":
        b = o.get("block", 128)
        nbo, nbi = -(-out // b), -(-inp // b)
        padded = np.zeros((nbo * b, nbi * b))
        padded[:out, :inp] = w
        amax = np.abs(padded.reshape(nbo, b, nbi, b)).max(axis=(1, 3))
        scale = (np.maximum(amax, 1e-12) / 448.0).astype(np.float32)  # transformers' finegrained FP8
        full = np.repeat(np.repeat(scale, b, 0), b, 1)[:out, :inp]
        bits = _to_e4m3(w.astype(np.float64) / full.astype(np.float64))
        deq = (e4m3_values()[bits].astype(np.float32) * full).astype(np.float32)
        return {"weight": ("F8_E4M3", bits), "weight_scale_inv": ("F32", scale)}, deq
    if fmt == "fp8-channel":
        s = (np.abs(w).max(axis=1, keepdims=True) / 448.0).astype(np.float32)
        bits = _to_e4m3(w.astype(np.float64) / s.astype(np.float64))
        deq = e4m3_values()[bits].astype(np.float32) * s
        return {"weight": ("F8_E4M3", bits), "weight_scale": ("F32", s),
                "input_scale": ("F32", np.ones(1, np.float32))}, deq
    if fmt == "awq":
        g = o.get("group", 128)
        group_of = np.arange(inp) // g
        q, s, z = _int_quantize(w, group_of, 4, sym=False)
        # AutoAWQ keeps [in, out]: qweight [in, out/8], qzeros [in/g, out/8], scales [in/g, out].
        return {"qweight": ("I32", _pack_awq(q.T)), "qzeros": ("I32", _pack_awq(z.T)),
                "scales": ("F16", np.ascontiguousarray(s.T))}, _dequant(q, s, z, group_of)
    if fmt == "gptq":
        bits, g, sym, v2 = o.get("bits", 4), o.get("group", 128), o.get("sym", True), o.get("v2", False)
        if o.get("act_order"):
            perm = rng.permutation(inp)
            group_of = np.empty(inp, np.int64)
            group_of[perm] = np.arange(inp) // g
        else:
            group_of = np.arange(inp) // g
        q, s, z = _int_quantize(w, group_of, bits, sym, min_zero=0 if v2 else 1)
        stored_z = z if v2 else (z - 1)  # the legacy format stores zero - 1
        t = {"qweight": ("I32", _pack_fields(q.T, bits, axis=0)),
             "qzeros": ("I32", _pack_fields(stored_z.T & ((1 << bits) - 1), bits, axis=1)),
             "scales": ("F16", np.ascontiguousarray(s.T))}
        if o.get("act_order") or o.get("g_idx"):
            t["g_idx"] = ("I32", group_of.astype(np.int32))
        return t, _dequant(q, s, z, group_of)
    if fmt == "ct-pack":
        bits, sym, strategy = o.get("bits", 4), o.get("sym", True), o.get("strategy", "group")
        g = o.get("group", 128) if strategy == "group" else inp
        group_of = np.arange(inp) // g
        q, s, z = _int_quantize(w, group_of, bits, sym)
        half = 1 << (bits - 1)
        # compressed-tensors works in signed ints: q_s = q - half, zero_s = zero - half; packing adds half back.
        q_signed = q.astype(np.int16) - half
        t = {"weight_packed": ("I32", _pack_fields((q_signed + half).astype(np.uint8), bits, axis=1)),
             "weight_scale": ("F16", s), "weight_shape": ("I64", np.array([out, inp], np.int64))}
        if not sym:
            zero_signed = z - half
            t["weight_zero_point"] = ("I32", _pack_fields((zero_signed + half).astype(np.uint8), bits, axis=0))
        return t, _dequant(q, s, z, group_of)
    raise ValueError(fmt)


def _config(fmt: str, o: dict[str, Any]) -> dict[str, Any]:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [o.get("block", 128)] * 2}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": o.get("group", 128), "zero_point": True,
                "version": "gemm"}
    if fmt == "gptq":
        c = {"quant_method": "gptq", "bits": o.get("bits", 4), "group_size": o.get("group", 128),
             "desc_act": bool(o.get("act_order")), "sym": o.get("sym", True)}
        if o.get("v2"):
            c["checkpoint_format"] = "gptq_v2"
        return c
    if fmt == "fp8-channel":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
        qformat = "float-quantized"
    else:
        strategy = o.get("strategy", "group")
        weights = {"num_bits": o.get("bits", 4), "type": "int", "symmetric": o.get("sym", True),
                   "strategy": strategy, "group_size": o.get("group", 128) if strategy == "group" else None,
                   "dynamic": False}
        qformat = "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": qformat, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"]}


def rewrite_folder(src: Path, dst: Path, layer: Callable[[str, np.ndarray], dict[str, tuple[str, np.ndarray]]],
                   quantization: dict[str, Any] | None) -> None:
    """Copy the HF folder `src` to `dst` with every linear layer of its decoder blocks stored as the
    parts `layer(name, weight)` returns ({suffix: (dtype code, array)}) and `quantization` as
    config.json's quantization_config (None: none)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "config.json":
            shutil.copy(p, dst / p.name)
    stored: dict[str, tuple[str, np.ndarray]] = {}
    for name, w in _read(src).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".", 3)[-1] in LINEAR:
            stored |= {f"{module}.{k}": v for k, v in layer(name, w).items()}
        else:
            stored[name] = ("F32", w)
    write_raw_safetensors(dst / "model.safetensors", stored)
    config = json.loads((src / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def quantize_folder(src: Path, dst: Path, fmt: str, seed: int = 0, **options: Any) -> dict[str, np.ndarray]:
    """Write `src` quantized as `fmt` into `dst`; returns {HF weight name: the test's dequantized float32}."""
    rng = np.random.default_rng(seed)
    expected: dict[str, np.ndarray] = {}

    def layer(name: str, w: np.ndarray) -> dict[str, tuple[str, np.ndarray]]:
        parts, expected[name] = _layer(name, w, fmt, options, rng)
        return parts

    rewrite_folder(src, dst, layer, _config(fmt, options))
    return expected
