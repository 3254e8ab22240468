"""A restored state's K/V values must be finite numbers (issue 45): a forged or corrupted file with
its hashes recomputed, whose structure passes every check, used to restore — and its NaN reached
logprobs and replies. For every KV-cache type edgeinfer's contexts can have, a real state saved by
llama.cpp passes `check_finite`, and the same state with one value (a float type) or one block
scale (a block-quantized type: d, and m where the type has one) made NaN or infinite — written by
hand from ggml's block layouts, not from the check's own tables — is refused, on restore too."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer.engine.state.file_format import (FINITE_CHECKED_TYPES, StateRefused, check_finite, learn_layout,
                                                parse_state)
from edgeinfer.kv_types import KV_CACHE_TYPES

pytestmark = pytest.mark.slow

# ggml's block layouts (ggml-common.h): bytes per block, and the offsets of its float16 fields
BLOCK_FLOATS = {"q8_0": (34, (0,)), "q4_0": (18, (0,)), "q4_1": (20, (0, 2)), "q5_0": (22, (0,)),
                "q5_1": (24, (0, 2)), "iq4_nl": (18, (0,))}
NOT_FINITE = {"f32": (struct.pack("<f", float("nan")), struct.pack("<f", float("-inf"))),
              "f16": (struct.pack("<e", float("nan")), struct.pack("<e", float("inf"))),
              "bf16": (b"\xc0\x7f", b"\x80\xff")}  # bfloat16 NaN and -infinity, little-endian


def test_every_kv_type_is_checked():
    assert {t.ggml_type for t in KV_CACHE_TYPES.values()} == FINITE_CHECKED_TYPES
    assert set(BLOCK_FLOATS) | set(NOT_FINITE) == set(KV_CACHE_TYPES)


def _parts(data: bytes) -> tuple[dict, int, int, int]:
    """(trailer, end of llama.cpp's part, offset of the first K value, end of the last V value)."""
    (length,) = struct.unpack_from("<I", data, len(data) - 12)
    trailer = json.loads(data[len(data) - 12 - length: len(data) - 12])
    n, ggsq = trailer["n_tokens"], trailer["state_bytes"]
    layout = learn_layout(memoryview(data), 12 + 4 * n, ggsq, n)
    state = parse_state(memoryview(data), 12 + 4 * n, ggsq, n, ext=layout.cell_ext)
    return trailer, ggsq, state.payload_at + n * layout.cell_bytes + 8 + 12, state.payload_at + state.payload_len


def _forged(data: bytes, at: int, value: bytes) -> bytes:
    """`data` with `value` written at `at`, its state hash recomputed (the trailer keeps its length)."""
    (length,) = struct.unpack_from("<I", data, len(data) - 12)
    trailer, ggsq, _, _ = _parts(data)
    body = bytearray(data[:ggsq])
    body[at: at + len(value)] = value
    trailer["state_sha256"] = hashlib.sha256(body).hexdigest()
    raw = json.dumps(trailer, ensure_ascii=True).encode()
    assert len(raw) == length
    return bytes(body) + raw + data[len(data) - 12:]


def _check(data: bytes) -> None:
    trailer, ggsq, _, _ = _parts(data)
    n = trailer["n_tokens"]
    layout = learn_layout(memoryview(data), 12 + 4 * n, ggsq, n)
    check_finite(memoryview(data), parse_state(memoryview(data), 12 + 4 * n, ggsq, n, ext=layout.cell_ext), n)


@pytest.mark.parametrize("kv_type", list(KV_CACHE_TYPES))
def test_a_value_that_is_not_finite_is_refused_in_every_kv_type(kv_type, default_model_path: Path, tmp_path):
    path = tmp_path / "state.kv"
    with edgeinfer.load(default_model_path, n_ctx=256, kv_type=kv_type, n_threads=1) as engine:
        engine.generate("The capital of France is", edgeinfer.GenerateOptions(max_tokens=2)).result()
        engine.save_slot(0, path)
        data = path.read_bytes()
        _check(data)  # what llama.cpp wrote is finite
        _, _, first_k, v_end = _parts(data)
        if kv_type in NOT_FINITE:
            size = len(NOT_FINITE[kv_type][0])
            places = [(first_k, v) for v in NOT_FINITE[kv_type]] + [(v_end - size, NOT_FINITE[kv_type][0])]
        else:  # the first K block's scales, and the last V block's d
            block, floats = BLOCK_FLOATS[kv_type]
            places = [(first_k + off, struct.pack("<e", bad)) for off in floats for bad in (float("nan"), float("inf"))]
            places.append((v_end - block, struct.pack("<e", float("-inf"))))
        for at, value in places:
            forged = _forged(data, at, value)
            with pytest.raises(StateRefused, match="not finite"):
                _check(forged)
            path.write_bytes(forged)
            result = engine.restore_slot(0, path)
            assert not result and "not finite" in result.reason, (kv_type, at, result)
        path.write_bytes(data)
        assert engine.restore_slot(0, path)  # the state as saved loads
