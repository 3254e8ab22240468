"""The bytes of llama.cpp's sequence state, read with every size bounded (no llama.cpp here).

`llama_state_seq_save_file` writes "ggsq" v3: the token ids, then the sequence's state as
llama-kv-cache.cpp `state_write` lays it out — a KV stream count, and per stream a cell count and,
for a stream that holds cells, each cell's position, sequence ids (and M-RoPE/PLE extension), then
per layer the K type, row size and rows, and the same for V (transposed without flash attention:
type, element size, rows). `llama_state_seq_get_data` writes the same state after an io magic and
the sequence id. `parse_state` walks such a state in a buffer, refusing (StateRefused, one line)
anything that runs past its end or that llama.cpp would choke on, and compares it with the layout
a context of its own wrote (`learn_layout`); `check_finite` reads every K/V value of a parsed state
and refuses one that is not a finite number; engine/state/session.py does the rest.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "StateLayout",
    "ParsedState",
    "StateRefused",
    "Reader",
    "parse_state",
    "learn_layout",
    "check_finite",
    "FINITE_CHECKED_TYPES",
    "check_cells",
    "read_layers",
    "GGSQ_MAGIC",
    "GGSQ_VERSION",
    "IO_MAGIC",
    "MAX_LAYERS",
    "MAX_STREAMS",
    "MAX_ROW",
]

GGSQ_MAGIC = 0x67677371  # LLAMA_STATE_SEQ_MAGIC ("ggsq")
GGSQ_VERSION = 3  # LLAMA_STATE_SEQ_VERSION of the pinned llama.cpp
IO_MAGIC = 0xAF143CD8  # what llama_state_seq_get_data writes first (llama-context.cpp io_magic)
MAX_LAYERS = 512
MAX_STREAMS = 1024
MAX_ROW = 1 << 28  # bytes of one cell's K (or V) row in one layer
GGML_TYPE_COUNT = 64  # a bound on ggml type ids (the pinned ggml has fewer)


class StateRefused(Exception):
    """A state that must not be loaded; its message is the reason (one line)."""


@dataclass(frozen=True)
class StateLayout:
    """What llama.cpp writes for one sequence of a context (llama-kv-cache.cpp state_write):
    its KV streams, whether cells carry an extension (M-RoPE, PLE), whether V is transposed (no
    flash attention), and per layer (ggml type, bytes per cell row) of K and of V (transposed V:
    (type, bytes per element, rows))."""

    n_stream: int
    cell_ext: bool
    v_trans: bool
    k: tuple[tuple[int, int], ...]
    v: tuple[tuple[int, int, int], ...]

    @property
    def cell_bytes(self) -> int:
        return 12 + (12 if self.cell_ext else 0)  # pos, n_seq_id, [x, y, tok], one seq id

    def payload(self, n: int) -> int:
        """Bytes of a stream holding n cells, after its cell count."""
        size = n * self.cell_bytes + 8 + sum(12 + n * row for _, row in self.k)
        if self.v_trans:
            return size + sum(12 + n * el * rows for _, el, rows in self.v)
        return size + sum(12 + n * row for _, row, _ in self.v)

    def describe(self) -> dict[str, Any]:
        return {"streams": self.n_stream, "v_transposed": self.v_trans, "layers": len(self.k),
                "k_types": sorted({t for t, _ in self.k}), "v_types": sorted({t for t, _, _ in self.v})}


class Reader:
    """Bounded little-endian reads from a buffer; running past `end` is a refusal."""

    def __init__(self, buf: memoryview, start: int, end: int):
        self.buf, self.pos, self.end = buf, start, end

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.end:
            raise StateRefused("the state ends early (truncated or malformed)")
        at = self.pos
        self.pos += n
        return at

    def u32(self) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4))[0]

    def i32(self) -> int:
        return struct.unpack_from("<i", self.buf, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8))[0]


def check_cells(r: Reader, n: int, ext: bool, tokens: Sequence[int] | None) -> None:
    """n cells of one sequence at positions 0..n-1 (llama.cpp discards the saved seq id)."""
    width = 6 if ext else 3
    at = r.take(4 * width * n)
    cells = np.frombuffer(r.buf, dtype="<i4", count=width * n, offset=at).reshape(n, width)
    if not np.array_equal(cells[:, 0], np.arange(n, dtype=np.int32)):
        raise StateRefused("the state's cells are not positions 0..n-1 of one sequence")
    if not np.all(cells[:, 1] == 1):
        raise StateRefused("a cell of the state belongs to more than one sequence")
    if np.any(cells[:, -1] < 0):
        raise StateRefused("a cell of the state has a negative sequence id")
    if ext:
        if np.any(cells[:, 2:4] < 0):
            raise StateRefused("a cell of the state has a negative 2-D position")
        if tokens is not None and not np.array_equal(cells[:, 4], np.asarray(tokens, dtype=np.int32)):
            raise StateRefused("the state's cells hold other tokens than its token list")


def read_layers(r: Reader, n: int, expected: StateLayout | None) -> tuple[bool, tuple, tuple]:
    v_trans = r.u32()
    n_layer = r.u32()
    if v_trans > 1 or not 1 <= n_layer <= MAX_LAYERS:
        raise StateRefused(f"the state's layer header is malformed (v_trans {v_trans}, {n_layer} layers)")
    if expected is not None and (bool(v_trans) != expected.v_trans or n_layer != len(expected.k)):
        raise StateRefused(f"the state has {n_layer} layers{' with V transposed' if v_trans else ''}, this context "
                       f"{len(expected.k)}{' with V transposed' if expected.v_trans else ''} (other flash-attention "
                       "setting or model)")
    k = []
    for il in range(n_layer):
        t, row = r.i32(), r.u64()
        if not 0 <= t < GGML_TYPE_COUNT or not 0 < row <= MAX_ROW:
            raise StateRefused(f"layer {il}: malformed K header (type {t}, row {row} bytes)")
        if expected is not None and (t, row) != expected.k[il]:
            raise StateRefused(f"layer {il}: K cache type {t} with {row}-byte rows, this context has type "
                           f"{expected.k[il][0]} with {expected.k[il][1]} (other KV cache type or model)")
        r.take(n * row)
        k.append((t, row))
    v = []
    for il in range(n_layer):
        if v_trans:
            t, el, rows = r.i32(), r.u32(), r.u32()
            ok = 0 <= t < GGML_TYPE_COUNT and 0 < el <= 64 and 0 < rows <= (1 << 20)
            entry = (t, el, rows)
            size = n * el * rows
        else:
            t, row = r.i32(), r.u64()
            ok = 0 <= t < GGML_TYPE_COUNT and 0 < row <= MAX_ROW
            entry = (t, row, 0)
            size = n * row
        if not ok:
            raise StateRefused(f"layer {il}: malformed V header {entry}")
        if expected is not None and entry != expected.v[il]:
            raise StateRefused(f"layer {il}: V cache {entry}, this context has {expected.v[il]} "
                           "(other KV cache type or model)")
        r.take(size)
        v.append(entry)
    return bool(v_trans), tuple(k), tuple(v)


@dataclass(frozen=True)
class ParsedState:
    layout: StateLayout
    stream: int  # which stream holds the cells (-1: none, an empty state)
    payload_at: int  # offset of that stream's payload (after its cell count)
    payload_len: int


def parse_state(buf: memoryview, start: int, end: int, n: int, *, ext: bool,
                 expected: StateLayout | None = None, tokens: Sequence[int] | None = None) -> ParsedState:
    """The state section of one sequence: [u32 n_stream] then per stream [u32 cells][payload]."""
    r = Reader(buf, start, end)
    n_stream = r.u32()
    if not 1 <= n_stream <= MAX_STREAMS:
        raise StateRefused(f"the state has {n_stream} KV streams")
    found: ParsedState | None = None
    for s in range(n_stream):
        count = r.u32()
        if count == 0:
            continue
        if count != n or found is not None:
            raise StateRefused(f"the state holds {count} cells in stream {s} for {n} tokens")
        at = r.pos
        check_cells(r, n, ext, tokens)
        v_trans, k, v = read_layers(r, n, expected)
        layout = StateLayout(n_stream, ext, v_trans, k, v)
        found = ParsedState(layout, s, at, r.pos - at)
    if r.pos != end:
        raise StateRefused(f"the state has {end - r.pos} bytes more than its cells take")
    if found is None:
        if n:
            raise StateRefused(f"the state holds no cells for its {n} tokens")
        return ParsedState(StateLayout(n_stream, ext, False, (), ()), -1, r.pos, 0)
    return found



def learn_layout(buf: memoryview, start: int, end: int, n: int) -> StateLayout:
    last: StateRefused | None = None
    for ext in (False, True):
        try:
            layout = parse_state(buf, start, end, n, ext=ext).layout
            if layout.k:
                return layout
        except StateRefused as e:
            last = e
    raise StateRefused(f"this model's KV memory has a layout edgeinfer cannot save or check ({last}): "
                       "recurrent, hybrid and sliding-window models are not supported")


# The K/V cache types whose every value check_finite reads (edgeinfer.kv_types' list: every type a
# context of edgeinfer's can have), by ggml type id: the block layout (numpy dtype) and the fields
# that hold floats. A float type is checked value by value (BF16 by its exponent bits: numpy has no
# bfloat16). A block-quantized type's values are a float16 scale d (and for the _1 types a minimum
# m) times small integers — d * q (+ m) is finite exactly when d (and m) are — so its scales are
# checked, every block's.
_F16_BLOCK = {
    8: ("q8_0", [("d", "<f2"), ("q", "V32")], ("d",)),
    2: ("q4_0", [("d", "<f2"), ("q", "V16")], ("d",)),
    3: ("q4_1", [("d", "<f2"), ("m", "<f2"), ("q", "V16")], ("d", "m")),
    6: ("q5_0", [("d", "<f2"), ("qh", "V4"), ("q", "V16")], ("d",)),
    7: ("q5_1", [("d", "<f2"), ("m", "<f2"), ("qh", "V4"), ("q", "V16")], ("d", "m")),
    20: ("iq4_nl", [("d", "<f2"), ("q", "V16")], ("d",)),
}
_FLOAT = {0: ("f32", "<f4"), 1: ("f16", "<f2")}
_BF16 = 30
FINITE_CHECKED_TYPES = frozenset(_F16_BLOCK) | frozenset(_FLOAT) | {_BF16}


def _finite(buf: memoryview, at: int, size: int, ggml_type: int) -> bool:
    if ggml_type in _FLOAT:
        dtype = np.dtype(_FLOAT[ggml_type][1])
        return bool(np.isfinite(np.frombuffer(buf, dtype, size // dtype.itemsize, at)).all())
    if ggml_type == _BF16:  # all exponent bits set: infinity or NaN
        bits = np.frombuffer(buf, "<u2", size // 2, at)
        return not bool(((bits & 0x7F80) == 0x7F80).any())
    _, fields, floats = _F16_BLOCK[ggml_type]
    dtype = np.dtype(fields)
    if size % dtype.itemsize:
        raise StateRefused(f"a K/V row of type {ggml_type} is not a whole number of blocks")
    blocks = np.frombuffer(buf, dtype, size // dtype.itemsize, at)
    return all(bool(np.isfinite(blocks[name]).all()) for name in floats)


def check_finite(buf: memoryview, state: ParsedState, n: int) -> None:
    """Refuse (StateRefused) a state holding a K or V value that is not a finite number (NaN or
    infinity: a forged or corrupted file whose hashes were made to match), reading every value of
    `state`'s n cells in `buf` (see FINITE_CHECKED_TYPES for what is read of each type)."""
    layout = state.layout
    if not layout.k:
        return
    r = Reader(buf, state.payload_at + n * layout.cell_bytes + 8, state.payload_at + state.payload_len)
    for il in range(len(layout.k)):
        t, row = r.i32(), r.u64()
        _check_values(buf, r.take(n * row), n * row, t, f"layer {il}: K")
    for il in range(len(layout.v)):
        if layout.v_trans:
            t, el, rows = r.i32(), r.u32(), r.u32()
            size = n * el * rows
        else:
            t, size = r.i32(), n * r.u64()
        _check_values(buf, r.take(size), size, t, f"layer {il}: V")


def _check_values(buf: memoryview, at: int, size: int, ggml_type: int, where: str) -> None:
    if ggml_type not in FINITE_CHECKED_TYPES:
        raise StateRefused(f"{where} cache has ggml type {ggml_type}, whose values edgeinfer cannot check")
    if not _finite(buf, at, size, ggml_type):
        raise StateRefused(f"{where} cache holds values that are not finite numbers (NaN or infinity)")
