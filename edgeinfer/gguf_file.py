"""Read and validate GGUF files before llama.cpp sees them.

llama.cpp's GGUF parser has had memory-safety bugs on crafted files, so every file is parsed here
first by a bounds-checked reader: magic, version, counts, every length against the bytes that are
left, tensor types, shapes, and that every tensor's data lies inside the file without overlap.
A failing file raises InvalidModelError with one line naming the problem.

The reader walks the header once with struct and skips large arrays (the vocabulary) without
building Python objects for them, so validating a model costs milliseconds, not the seconds
gguf.GGUFReader needs for a 49k-token vocabulary.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

from .errors import InvalidModelError, ModelNotFoundError

__all__ = ["TensorInfo", "GGUFInfo", "ArraySummary", "read_gguf", "GGUF_MAGIC"]

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_MAX_DIMS = 4
_MAX_ARRAY_NESTING = 2
# Arrays longer than this are summarized (type and length) unless the caller asks for them.
_SMALL_ARRAY = 256

_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class ArraySummary:
    """A large metadata array that was skipped: its element type and length."""

    element_type: str
    length: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length
    type_name: str
    type_id: int
    offset: int  # absolute offset of the data in the file
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    version: int
    file_size: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...] = field(repr=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    @property
    def model_name(self) -> str | None:
        name = self.metadata.get("general.name")
        return str(name) if name is not None else None

    @property
    def context_length(self) -> int | None:
        value = self.metadata.get(f"{self.architecture}.context_length")
        return int(value) if value is not None else None

    @property
    def parameter_count(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        """Effective bits per weight over all tensors, from the types actually in the file."""
        n = self.parameter_count
        return 8.0 * self.tensor_bytes / n if n else 0.0

    @property
    def file_type(self) -> str | None:
        """The nominal type (general.file_type), e.g. 'Q4_K_M'; the tensors may differ from it."""
        ftype = self.metadata.get("general.file_type")
        if ftype is None:
            return None
        try:
            return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_")
        except ValueError:
            return f"type{ftype}"

    def type_counts(self) -> dict[str, int]:
        """Number of tensors of each ggml type."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts

    def type_bytes(self) -> dict[str, int]:
        """Bytes of tensor data held in each ggml type."""
        sizes: dict[str, int] = {}
        for t in self.tensors:
            sizes[t.type_name] = sizes.get(t.type_name, 0) + t.n_bytes
        return sizes


class _Cursor:
    """Bounds-checked little-endian reader over a bytes-like buffer."""

    def __init__(self, buf: memoryview | bytes, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def fail(self, problem: str) -> InvalidModelError:
        return InvalidModelError(f"{self.path.name}: not a valid GGUF file: {problem}")

    def take(self, n: int, what: str) -> memoryview | bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"truncated while reading {what} at byte {self.pos}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size, what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"{what} length")
        raw = self.take(n, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def skip_string(self, what: str) -> None:
        n = self.unpack("<Q", f"{what} length")
        self.take(n, what)

    def value(self, vtype: int, key: str, keep_arrays: bool, depth: int = 0) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype], key)
        if vtype == GGUFValueType.STRING:
            return self.string(key)
        if vtype == GGUFValueType.ARRAY:
            if depth >= _MAX_ARRAY_NESTING:
                raise self.fail(f"array nesting too deep in {key!r}")
            etype = self.unpack("<I", f"{key} element type")
            length = self.unpack("<Q", f"{key} array length")
            if length > len(self.buf) - self.pos:  # every element takes at least one byte
                raise self.fail(f"array {key!r} claims {length} elements, more than the file holds")
            if etype in _SCALAR_FORMATS:
                size = struct.calcsize(_SCALAR_FORMATS[etype])
                raw = self.take(size * length, key)
                if keep_arrays or length <= _SMALL_ARRAY:
                    return [v[0] for v in struct.iter_unpack(_SCALAR_FORMATS[etype], raw)]
                return ArraySummary(GGUFValueType(etype).name, length)
            if etype == GGUFValueType.STRING:
                if keep_arrays or length <= _SMALL_ARRAY:
                    return [self.string(key) for _ in range(length)]
                for _ in range(length):
                    self.skip_string(key)
                return ArraySummary("STRING", length)
            if etype == GGUFValueType.ARRAY:
                return [self.value(etype, key, keep_arrays, depth + 1) for _ in range(length)]
            raise self.fail(f"unknown array element type {etype} in {key!r}")
        raise self.fail(f"unknown value type {vtype} for {key!r}")


def read_gguf(path: str | Path, *, keep_arrays: bool = False) -> GGUFInfo:
    """Parse and validate a GGUF file; raise InvalidModelError (one line) on any problem."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"no such file: {path}")
    if not path.is_file():
        raise InvalidModelError(f"{path}: not a file")
    file_size = path.stat().st_size
    if file_size < 24:
        raise InvalidModelError(f"{path.name}: not a GGUF file (only {file_size} bytes)")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise InvalidModelError(f"{path.name}: not a GGUF file (bad magic)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return _parse(view, path, file_size, keep_arrays)
            finally:
                view.release()


def _parse(view: memoryview, path: Path, file_size: int, keep_arrays: bool) -> GGUFInfo:
    cur = _Cursor(view, path)
    cur.take(4, "magic")
    version = cur.unpack("<I", "version")
    if version not in _SUPPORTED_VERSIONS:
        raise cur.fail(f"unsupported GGUF version {version}")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata count")
    # Cheap plausibility bounds before any loop: a key-value pair takes at least 12 bytes,
    # a tensor description at least 24.
    if n_kv * 12 > file_size or n_tensors * 24 > file_size:
        raise cur.fail(f"header claims {n_kv} metadata entries and {n_tensors} tensors, more than the file holds")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        vtype = cur.unpack("<I", f"type of {key!r}")
        metadata[key] = cur.value(vtype, key, keep_arrays)

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment {alignment!r} is not a power of two")
    if not isinstance(metadata.get("general.architecture"), str):
        raise cur.fail("general.architecture is missing")

    raw_tensors = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = cur.string("tensor name")
        if name in names:
            raise cur.fail(f"duplicate tensor {name!r}")
        names.add(name)
        n_dims = cur.unpack("<I", f"dimensions of {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(cur.unpack("<Q", f"shape of {name!r}") for _ in range(n_dims))
        type_id = cur.unpack("<I", f"type of {name!r}")
        offset = cur.unpack("<Q", f"offset of {name!r}")
        raw_tensors.append((name, shape, type_id, offset))

    data_start = -(-cur.pos // alignment) * alignment
    tensors: list[TensorInfo] = []
    for name, shape, type_id, offset in raw_tensors:
        try:
            qtype = GGMLQuantizationType(type_id)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise cur.fail(f"tensor {name!r} has unknown type {type_id}") from None
        if any(d == 0 for d in shape):
            raise cur.fail(f"tensor {name!r} has an empty dimension {shape}")
        if shape[0] % block_size:
            raise cur.fail(f"tensor {name!r}: row length {shape[0]} is not a multiple of {qtype.name}'s block {block_size}")
        n_elements = 1
        for d in shape:
            n_elements *= d
            if n_elements > file_size * 64:  # no type packs more than 64 weights per byte
                raise cur.fail(f"tensor {name!r} shape {shape} is larger than the file")
        n_bytes = n_elements // block_size * type_size
        if offset % alignment:
            raise cur.fail(f"tensor {name!r} data offset {offset} is not aligned to {alignment}")
        start = data_start + offset
        if start + n_bytes > file_size:
            raise cur.fail(
                f"tensor {name!r} data ends at byte {start + n_bytes}, past the end of the file ({file_size} bytes)"
                " — the file is truncated or corrupt"
            )
        tensors.append(TensorInfo(name, shape, qtype.name, type_id, start, n_elements, n_bytes))

    previous_end, previous_name = data_start, None
    for t in sorted(tensors, key=lambda t: t.offset):
        if t.offset < previous_end:
            raise cur.fail(f"tensor {t.name!r} overlaps {previous_name!r}")
        previous_end, previous_name = t.offset + t.n_bytes, t.name

    return GGUFInfo(path=path, version=version, file_size=file_size, metadata=metadata, tensors=tuple(tensors))
