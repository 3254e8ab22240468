"""A small, bounds-checked, memory-mapped reader of safetensors files (single or sharded).

Nothing from the header is trusted: the header length, every dtype, every shape and every
`data_offsets` pair is checked against the file before a byte of tensor data is touched, and
tensors may not overlap. Tensor data is handed out as read-only numpy views of the memory map;
`release()` tells the kernel the pages are no longer needed, so converting a model never keeps
more than the tensor (or row block) at hand resident.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConversionError

__all__ = ["TensorEntry", "SafetensorsFile", "Checkpoint", "open_checkpoint", "DTYPES", "FLOAT_DTYPES"]

# safetensors dtype -> (numpy dtype of the stored bits, bytes per element). BF16 is kept as raw
# uint16 bits and FP8 as raw uint8 bits; the converter (and convert.quantized) decode them. Which
# dtypes a model may use where is the converter's business: the reader only checks the layout.
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F64": (np.dtype("<f8"), 8),
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "F8_E4M3": (np.dtype("u1"), 1),
    "F8_E5M2": (np.dtype("u1"), 1),
    "F8_E8M0": (np.dtype("u1"), 1),  # MX scales: a biased power of two
    "I64": (np.dtype("<i8"), 8),
    "I32": (np.dtype("<i4"), 4),
    "I16": (np.dtype("<i2"), 2),
    "I8": (np.dtype("i1"), 1),
    "U64": (np.dtype("<u8"), 8),
    "U32": (np.dtype("<u4"), 4),
    "U16": (np.dtype("<u2"), 2),
    "U8": (np.dtype("u1"), 1),
    "BOOL": (np.dtype("u1"), 1),
}
FLOAT_DTYPES = ("F32", "F16", "BF16")  # what an unquantized weight may be stored as
_MAX_HEADER = 100 << 20  # the format's own limit


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # a DTYPES key: "F32", "BF16", "I32", "F8_E4M3", ...
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int

    @property
    def n_bytes(self) -> int:
        return self.end - self.begin

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class SafetensorsFile:
    """One .safetensors file: a validated header and a read-only memory map."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._fp = open(self.path, "rb")
        except OSError as e:
            raise ConversionError(f"cannot open {self.path.name}: {e.strerror or e}") from e
        try:
            self.size = self.path.stat().st_size
            self.metadata: dict[str, str] = {}
            self.tensors: dict[str, TensorEntry] = self._read_header()
            self._mm = mmap.mmap(self._fp.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        except BaseException:
            self._fp.close()
            raise

    def _bad(self, what: str) -> ConversionError:
        return ConversionError(f"{self.path.name} is not a valid safetensors file: {what}")

    def _read_header(self) -> dict[str, TensorEntry]:
        if self.size < 8:
            raise self._bad(f"only {self.size} bytes")
        n = int.from_bytes(self._fp.read(8), "little")
        if n > _MAX_HEADER:
            raise self._bad(f"header length {n} exceeds the 100 MiB limit")
        if n > self.size - 8:
            raise self._bad(f"header length {n} runs past the end of the file ({self.size} bytes; truncated?)")
        try:
            header = json.loads(self._fp.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise self._bad(f"header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        data_start = 8 + n
        data_len = self.size - data_start
        meta = header.pop("__metadata__", None) or {}
        if isinstance(meta, dict):
            self.metadata = {str(k): str(v) for k, v in meta.items()}
        out: dict[str, TensorEntry] = {}
        for name, spec in header.items():
            if not isinstance(spec, dict):
                raise self._bad(f"entry {name!r} is not an object")
            dtype = spec.get("dtype")
            shape = spec.get("shape")
            offsets = spec.get("data_offsets")
            if dtype not in DTYPES:
                raise self._bad(f"tensor {name!r} has unknown dtype {dtype!r}")
            if not isinstance(shape, list) or len(shape) > 8 or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise self._bad(f"tensor {name!r} has an invalid shape {shape!r}")
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]
            ):
                raise self._bad(f"tensor {name!r} has invalid data_offsets {offsets!r}")
            if offsets[1] > data_len:
                raise self._bad(
                    f"tensor {name!r} ends at byte {data_start + offsets[1]} but the file has {self.size} (truncated?)"
                )
            expected = math.prod(shape) * DTYPES[dtype][1]
            if offsets[1] - offsets[0] != expected:
                raise self._bad(
                    f"tensor {name!r} {dtype}{shape} needs {expected} bytes but its offsets span {offsets[1] - offsets[0]}"
                )
            out[name] = TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
        spans = sorted((e.begin, e.end, e.name) for e in out.values() if e.end > e.begin)
        for (b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise self._bad(f"tensors {n0!r} and {n1!r} overlap")
        return out

    def array(self, name: str) -> np.ndarray:
        """A read-only view of a tensor's stored bits (BF16 as uint16, FP8 as uint8), shaped like the tensor."""
        e = self.tensors[name]
        np_dtype = DTYPES[e.dtype][0]
        if e.n_elements == 0 or self._mm is None:
            return np.zeros(e.shape, dtype=np_dtype)
        return np.frombuffer(self._mm, dtype=np_dtype, count=e.n_elements, offset=e.begin).reshape(e.shape)

    def release(self, begin: int, end: int) -> None:
        """Drop the resident pages of [begin, end) from this process (they stay in the page cache)."""
        if self._mm is None or end <= begin or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = begin - begin % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            self._mm.madvise(mmap.MADV_DONTNEED, start, min(end, self.size) - start)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view; the map goes when it does
            self._mm = None
        self._fp.close()


class Checkpoint:
    """All weights of a model folder: one file or the shards listed by the index."""

    def __init__(self, files: list[SafetensorsFile]):
        self.files = files
        self.where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                if name in self.where:
                    raise ConversionError(f"tensor {name!r} appears in both {self.where[name].path.name} and {f.path.name}")
                self.where[name] = f

    def entry(self, name: str) -> TensorEntry:
        return self.where[name].tensors[name]

    @property
    def names(self) -> list[str]:
        return list(self.where)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(folder: Path) -> Checkpoint:
    """Open `model.safetensors`, or the shards of `model.safetensors.index.json`, with checks."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise ConversionError(f"{index.name} is not a valid safetensors index (no weight_map)") from None
        shard_names = sorted({str(v) for v in weight_map.values()})
        for s in shard_names:
            if Path(s).name != s:
                raise ConversionError(f"{index.name} names a shard outside the folder: {s!r}")
            if not (folder / s).is_file():
                raise ConversionError(f"missing weight shard {s} (listed in {index.name})")
        paths = [folder / s for s in shard_names]
    else:
        # Prefer HF's own file names: some repos also carry other-format weights (consolidated.safetensors).
        paths = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
        if not paths:
            extra = " (PyTorch .bin weights are not supported: no torch)" if list(folder.glob("*.bin")) else ""
            raise ConversionError(f"no safetensors weights in {folder}{extra}")
    files: list[SafetensorsFile] = []
    try:
        for p in paths:
            files.append(SafetensorsFile(p))
        ckpt = Checkpoint(files)
    except BaseException:
        for f in files:
            f.close()
        raise
    if index.is_file():
        for name, shard in weight_map.items():
            f = ckpt.where.get(name)
            if f is None or f.path.name != shard:
                ckpt.close()
                raise ConversionError(f"{index.name} says {name!r} is in {shard}, but it is not there")
    return ckpt
