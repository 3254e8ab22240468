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
    with pytest.raises(InvalidModelError, match="truncated|more than the file holds"):
        read_gguf(p)


def test_tensor_offset_past_end(tmp_path):
    p = _tiny_gguf(tmp_path / "bad-offset.gguf")
    data = bytearray(p.read_bytes())
    struct.pack_into("<Q", data, _offset_field(data), 1 << 30)
    p.write_bytes(bytes(data))
    with pytest.raises(InvalidModelError, match="offset 1073741824 is not where the previous tensor ends"):
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
    with pytest.raises(InvalidModelError, match="is not where the previous tensor ends"):
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
    with pytest.raises(InvalidModelError, match="claims 1099511627776 bytes, more than the 4096 allowed"):
        read_gguf(p)


def test_unknown_tensor_type(tmp_path):
    p = _tiny_gguf(tmp_path / "type.gguf")
    data = bytearray(p.read_bytes())
    struct.pack_into("<I", data, _offset_field(data) - 4, 999)
    p.write_bytes(bytes(data))
    with pytest.raises(InvalidModelError, match="unknown type 999"):
        read_gguf(p)


def test_non_utf8_string_is_a_clean_error(tmp_path):
    """Used to end in BufferError: a memoryview slice outlived the mmap it came from."""
    p = _tiny_gguf(tmp_path / "latin1.gguf")
    data = bytearray(p.read_bytes())
    at = data.index(b"general.architecture")
    data[at] = 0xFF  # the first byte of a key is no longer UTF-8
    p.write_bytes(bytes(data))
    with pytest.raises(InvalidModelError, match="not UTF-8") as info:
        read_gguf(p)
    assert "\n" not in str(info.value)
    read_gguf(_tiny_gguf(tmp_path / "again.gguf"))  # and nothing is left mapped or locked


def test_lying_string_length_copies_nothing(tmp_path):
    """A string that claims most of a large file is refused before a byte is copied."""
    p = _tiny_gguf(tmp_path / "liar.gguf")
    data = bytearray(p.read_bytes())
    at = data.index(b"general.architecture") - 8  # the key's length field
    data += bytes(64 << 20)  # 64 MiB the lie can point into
    struct.pack_into("<Q", data, at, 60 << 20)
    p.write_bytes(bytes(data))
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(InvalidModelError, match="more than the 4096 allowed"):
            read_gguf(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_nested_arrays_are_refused(tmp_path):
    p = tmp_path / "nested.gguf"
    key = b"x.nested"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 4, 0)
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body + b"\0" * 64)
    with pytest.raises(InvalidModelError, match="holds arrays"):
        read_gguf(p)


def test_long_tensor_name_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "llama")
    w.add_tensor("t" * 64, np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InvalidModelError, match="tensor name claims 64 bytes"):
        read_gguf(tmp_path / "long.gguf")


def test_validation_walks_an_unchanged_file_once_and_a_rewritten_one_again(tmp_path, default_model_path,
                                                                           vocabulary_walks):
    """validate_file walks a file's vocabulary once per process while the file stays the same
    (size, mtime, ctime, inode); rewritten in place so that two tokens are equal, it is walked
    again and refused, both times it is asked."""
    import shutil

    from edgeinfer.validate import validate_file

    walked = vocabulary_walks
    path = Path(shutil.copyfile(default_model_path, tmp_path / "model.gguf"))
    first = validate_file(path)
    assert walked.count("tokenizer.ggml.tokens") == 1
    assert validate_file(path) == first and walked.count("tokenizer.ggml.tokens") == 1

    start, end = first.string_spans["tokenizer.ggml.tokens"]
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", 1) + b"b", start, end)  # the one-letter token "b" becomes "a"
    data[at + 8] = ord("a")
    with open(path, "r+b") as f:  # in place: the same inode and size
        f.write(data)
    for attempt in (1, 2):
        with pytest.raises(InvalidModelError, match="tokenizer.ggml.tokens"):
            validate_file(path)
        assert walked.count("tokenizer.ggml.tokens") == 1 + attempt
