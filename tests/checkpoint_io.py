"""What the quantized-checkpoint tests share: reading a quantized folder with edgeinfer's reader,
editing its tensors or its quantization_config, and reading back a GGUF's tensors as llama.cpp
itself dequantizes them (libggml-base's `to_float` of each type, through ctypes)."""

from __future__ import annotations

import ctypes
import functools
import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from quant_checkpoints import write_raw_safetensors

__all__ = ["SMALL", "bare_folder", "float_folders", "dequantized_folder", "read_quantized", "edit_tensors", "edit_config",
           "gguf_dequantized", "ggml_dequantize", "rows_in_blocks"]

SMALL = dict(hidden=256, layers=1, heads=4, kv_heads=2, intermediate=512)  # dims multiples of 256

_CODES = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "I64": "<i8", "I8": "i1", "F8_E4M3": "u1", "U8": "u1"}


def bare_folder(folder: Path, shapes: dict[str, tuple[int, int]]) -> Path:
    """Random linear layers {HF weight name: [out, in]} and an empty config: what the format readers
    need, without a vocabulary."""
    from hf_models import write_safetensors

    rng = np.random.default_rng(1)
    write_safetensors(folder / "model.safetensors",
                      {name: (rng.standard_normal(shape) / 20).astype(np.float32) for name, shape in shapes.items()})
    (folder / "config.json").write_text("{}")
    return folder


def float_folders(base: Path, archs: tuple[str, ...] = ("llama", "qwen2")) -> dict[str, Path]:
    """A SMALL random float checkpoint (with the real 49k vocabulary) per architecture."""
    from hf_models import make_random_hf_model

    return {arch: make_random_hf_model(base / arch, arch, **SMALL, seed=3) for arch in archs}


def dequantized_folder(src: Path, dst: Path, weights: dict[str, np.ndarray]) -> Path:
    """`src` with the given weights replaced (a quantized checkpoint's dequantization), float32."""
    from hf_models import write_safetensors
    from quant_checkpoints import _read

    dst.mkdir()
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors"):
            (dst / p.name).write_bytes(p.read_bytes())
    write_safetensors(dst / "model.safetensors", _read(src) | {k: v.astype(np.float32) for k, v in weights.items()},
                      "float32")
    return dst


def read_quantized(folder: Path):
    """(open checkpoint, {logical weight name: QuantizedTensor}, consumed names) of a quantized folder."""
    from edgeinfer.convert.quantized import scheme_for
    from edgeinfer.convert.safetensors import open_checkpoint

    scheme = scheme_for(json.loads((folder / "config.json").read_text()), folder)
    ckpt = open_checkpoint(folder)
    tensors, consumed = scheme.tensors(ckpt)
    return ckpt, tensors, consumed


def edit_tensors(folder: Path, edit: Callable[[dict[str, tuple[str, np.ndarray]]], None]) -> None:
    """Rewrite model.safetensors after `edit` changed its {name: (dtype code, array)}."""
    p = folder / "model.safetensors"
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    tensors = {}
    for name, spec in header.items():
        b, e = spec["data_offsets"]
        tensors[name] = (spec["dtype"], np.frombuffer(raw[8 + n + b : 8 + n + e], _CODES[spec["dtype"]]).reshape(spec["shape"]))
    edit(tensors)
    write_raw_safetensors(p, tensors)


def edit_config(folder: Path, **changes: object) -> None:
    c = json.loads((folder / "config.json").read_text())
    c["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(c))


class _TypeTraits(ctypes.Structure):
    """struct ggml_type_traits (ggml.h of the pinned llama.cpp)."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@functools.cache
def _traits(qtype: int) -> _TypeTraits:
    from edgeinfer.imatrix_collect import ggml_library

    lib = ggml_library()
    lib.ggml_get_type_traits.argtypes, lib.ggml_get_type_traits.restype = [ctypes.c_int], ctypes.POINTER(_TypeTraits)
    t = lib.ggml_get_type_traits(qtype).contents
    assert t.type_name.decode() == gguf.GGMLQuantizationType(qtype).name.lower(), (t.type_name, qtype)
    assert (t.blck_size, t.type_size) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    return t


def ggml_dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType, n: int) -> np.ndarray:
    """`n` float32 values of `data` (whole blocks of `qtype`) as llama.cpp's own dequantize_row_* computes them."""
    t = _traits(int(qtype))
    data = np.ascontiguousarray(data, dtype=np.uint8)
    assert data.size == n // t.blck_size * t.type_size and n % t.blck_size == 0
    out = np.empty(n, np.float32)
    _TO_FLOAT(t.to_float)(data.ctypes.data, out.ctypes.data, n)
    return out


def gguf_dequantized(path: Path, keep: Callable[[str], bool]) -> dict[str, tuple[str, np.ndarray]]:
    """{GGUF name: (type name, float32 values as llama.cpp dequantizes them, numpy row order)} of
    the tensors `keep` accepts. Offsets come from edgeinfer's GGUF reader (gguf.GGUFReader takes
    ~20 s on a 49k vocabulary)."""
    from edgeinfer.gguf_file import read_gguf

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for t in read_gguf(path).tensors:
        if not keep(t.name):
            continue
        qtype = gguf.GGMLQuantizationType(t.type_id)
        rows_shape = tuple(reversed(t.shape))
        data = np.asarray(raw[t.offset : t.offset + t.n_bytes])
        if qtype == gguf.GGMLQuantizationType.F32:
            x = data.view(np.float32).reshape(rows_shape)
        else:
            x = ggml_dequantize(data, qtype, int(np.prod(rows_shape))).reshape(rows_shape)
        out[t.name] = (qtype.name, x)
    return out


def rows_in_blocks(t, step: int) -> np.ndarray:
    """A QuantizedTensor's rows read `step` at a time (the last block short when step does not divide)."""
    return np.concatenate([t.rows(r0, min(r0 + step, t.shape[0])) for r0 in range(0, t.shape[0], step)])
