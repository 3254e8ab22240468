"""GGUF files are validated by our own bounds-checked reader before llama.cpp sees them."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgeinfer import InvalidModelError, read_gguf

NAME = "blk.0.attn_q.weight"


def _tiny_gguf(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_tensor(NAME, np.arange(4 * 64, dtype=np.float32).reshape(4, 64))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _offset_field(data: bytes) -> int:
    """Byte position of NAME's data-offset field in the tensor infos."""
    at = data.index(NAME.encode()) + len(NAME)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * n_dims + 4


def test_valid_file_reads(tmp_path):
    info = read_gguf(_tiny_gguf(tmp_path / "ok.gguf"))
    assert info.architecture == "llama"
    assert info.context_length == 64
    assert {t.name for t in info.tensors} == {NAME, "output_norm.weight"}
    assert info.parameter_count == 4 * 64 + 64
    assert info.bits_per_weight == pytest.approx(32.0)


def test_default_model_reads(default_model_path):
    info = read_gguf(default_model_path)
    assert info.architecture == "llama"
    assert info.file_type == "Q4_1"
    assert info.context_length == 8192
    # 30 layers of 9 tensors + embedding + output norm
    assert len(info.tensors) == 272
    # Q4_1 is 5 bits/weight nominally; F32 norms and a Q8_0 embedding push the effective figure up.
    assert 5.0 < info.bits_per_weight < 6.5


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, this is not a model" * 4)
    with pytest.raises(InvalidModelError, match="bad magic"):
        read_gguf(p)


def test_empty_and_tiny_files(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(InvalidModelError, match="not a GGUF"):
        read_gguf(p)


def test_truncated_file(tmp_path, default_model_path):
    data = default_model_path.read_bytes()
    p = tmp_path / "truncated.gguf"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidModelError, match="past the end of the file"):
        read_gguf(p)


def test_truncated_inside_header(tmp_path, default_model_path):
    with open(default_model_path, "rb") as f:
        head = f.read(200_000)  # cuts through the vocabulary array
    p = tmp_path / "header-cut.gguf"
    p.write_bytes(head)
    with pytest.raises(InvalidModelError, match="truncated"):
        read_gguf(p)


def test_tensor_offset_past_end(tmp_path):
    p = _tiny_gguf(tmp_path / "bad-offset.gguf")
    data = bytearray(p.read_bytes())
    struct.pack_into("<Q", data, _offset_field(data), 1 << 30)
    p.write_bytes(bytes(data))
    with pytest.raises(InvalidModelError, match="past the end of the file"):
        read_gguf(p)


def test_overlapping_tensors(tmp_path):
    p = _tiny_gguf(tmp_path / "overlap.gguf")
    data = bytearray(p.read_bytes())
    info = read_gguf(p)
    other = next(t for t in info.tensors if t.name != NAME)
    mine = next(t for t in info.tensors if t.name == NAME)
    # point NAME's data at the other tensor's data
    struct.pack_into("<Q", data, _offset_field(data), struct.unpack_from("<Q", data, _offset_field(data))[0] + other.offset - mine.offset)
    p.write_bytes(bytes(data))
    with pytest.raises(InvalidModelError, match="overlaps|past the end"):
        read_gguf(p)


def test_absurd_counts(tmp_path):
    p = tmp_path / "counts.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 1) + b"\0" * 64)
    with pytest.raises(InvalidModelError, match="more than the file holds"):
        read_gguf(p)


def test_unknown_version(tmp_path):
    p = tmp_path / "v9.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 0, 0) + b"\0" * 64)
    with pytest.raises(InvalidModelError, match="version 9"):
        read_gguf(p)


def test_huge_string_length(tmp_path):
    p = tmp_path / "string.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40) + b"x" * 64)
    with pytest.raises(InvalidModelError, match="truncated"):
        read_gguf(p)


def test_unknown_tensor_type(tmp_path):
    p = _tiny_gguf(tmp_path / "type.gguf")
    data = bytearray(p.read_bytes())
    struct.pack_into("<I", data, _offset_field(data) - 4, 999)
    p.write_bytes(bytes(data))
    with pytest.raises(InvalidModelError, match="unknown type 999"):
        read_gguf(p)
