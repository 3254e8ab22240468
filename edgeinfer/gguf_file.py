"""Read and validate GGUF files before llama.cpp sees them.

llama.cpp's GGUF parser has had memory-safety bugs on crafted files, so every file is parsed here
first by a bounds-checked reader: magic, version, counts, every length against the bytes that are
left (and against a limit for its kind) before anything is copied, tensor types, shapes, and that
the tensors' data lie inside the file back to back, as llama.cpp expects. A failing file raises
InvalidModelError with one line naming the problem. What llama.cpp asserts on beyond the file's
structure (hyper-parameters, vocabulary, tensor roles) is checked by `edgeinfer.validate`.

The reader walks the header once with struct and skips large arrays (the vocabulary) without
building Python objects for them, so validating a model costs milliseconds, not the seconds
gguf.GGUFReader needs for a 49k-token vocabulary.
"""

from __future__ import annotations

import mmap
import struct
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

from .errors import InvalidModelError, ModelNotFoundError

__all__ = ["TensorInfo", "GGUFInfo", "ArraySummary", "read_gguf", "GGUF_MAGIC"]

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_MAX_DIMS = 4
_MAX_ARRAY_NESTING = 2
# Arrays longer than this are summarized (type and length) unless the caller asks for them.
_SMALL_ARRAY = 256
# Longest strings accepted, checked before any byte is copied: a lying length must not make the
# reader allocate what the file claims. Real keys are < 100 bytes, chat templates < 200 KB.
_MAX_KEY = 4096
_MAX_STRING = 1 << 20
_MAX_TOKEN = 1 << 16
_MAX_TENSOR_NAME = 63  # GGML_MAX_NAME - 1
# The vocabulary: llama.cpp asserts that no two of its entries have the same text.
TOKENS_KEY = "tokenizer.ggml.tokens"

_U64 = struct.Struct("<Q")

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
    """A large metadata array that was skipped: its element type and length (and, for the
    vocabulary, the first two indices whose texts are equal)."""

    element_type: str
    length: int
    duplicate: tuple[int, int] | None = None


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
    # Byte spans of the large string arrays that were stepped over (for read_gguf's known_spans).
    string_spans: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False, compare=False)

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
    """Bounds-checked little-endian reader over an mmap (or bytes).

    It never takes a memoryview of the mapping (a slice that outlives the mapping made closing it
    fail) and never copies bytes before their claimed length has been checked against what is
    left and against the limit for that kind of string.
    """

    def __init__(self, buf: mmap.mmap | bytes, path: Path, known_spans: Mapping[str, tuple[int, int]]):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path
        self.known_spans = known_spans
        self.spans: dict[str, tuple[int, int]] = {}

    def fail(self, problem: str) -> InvalidModelError:
        return InvalidModelError(f"{self.path.name}: not a valid GGUF file: {problem}")

    def need(self, n: int, what: str) -> int:
        """Check that n more bytes exist; return the current position and step over them."""
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"truncated while reading {what} at byte {self.pos}")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        at = self.need(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, at)[0]

    def raw_string(self, what: str, limit: int) -> bytes:
        n = self.unpack("<Q", f"{what} length")
        if n > limit:
            raise self.fail(f"{what} claims {n} bytes, more than the {limit} allowed")
        at = self.need(n, what)
        return self.buf[at : at + n]

    def string(self, what: str, limit: int = _MAX_STRING) -> str:
        raw = self.raw_string(what, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, vtype: int, key: str, keep_arrays: bool) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype], repr(key))
        if vtype == GGUFValueType.STRING:
            return self.string(repr(key))
        if vtype == GGUFValueType.ARRAY:
            return self.array(key, keep_arrays)
        raise self.fail(f"unknown value type {vtype} for {key!r}")

    def array(self, key: str, keep_arrays: bool) -> Any:
        etype = self.unpack("<I", f"{key!r} element type")
        length = self.unpack("<Q", f"{key!r} array length")
        smallest = 8 if etype == GGUFValueType.STRING else struct.calcsize(_SCALAR_FORMATS.get(etype, "<B"))
        if length * smallest > self.size - self.pos:
            raise self.fail(f"array {key!r} claims {length} elements, more than the file holds")
        keep = keep_arrays or length <= _SMALL_ARRAY
        if etype in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[etype]
            at = self.need(struct.calcsize(fmt) * length, repr(key))
            if not keep:
                return ArraySummary(GGUFValueType(etype).name, length)
            return [v[0] for v in struct.iter_unpack(fmt, self.buf[at : self.pos])]
        if etype == GGUFValueType.STRING:
            if keep:
                return [self.string(f"element {i} of {key!r}") for i in range(length)]
            start = self.pos
            known = self.known_spans.get(key)
            if known is not None and known[0] == start and start <= known[1] <= self.size:
                self.pos = known[1]  # this very file was walked before (see read_gguf)
                duplicate = None
            elif key == TOKENS_KEY:
                duplicate = self.first_duplicate(key, length)
            else:
                self.walk_strings(key, length, _MAX_STRING)
                duplicate = None
            self.spans[key] = (start, self.pos)
            return ArraySummary("STRING", length, duplicate)
        if etype == GGUFValueType.ARRAY:
            raise self.fail(f"array {key!r} holds arrays (llama.cpp reads no nested arrays)")
        raise self.fail(f"unknown array element type {etype} in {key!r}")

    def walk_strings(self, key: str, length: int, limit: int, hashes: array | None = None) -> None:
        """Step over `length` strings of an array (the hot loop of a vocabulary: kept tight).
        With `hashes`, each entry must be UTF-8 (llama.cpp's tokenizer throws, uncaught, on one that
        is not) and its hash is appended, the text as llama.cpp sees it: it names an empty entry i
        "[EMPTY_i]"."""
        buf, size, pos = self.buf, self.size, self.pos
        read_length = _U64.unpack_from
        for i in range(length):
            if size - pos < 8:
                self.pos = pos
                raise self.fail(f"truncated while reading element {i} of {key!r} at byte {pos}")
            (n,) = read_length(buf, pos)
            pos += 8
            if n > limit or n > size - pos:
                self.pos = pos
                what = f"more than the {limit} allowed" if n > limit else "past the end of the file"
                raise self.fail(f"element {i} of {key!r} claims {n} bytes, {what}")
            if hashes is not None:
                text = buf[pos : pos + n] if n else f"[EMPTY_{i}]".encode()
                if not text.isascii() and not _is_utf8(text):
                    self.pos = pos
                    raise self.fail(f"element {i} of {key!r} is not UTF-8")
                hashes.append(hash(text))
            pos += n
        self.pos = pos

    def first_duplicate(self, key: str, length: int) -> tuple[int, int] | None:
        """Walk a vocabulary (see walk_strings) and return the first two indices whose texts are
        equal. Keeps one 8-byte hash per entry, not the texts."""
        start = self.pos
        hashes = array("q")
        self.walk_strings(key, length, _MAX_TOKEN, hashes)
        ordered = np.sort(np.frombuffer(hashes, dtype=np.int64))
        equal = ordered[1:] == ordered[:-1]
        if not equal.any():
            return None
        colliding = set(ordered[1:][equal].tolist())
        # Equal hashes: compare the texts themselves (a second walk, only in this rare case).
        end, self.pos = self.pos, start
        first_seen: dict[bytes, int] = {}
        found = None
        for i in range(length):
            (n,) = _U64.unpack_from(self.buf, self.pos)
            text = self.buf[self.pos + 8 : self.pos + 8 + n] if n else f"[EMPTY_{i}]".encode()
            self.pos += 8 + n
            if hashes[i] in colliding:
                j = first_seen.setdefault(text, i)
                if j != i:
                    found = (j, i)
                    break
        self.pos = end
        return found


def _is_utf8(text: bytes) -> bool:
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_gguf(
    path: str | Path, *, keep_arrays: bool = False, known_spans: Mapping[str, tuple[int, int]] | None = None,
    model: bool = True,
) -> GGUFInfo:
    """Parse and validate a GGUF file; raise InvalidModelError (one line) on any problem.

    `model=False` reads a GGUF that is not a model (llama-imatrix's files have no general.architecture).

    `known_spans` (GGUFInfo.string_spans of an earlier read of this very file, unchanged since:
    the caller's business) lets the reader step over large string arrays (the vocabulary and
    merges: most of the time a read takes) instead of walking them again.
    """
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
            return _parse(mm, path, file_size, keep_arrays, known_spans or {}, model)


def _parse(
    buf: mmap.mmap | bytes, path: Path, file_size: int, keep_arrays: bool, known_spans: Mapping[str, tuple[int, int]],
    model: bool = True,
) -> GGUFInfo:
    cur = _Cursor(buf, path, known_spans)
    cur.need(4, "magic")
    version = cur.unpack("<I", "version")
    if version not in _SUPPORTED_VERSIONS:
        raise cur.fail(f"unsupported GGUF version {version}")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata count")
    # Cheap plausibility bounds before any loop: a key-value pair takes at least 13 bytes,
    # a tensor description at least 33.
    if n_kv * 13 > file_size or n_tensors * 33 > file_size:
        raise cur.fail(f"header claims {n_kv} metadata entries and {n_tensors} tensors, more than the file holds")

    metadata: dict[str, Any] = {}
    alignment_type = None
    for _ in range(n_kv):
        key = cur.string("metadata key", _MAX_KEY)
        if not key:
            raise cur.fail("empty metadata key")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        vtype = cur.unpack("<I", f"type of {key!r}")
        metadata[key] = cur.value(vtype, key, keep_arrays)
        if key == "general.alignment":
            alignment_type = vtype

    alignment = metadata.get("general.alignment", 32)
    if alignment_type not in (None, GGUFValueType.UINT32) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment {alignment!r} is not a power of two stored as UINT32")
    if model and not isinstance(metadata.get("general.architecture"), str):
        raise cur.fail("general.architecture is missing")

    raw_tensors = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = cur.string("tensor name", _MAX_TENSOR_NAME)
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
    expected = 0  # llama.cpp wants the tensors back to back, in header order, each padded
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
        if offset != expected:
            raise cur.fail(f"tensor {name!r} data offset {offset} is not where the previous tensor ends ({expected})")
        start = data_start + offset
        if start + n_bytes > file_size:
            raise cur.fail(
                f"tensor {name!r} data ends at byte {start + n_bytes}, past the end of the file ({file_size} bytes)"
                " — the file is truncated or corrupt"
            )
        expected += -(-n_bytes // alignment) * alignment
        tensors.append(TensorInfo(name, shape, qtype.name, type_id, start, n_elements, n_bytes))

    return GGUFInfo(
        path=path, version=version, file_size=file_size, metadata=metadata, tensors=tuple(tensors), string_spans=cur.spans
    )
