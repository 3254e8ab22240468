"""What every format family shares: a quantized layer's stored parts (`Part`), the tensor that
stands for its weight (`QuantizedTensor`), the scheme that groups a checkpoint's parts into such
tensors (`QuantScheme`), and the element decoding they all use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from gguf import GGMLQuantizationType as QT

from ...errors import ConversionError
from ..safetensors import Checkpoint, SafetensorsFile, TensorEntry

__all__ = ["FLOAT_DTYPES", "DirectBlocks", "Part", "QuantScheme", "QuantizedTensor", "config_int", "to_float32",
           "unpack_fields"]

FLOAT_DTYPES = ("F32", "F16", "BF16")


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def unpack_fields(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
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
class Part:
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

    def __init__(self, name: str, method: str, shape: tuple[int, int], parts: dict[str, Part]):
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

    def direct_rows(self, qtype: QT, r0: int, r1: int) -> DirectBlocks:  # pragma: no cover
        raise NotImplementedError

    def _bad(self, what: str) -> ConversionError:
        return ConversionError(f"{self.method} tensor {self.name}: {what}")

    def _part(self, key: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None = None) -> Part:
        p = self.parts.get(key)
        if p is None:
            raise self._bad(f"missing {key}")
        if p.entry.dtype not in dtypes:
            raise self._bad(f"{key} has dtype {p.entry.dtype}, expected {' or '.join(dtypes)}")
        if shape is not None and p.entry.shape != shape:
            raise self._bad(f"{key} has shape {list(p.entry.shape)}, expected {list(shape)}")
        return p


# -- schemes -------------------------------------------------------------------------------------
def config_int(qc: dict[str, Any], key: str, default: Any, method: str, *aliases: str) -> int:
    value = next((qc[k] for k in (key, *aliases) if k in qc), default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConversionError(f"quantization_config ({method}): {key} must be an integer, got {value!r}")
    return value


@dataclass
class QuantScheme:
    """How a checkpoint's quantized layers are stored; `tensors(ckpt)` groups their parts."""

    method: ClassVar[str] = ""
    supported: ClassVar[str] = ""  # what the family converts, as "is not supported" messages list it
    suffixes: ClassVar[tuple[str, ...]] = ()  # stored parts of one layer, after its module name
    skipped: ClassVar[tuple[str, ...]] = ()  # parts GGUF does not need (activation scales)
    config: dict[str, Any] = field(default_factory=dict)

    def make(self, name: str, parts: dict[str, Part]) -> QuantizedTensor | None:  # pragma: no cover
        raise NotImplementedError

    def is_quantized(self, module: str, parts: dict[str, Part]) -> bool:
        return True

    def tensors(self, ckpt: Checkpoint) -> tuple[dict[str, QuantizedTensor], set[str]]:
        """{logical "<module>.weight": tensor}, and every stored name they (or skipping) consume."""
        by_module: dict[str, dict[str, Part]] = {}
        consumed: set[str] = set()
        for name in ckpt.names:
            module, _, suffix = name.rpartition(".")
            if suffix in self.skipped:
                consumed.add(name)
            elif suffix in self.suffixes:
                by_module.setdefault(module, {})[suffix] = Part(ckpt.where[name], ckpt.entry(name))
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
