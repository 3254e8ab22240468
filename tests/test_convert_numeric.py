"""Converted models run in llama.cpp and agree with an independent numpy forward pass.

Each case is a tiny random HF checkpoint (dims multiples of 256, 2 layers, GQA) with the default
model's real vocabulary. llama.cpp runs with an f32 KV cache (see hf_models.llama_cpp_logits), so
an f32 conversion must match the float64 reference to 1e-3; f16/bf16 conversions are held to
bounds that follow from their precision. Run with -s to see the measured errors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeinfer.convert import convert_model

from hf_models import llama_cpp_logits, make_random_hf_model
from numpy_reference import forward_logits

pytest.importorskip("llama_cpp")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
CASES = {
    "llama": dict(arch="llama"),
    "llama3-untied": dict(arch="llama", tied=False, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                          pre_tokenizer="llama-bpe", layers=3),
    "qwen2": dict(arch="qwen2", rope_theta=1000000.0),
    "qwen3": dict(arch="qwen3", rope_theta=1000000.0, dtype="bfloat16"),
}
N_TOKENS = 48


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    rng = np.random.default_rng(7)
    return [int(t) for t in rng.integers(17, 49152, N_TOKENS)]  # skip the special tokens


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_f32_conversion_matches_numpy_reference(case, tmp_path, tokens):
    kw = dict(CASES[case])
    src = make_random_hf_model(tmp_path / case, kw.pop("arch"), **kw)
    ref = forward_logits(src, tokens)
    spread = ref.max(axis=1) - np.sort(ref, axis=1)[:, -2]
    assert spread.min() > 2.5e-3, "the reference has a near-tie at argmax (< 2x the tolerance): pick another seed"

    f32 = convert_model(src, "f32", tmp_path / "f32.gguf", register=False)
    got = llama_cpp_logits(f32.path, tokens)
    err = np.abs(got - ref).max()
    print(f"{case} f32: max|Δ| {err:.3g}, min top-2 gap {spread.min():.3g}")
    assert err < 1e-3, f"{case}: max |Δ| {err:.2e}"
    assert (got.argmax(1) == ref.argmax(1)).all()

    # f16/bf16: the error stays within a small multiple of the format's unit roundoff (2^-11, 2^-8)
    # relative to the largest logit, and argmax agrees wherever the reference's top-2 gap exceeds
    # twice that bound (closer calls may legitimately flip).
    scale = np.abs(ref).max()
    for outtype, unit in (("f16", 2.0**-11), ("bf16", 2.0**-8)):
        bound = 10 * unit * scale
        out = convert_model(src, outtype, tmp_path / f"{outtype}.gguf", register=False)
        lg = llama_cpp_logits(out.path, tokens)
        e = np.abs(lg - ref).max()
        agree = lg.argmax(1) == ref.argmax(1)
        print(f"{case} {outtype}: max|Δ| {e:.3g} ({e / scale / unit:.1f} units of roundoff × logit scale {scale:.3g}), "
              f"argmax agreement {agree.mean():.3f}")
        assert e < bound, f"{case} {outtype}: max |Δ| {e:.3g} exceeds {bound:.3g}"
        clear = spread > 2 * bound
        assert agree[clear].all(), f"{case} {outtype}: argmax differs at a position with a clear top-2 gap"
