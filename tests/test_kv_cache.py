"""KV-cache types: the one list (edgeinfer.kv_types), what llama.cpp accepts, its size, and its cost.

Fast: the list agrees with gguf's own table of ggml types (ids, block sizes, bytes), options and
fit use it, a quantized V cache with flash attention switched off is a one-line error.
Slow (llama.cpp): every type (and mixed K/V pairs) creates a context whose KV buffer is exactly
what fit estimates; greedy output with a q8_0 K+V cache equals the f16 cache's for the first
tokens; and evaluate_kv measures q8_0's cost below q4_0's (a 128-token chunk).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import pytest

import edgeinfer
from edgeinfer.errors import InvalidOptionError
from edgeinfer.kv_types import KV_CACHE_TYPES, KV_TYPE_NAMES, flash_attn_for, kv_cache_type

# What llama.cpp's CPU path takes as --cache-type-k/-v (common/arg.cpp's kv_cache_types).
LLAMA_CPP_CPU_KV_TYPES = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"}


def test_the_list_matches_ggml():
    assert set(KV_TYPE_NAMES) == LLAMA_CPP_CPU_KV_TYPES
    for name, t in KV_CACHE_TYPES.items():
        qt = gguf.GGMLQuantizationType[name.upper()]
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        assert (t.ggml_type, t.block, t.block_bytes) == (int(qt), block, type_size), name
        assert t.quantized == (name not in ("f32", "f16", "bf16"))


def test_options_use_the_list():
    from edgeinfer.engine.core.options import KV_TYPES
    from edgeinfer.fit import KV_BYTES_PER_ELEMENT
    from edgeinfer.profiles import KV_CACHE_TYPES as PROFILE_TYPES

    assert KV_TYPES == PROFILE_TYPES == KV_TYPE_NAMES == tuple(KV_BYTES_PER_ELEMENT)
    o = edgeinfer.LoadOptions(kv_type="q8_0", kv_type_v="f16").validate()
    assert o.kv_types == ("q8_0", "f16")
    assert edgeinfer.LoadOptions(kv_type_k="IQ4_NL").validate().kv_types == ("iq4_nl", "f16")
    for bad in (dict(kv_type="q3"), dict(kv_type_k="q2_k"), dict(kv_type_v="int8")):
        with pytest.raises(InvalidOptionError, match="unknown KV-cache type .* choose one of f32, f16, bf16, q8_0"):
            edgeinfer.LoadOptions(**bad).validate()


def test_quantized_v_needs_flash_attention():
    assert flash_attn_for("f16", "q8_0", None) is True
    assert flash_attn_for("q4_0", "f16", None) is None  # a quantized K alone: llama.cpp's own choice
    assert flash_attn_for("q4_0", "f16", False) is False
    with pytest.raises(InvalidOptionError, match=r"quantized V cache \(q5_1\) needs flash attention"):
        edgeinfer.LoadOptions(kv_type_v="q5_1", flash_attn=False).validate()
    with pytest.raises(InvalidOptionError, match="unknown KV-cache type"):
        kv_cache_type("f8")


def test_fit_kv_bytes_per_type(default_model_path: Path):
    from edgeinfer import read_gguf
    from edgeinfer.fit import estimate_memory, kv_cache_sizes

    info = read_gguf(default_model_path)
    md = info.metadata
    elems = md["llama.block_count"] * 8192 * md["llama.attention.head_count_kv"] * (
        md["llama.embedding_length"] // md["llama.attention.head_count"])
    sizes = kv_cache_sizes(info, 8192)
    assert sizes["f16"] == 2 * 2 * elems and sizes["q8_0"] == 2 * elems * 34 // 32
    assert sizes["iq4_nl"] == sizes["q4_0"] < sizes["q4_1"] < sizes["q5_0"] < sizes["q5_1"] < sizes["q8_0"]
    mixed = estimate_memory(info, 8192, kv_type_k="q8_0", kv_type_v="q4_0")
    assert mixed.kv_cache == (sizes["q8_0"] + sizes["q4_0"]) // 2 and mixed.kv_type == "q8_0/q4_0"


def test_fit_cli_lists_every_kv_type(capsys: pytest.CaptureFixture[str]):
    from edgeinfer.cli import main

    assert main(["fit", "--ctx", "8192", "--kv-type-k", "q8_0", "--kv-type-v", "q4_0"]) in (0, 1)
    out = capsys.readouterr().out
    assert "q8_0/q4_0" in out
    by_type = next(li for li in out.splitlines() if li.startswith("KV by type"))
    assert all(f" {name} " in by_type for name in KV_TYPE_NAMES)


# -- llama.cpp ------------------------------------------------------------------------------------
def _kv_buffer_mib(default_model_path: Path, **kv) -> float:
    from edgeinfer.engine.llama.runtime import log_capture

    lines: list[str] = []
    with log_capture(lambda level, text: lines.append(text)):
        edgeinfer.load(default_model_path, edgeinfer.LoadOptions(n_ctx=1024, **kv)).close()
    log = "".join(lines)
    return sum(float(m) for m in re.findall(r"KV buffer size =\s*([\d.]+) MiB", log))


@pytest.mark.slow
@pytest.mark.parametrize(("k", "v"), [(t, t) for t in KV_TYPE_NAMES] + [("q8_0", "f16"), ("f16", "q4_0"), ("bf16", "iq4_nl")])
def test_every_kv_type_loads_with_the_estimated_size(default_model_path: Path, k: str, v: str):
    from edgeinfer import read_gguf
    from edgeinfer.fit import estimate_memory

    mib = _kv_buffer_mib(default_model_path, kv_type_k=k, kv_type_v=v)
    est = estimate_memory(read_gguf(default_model_path), 1024, kv_type_k=k, kv_type_v=v)
    assert est.kv_cache / 2**20 == pytest.approx(mib, abs=0.01)


@pytest.mark.slow
def test_quantized_k_without_flash_attention_loads(default_model_path: Path):
    """Only a quantized V needs flash attention; a quantized K with it off is a valid context."""
    assert _kv_buffer_mib(default_model_path, kv_type_k="q8_0", kv_type_v="f16", flash_attn=False) > 0


PROMPT = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4,"
N_TOKENS = 48
CLEAR_MARGIN = 1.0  # logits; q8_0 K+V moved this model's logits by up to ~1.7 at some positions (max over 200)


@pytest.mark.slow
def test_q8_0_kv_cache_greedy_matches_f16(default_model_path: Path):
    """Token for token as long as f16's own choice is clear (top-2 margin >= CLEAR_MARGIN): on this
    model a q8_0 K+V cache changes a mean KL of ~5e-3 (FA on vs off alone: ~4e-3), so an exact
    near-tie may legitimately flip; where the f16 choice is clear it must not."""
    import numpy as np

    from edgeinfer import GenerateOptions, SamplingOptions

    opts = GenerateOptions(max_tokens=N_TOKENS, sampling=SamplingOptions(temperature=0.0))
    out = {}
    for kv in ("f16", "q8_0"):
        with edgeinfer.load(default_model_path, n_ctx=256, kv_type=kv) as engine:
            out[kv] = engine.generate(PROMPT, opts).result().tokens
            if kv == "f16":
                prompt = engine.tokenize(PROMPT)
                rows = engine.logits(prompt + out[kv], start=len(prompt) - 1)[: len(out[kv])]
                top2 = np.sort(rows, axis=1)[:, -2:]
                margin = top2[:, 1] - top2[:, 0]
    unclear = np.flatnonzero(margin < CLEAR_MARGIN)
    n = int(unclear[0]) if unclear.size else len(out["f16"])
    print(f"f16 greedy is clear for the first {n} tokens; q8_0 K+V agrees for "
          f"{next((i for i, (a, b) in enumerate(zip(out['f16'], out['q8_0'])) if a != b), len(out['q8_0']))}")
    assert n >= 16, "the prompt no longer gives a clear greedy path: pick another"
    assert out["q8_0"][:n] == out["f16"][:n], "q8_0 K+V greedy output left the f16 one where f16's choice was clear"


@pytest.mark.slow
def test_kv_quantization_cost_is_measured_and_ordered(default_model_copy):
    """On the default model's F16 copy (its prefill is 2.5x faster than Q4_1's on one thread):
    q8_0 K+V costs a KLD of ~2e-4, q4_0 ~0.027 (measured on a 128-token chunk; 0.035 on 256)."""
    from edgeinfer.evaluate import evaluate_kv

    res = {kv: evaluate_kv(default_model_copy("F16"), kv, kv, ctx=128, chunks=1, scored=64)
           for kv in ("q8_0", "q4_0")}
    q8, q4 = res["q8_0"], res["q4_0"]
    print(f"KLD q8_0 {q8.kld:.5f} ({q8.same_top:.3f} same top), q4_0 {q4.kld:.5f} ({q4.same_top:.3f})")
    assert q8.kv_types == "q8_0/q8_0" and q8.positions == 64
    assert 0 < q8.kld < q4.kld
    assert q8.same_top >= q4.same_top
