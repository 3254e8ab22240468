"""FP4 checkpoints in: NVFP4 (compressed-tensors, ModelOpt) and MXFP4 (compressed-tensors), kept at 4 bits.

Each case packs random weights in the format's published layout (tests/fp4_checkpoints.py, written
without edgeinfer) and checks
- (fast) the converter's reader gives the format's own float32 dequantization bit for bit, and its
  GGUF blocks, dequantized by llama.cpp's own dequantize_row_{mx,nv}fp4 (libggml-base) and multiplied
  by the `.scale` llama.cpp multiplies in, equal the checkpoint's numbers: MXFP4 bit for bit (and
  the blocks are the checkpoint's bytes, moved), ModelOpt NVFP4 exactly (in float64, where every
  product is exact), compressed-tensors NVFP4 within the one float32 rounding of 1/global_scale
  (relative 2^-24);
- (fast) bad packings are one-line ConversionErrors;
- (slow: whole conversions of a tiny model with the real 49k vocabulary) outtype "auto" writes
  NVFP4/MXFP4 tensors (and `.scale` tensors where llama.cpp applies them; Q8_0 where it would not),
  and llama.cpp's logits match the numpy forward pass of the exactly dequantized weights.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from edgeinfer.convert import convert_model
from edgeinfer.errors import ConversionError

from checkpoint_io import (SMALL, bare_folder, dequantized_folder, edit_config, edit_tensors, float_folders,
                           ggml_dequantize, gguf_dequantized, read_quantized, rows_in_blocks)
from fp4_checkpoints import fp4_folder
from hf_models import _unpermute

QT = gguf.GGMLQuantizationType
CASES = {
    "nvfp4-ct": ("nvfp4-ct", {}),
    "nvfp4-ct-negative-scales": ("nvfp4-ct", {"negative_scales": True}),
    "nvfp4-modelopt": ("nvfp4-modelopt", {}),
    "nvfp4-modelopt-hf-quant-config": ("nvfp4-modelopt", {"hf_quant_config": True}),
    "mxfp4-ct": ("mxfp4-ct", {}),
}
_GGUF_LINEAR = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    """Linear layers and nothing else: what the format readers need, without a vocabulary.
    down_proj's input (768) is a multiple of 64 and 32; o_proj's (96) of 32 but not of 64."""
    return bare_folder(tmp_path_factory.mktemp("bare"), {
        "model.layers.0.self_attn.q_proj.weight": (256, 512),
        "model.layers.0.self_attn.o_proj.weight": (64, 96),
        "model.layers.0.mlp.down_proj.weight": (128, 768),
    })


@pytest.mark.parametrize("case", list(CASES))
def test_fp4_blocks_hold_the_checkpoints_numbers(case, bare, tmp_path):
    layout, opts = CASES[case]
    exact, published = fp4_folder(bare, tmp_path / "q", layout, **opts)
    ckpt, tensors, consumed = read_quantized(tmp_path / "q")
    with ckpt:
        assert set(tensors) == set(exact)
        assert consumed == set(ckpt.names)  # every stored part belongs to a layer (or is skipped)
        for name, want in exact.items():
            t = tensors[name]
            got = rows_in_blocks(t, 24)
            assert np.array_equal(got.view(np.uint32), published[name].view(np.uint32)), f"{case} {name}: rows"
            qtype = t.direct_type()
            if layout.startswith("mxfp4"):
                assert qtype == QT.MXFP4
            else:  # NVFP4's GGUF block is 64 wide: o_proj's 96 columns do not fit
                assert qtype == (QT.NVFP4 if t.shape[1] % 64 == 0 else None), f"{case} {name}"
            if qtype is None:
                continue
            blocks = t.direct_rows(qtype, 0, t.shape[0])
            held = ggml_dequantize(blocks.data, qtype, want.size).reshape(want.shape).astype(np.float64)
            assert np.array_equal(held, gguf.quants.dequantize(blocks.data, qtype).reshape(want.shape))  # gguf-py agrees
            scale = t.tensor_scale()
            if layout.startswith("mxfp4"):
                assert scale is None
                assert np.array_equal(held, want)  # as numbers (code 8, "-0", is llama.cpp's +0)
                assert blocks.max_error == 0.0
                # bit for bit: the E8M0 byte of each group as stored, then its 32 codes
                stored = ckpt.where[name.replace(".weight", ".weight_scale")].array(name.replace(".weight", ".weight_scale"))
                assert np.array_equal(blocks.data.reshape(t.shape[0], -1, 17)[:, :, 0], stored)
                continue
            held *= scale
            if layout == "nvfp4-modelopt":
                assert np.array_equal(held, want), f"{case} {name}: not the exact product"
                assert blocks.max_error <= float(np.abs(want).max()) * 2.0**-23  # vs the float32 formula
            else:
                rel = float(np.abs(held - want).max() / np.abs(want).max())
                assert rel <= 2.0**-24, f"{case} {name}: {rel:.3g} > the rounding of 1/global_scale"


def test_fp4_layer_that_does_not_fit_a_block_is_dequantized(bare, tmp_path):
    """NVFP4 o_proj (96 inputs): no direct type, so "auto" dequantizes it (Q8_0) by the published formula."""
    _, published = fp4_folder(bare, tmp_path / "q", "nvfp4-modelopt")
    ckpt, tensors, _ = read_quantized(tmp_path / "q")
    with ckpt:
        t = tensors["model.layers.0.self_attn.o_proj.weight"]
        assert t.direct_type() is None
        assert np.array_equal(t.rows(0, 64), published["model.layers.0.self_attn.o_proj.weight"])


Q = "model.layers.0.self_attn.q_proj."


@pytest.mark.parametrize(
    ("layout", "corrupt", "match"),
    [
        ("nvfp4-ct", lambda d: edit_tensors(d, lambda t: t.pop(Q + "weight_global_scale")),
         r"^compressed-tensors tensor model.layers.0.self_attn.q_proj.weight: missing weight_global_scale$"),
        ("nvfp4-ct", lambda d: edit_tensors(d, lambda t: t.update({Q + "weight_scale": ("F8_E4M3", t[Q + "weight_scale"][1][:, :-1])})),
         r"q_proj.weight: weight_scale has shape \[256, 31\], expected \[256, 32\]$"),
        ("nvfp4-ct", lambda d: edit_tensors(d, lambda t: t.update({Q + "weight_global_scale": ("F32", np.array([-1.0], np.float32))})),
         r"weight_global_scale is -1.0, not a positive finite number$"),
        ("nvfp4-modelopt", lambda d: edit_config(d, quant_algo="INT4_AWQ"), r"^modelopt quant_algo 'INT4_AWQ' is not supported"),
        ("nvfp4-modelopt", lambda d: edit_config(d, group_size=32), r"modelopt NVFP4 with group_size 32 is not supported"),
        ("mxfp4-ct", lambda d: edit_tensors(d, lambda t: t.update({Q + "weight_scale": ("F32", t[Q + "weight_scale"][1].astype(np.float32))})),
         r"q_proj.weight: weight_scale has dtype F32, expected U8 or F8_E8M0$"),
        ("mxfp4-ct", lambda d: edit_config(d, config_groups={"g": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                                               "weights": {"type": "int", "num_bits": 4}}}),
         r"has weights int4, expected float4$"),
    ],
)
def test_bad_fp4_packings_are_one_line_errors(layout, corrupt, match, bare, tmp_path):
    fp4_folder(bare, tmp_path / "q", layout)
    corrupt(tmp_path / "q")
    with pytest.raises(ConversionError, match=match) as e:
        read_quantized(tmp_path / "q")[0].close()
    assert "\n" not in str(e.value)


# -- whole conversions ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def float_models(tmp_path_factory) -> dict[str, Path]:
    return float_folders(tmp_path_factory.mktemp("float"))


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    return f"model.layers.{parts[1]}.{_GGUF_LINEAR[parts[2]]}.weight"


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "arch"), [("nvfp4-ct", "llama"), ("nvfp4-modelopt", "qwen2"), ("mxfp4-ct", "llama")])
def test_auto_keeps_fp4_at_four_bits(layout, arch, float_models, tmp_path):
    exact, _ = fp4_folder(float_models[arch], tmp_path / "q", layout)
    r = convert_model(tmp_path / "q", "auto", tmp_path / "auto.gguf", register=False)
    got = gguf_dequantized(r.path, lambda n: n.startswith("blk."))
    kind = "MXFP4" if layout.startswith("mxfp4") else "NVFP4"
    reported = {d.name: d for d in r.direct}
    for gname, (qtype, x) in got.items():
        if not gname.endswith(".weight") or gname.split(".")[2] not in _GGUF_LINEAR:
            continue
        want = exact[_hf_name(gname)]
        if arch == "llama" and gname.split(".")[2] in ("attn_q", "attn_k"):
            x = _unpermute(x, SMALL["heads"] if gname.split(".")[2] == "attn_q" else SMALL["kv_heads"])
        role = gname.split(".")[2]
        if kind == "NVFP4" and arch == "qwen2" and role.startswith("ffn"):
            # llama.cpp's qwen2 graph ignores an FFN `.scale`: dequantized into Q8_0 instead
            assert qtype == "Q8_0" and gname not in reported and f"blk.0.{role}.scale" not in got
            assert float(np.abs(x - want).max()) <= float(np.abs(want).max()) / 127  # Q8_0's half step, x2
            continue
        assert qtype == kind, f"{gname}: {qtype}"
        assert gname in reported and reported[gname].qtype == kind
        if kind == "NVFP4":
            scale = got[gname.replace(".weight", ".scale")][1]
            assert scale.shape == (1,)
            x = x.astype(np.float64) * float(scale[0])
            assert float(np.abs(x - want).max()) <= float(np.abs(want).max()) * 2.0**-24
        else:
            assert np.array_equal(x.astype(np.float64), want)
    from edgeinfer.gguf_file import read_gguf

    for t in read_gguf(r.path).tensors:  # 4.5 (NVFP4: 36 bytes per 64) and 4.25 (MXFP4: 17 per 32) bits a weight
        if t.type_name == kind:
            assert t.n_bytes * 8 / np.prod(t.shape) == (4.5 if kind == "NVFP4" else 4.25)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["nvfp4-ct", "nvfp4-modelopt", "mxfp4-ct"])
def test_fp4_logits_match_numpy_forward_of_the_checkpoint(layout, float_models, tmp_path):
    import llama_cpp  # noqa: F401 - a hard dependency: missing, this test fails (never skips)
    from hf_models import llama_cpp_logits
    from numpy_reference import forward_logits

    src = float_models["llama"]
    exact, _ = fp4_folder(src, tmp_path / "q", layout)
    ref_dir = dequantized_folder(src, tmp_path / "ref", exact)
    tokens = [int(t) for t in np.random.default_rng(5).integers(17, 49152, 32)]
    ref = forward_logits(ref_dir, tokens)
    # f32: the checkpoint's numbers through llama.cpp's exact path
    f32 = llama_cpp_logits(convert_model(tmp_path / "q", "f32", tmp_path / "f32.gguf", register=False).path, tokens)
    assert float(np.abs(f32 - ref).max()) < 1e-3
    # auto: FP4 blocks; llama.cpp rounds the activations to Q8_0 for its FP4 dot products, which
    # a Q8_0 file of the same weights shares (and adds its own weight rounding to)
    fp4 = llama_cpp_logits(convert_model(tmp_path / "q", "auto", tmp_path / "auto.gguf", register=False).path, tokens)
    q8 = llama_cpp_logits(convert_model(ref_dir, "q8_0", tmp_path / "q8.gguf", register=False).path, tokens)
    err, err_q8 = float(np.abs(fp4 - ref).max()), float(np.abs(q8 - ref).max())
    print(f"{layout}: max|Δ logits| FP4 blocks {err:.3g}, Q8_0 of the same weights {err_q8:.3g} "
          f"(logits up to {float(np.abs(ref).max()):.3g})")
    assert err <= err_q8
    assert (fp4.argmax(1) == ref.argmax(1)).all()
