"""Quantized checkpoints in: FP8, AWQ, GPTQ and compressed-tensors, made by the tests themselves.

Each case quantizes random weights (dims multiples of 256) with the format's own packing, written
independently in tests/quant_checkpoints.py, and checks
- (fast) the converter's reader of the format (edgeinfer.convert.quantized) gives the test's own
  dequantization bit for bit, in any row blocks, and the GGUF blocks of the direct path dequantize
  (by gguf.quants) to it within the f16 rounding of the block offset m (exactly where there is none);
- (fast) corrupted packings, unknown methods and options are one-line ConversionErrors, and
  convert_model leaves no file behind;
- (slow: whole conversions of a tiny model with the real 49k vocabulary) an f32 conversion holds
  the test's dequantization bit for bit (q/k rows unpermuted for llama); outtype "auto" writes
  Q4_1/Q4_0/Q8_0 blocks directly and reports each tensor's error; llama.cpp's logits match the
  numpy forward pass of the dequantized weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgeinfer.convert import convert_model
from edgeinfer.errors import ConversionError

from hf_models import _unpermute, make_random_hf_model, write_safetensors
from quant_checkpoints import quantize_folder

SMALL = dict(hidden=256, layers=1, heads=4, kv_heads=2, intermediate=512)
CASES = {
    "fp8-block": ("fp8-block", {}),
    "fp8-block-64": ("fp8-block", {"block": 64}),
    "fp8-channel": ("fp8-channel", {}),
    "awq-g128": ("awq", {"group": 128}),
    "awq-g32": ("awq", {"group": 32}),
    "gptq-4bit-sym": ("gptq", {"bits": 4, "sym": True}),
    "gptq-4bit-asym": ("gptq", {"bits": 4, "sym": False, "group": 64}),
    "gptq-4bit-asym-v2": ("gptq", {"bits": 4, "sym": False, "v2": True}),
    "gptq-4bit-act-order": ("gptq", {"bits": 4, "sym": False, "act_order": True}),
    "gptq-8bit-sym": ("gptq", {"bits": 8, "sym": True, "g_idx": True}),
    "gptq-8bit-asym": ("gptq", {"bits": 8, "sym": False, "group": 32}),
    "ct-int4-group": ("ct-pack", {"bits": 4, "sym": True, "group": 128}),
    "ct-int4-asym": ("ct-pack", {"bits": 4, "sym": False, "group": 32}),
    "ct-int8-channel": ("ct-pack", {"bits": 8, "sym": True, "strategy": "channel"}),
}
# outtype "auto": the type each case's linear layers are written in, and whether exactly.
DIRECT = {
    "awq-g128": "Q4_1", "awq-g32": "Q4_1", "gptq-4bit-sym": "Q4_0", "gptq-4bit-asym": "Q4_1",
    "gptq-4bit-asym-v2": "Q4_1", "gptq-8bit-sym": "Q8_0", "ct-int4-group": "Q4_0", "ct-int4-asym": "Q4_1",
    "ct-int8-channel": "Q8_0",
}
_GGUF_LINEAR = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    """Two linear layers and nothing else: what the format readers need, without a vocabulary."""
    folder = tmp_path_factory.mktemp("bare")
    rng = np.random.default_rng(1)
    write_safetensors(folder / "model.safetensors", {
        "model.layers.0.self_attn.q_proj.weight": (rng.standard_normal((256, 512)) / 20).astype(np.float32),
        "model.layers.0.mlp.down_proj.weight": (rng.standard_normal((128, 768)) / 20).astype(np.float32),
    })
    (folder / "config.json").write_text("{}")
    return folder


def _read_quantized(folder: Path):
    from edgeinfer.convert.quantized import scheme_for
    from edgeinfer.convert.safetensors import open_checkpoint

    scheme = scheme_for(json.loads((folder / "config.json").read_text()), folder)
    ckpt = open_checkpoint(folder)
    tensors, consumed = scheme.tensors(ckpt)
    return ckpt, tensors, consumed


@pytest.mark.parametrize("case", list(CASES))
def test_reader_gives_the_checkpoints_own_dequantization(case, bare, tmp_path):
    fmt, opts = CASES[case]
    expected = quantize_folder(bare, tmp_path / "q", fmt, **opts)
    ckpt, tensors, consumed = _read_quantized(tmp_path / "q")
    with ckpt:
        assert set(tensors) == set(expected)
        assert consumed == set(ckpt.names)  # every stored part belongs to a layer (or is skipped)
        for name, want in expected.items():
            t = tensors[name]
            assert t.shape == want.shape
            step = 3 * t.row_align  # blocks that do not divide the rows: the last one is short
            got = np.concatenate([t.rows(r0, min(r0 + step, t.shape[0])) for r0 in range(0, t.shape[0], step)])
            assert got.dtype == np.float32
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{case} {name}: not bit-equal"
            qtype = t.direct_type()
            assert (qtype.name if qtype is not None else None) == DIRECT.get(case)
            if qtype is None:
                continue
            blocks = t.direct_rows(qtype, 0, t.shape[0])
            x = gguf.quants.dequantize(blocks.data, qtype).reshape(want.shape)
            err = float(np.abs(x - want).max())
            assert blocks.max_error == pytest.approx(err, rel=1e-6, abs=1e-12)
            if qtype.name == "Q4_1":
                # d = scale (already f16: exact), m = -scale*zero rounded to f16: the only error.
                bound = _f16_half_ulp(2 * float(np.abs(want).max())) + 1e-6 * float(np.abs(want).max())
                assert 0 < err <= bound, f"{case} {name}: error {err:.3g} > f16 rounding of m {bound:.3g}"
            else:
                assert err == 0.0, f"{case} {name}: {qtype.name} should hold the checkpoint exactly, error {err:.3g}"


@pytest.fixture(scope="module")
def float_models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("float")
    return {arch: make_random_hf_model(base / arch, arch, **SMALL, seed=3) for arch in ("llama", "qwen2")}


def _linear_tensors(path: Path, heads: int, kv_heads: int, permuted: bool) -> dict[str, tuple[str, np.ndarray]]:
    """{HF weight name: (GGUF type name, float32 values as gguf.quants dequantizes them, HF row order)}.
    Offsets come from edgeinfer's GGUF reader (gguf.GGUFReader takes ~20 s on a 49k vocabulary)."""
    from edgeinfer.gguf_file import read_gguf

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for t in read_gguf(path).tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[2] not in _GGUF_LINEAR or parts[3] != "weight":
            continue
        qtype = gguf.GGMLQuantizationType(t.type_id)
        rows_shape = tuple(reversed(t.shape))
        data = np.asarray(raw[t.offset : t.offset + t.n_bytes])
        if qtype == gguf.GGMLQuantizationType.F32:
            x = data.view(np.float32).reshape(rows_shape)
        else:
            x = gguf.quants.dequantize(data.reshape(rows_shape[0], -1), qtype).astype(np.float32).reshape(rows_shape)
        if permuted and parts[2] in ("attn_q", "attn_k"):
            x = _unpermute(x, heads if parts[2] == "attn_q" else kv_heads)
        out[f"model.layers.{parts[1]}.{_GGUF_LINEAR[parts[2]]}.weight"] = (qtype.name, x)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fp8-block", "fp8-channel", "awq-g128", "gptq-4bit-act-order", "gptq-8bit-asym",
                                  "ct-int4-asym"])
def test_f32_conversion_is_the_checkpoints_own_dequantization(case, float_models, tmp_path):
    fmt, opts = CASES[case]
    arch = "llama" if case in ("awq-g128", "gptq-4bit-act-order", "fp8-block") else "qwen2"
    expected = quantize_folder(float_models[arch], tmp_path / "q", fmt, **opts)
    r = convert_model(tmp_path / "q", "f32", tmp_path / "out.gguf", register=False)
    assert r.quantization == {"fp8-channel": "compressed-tensors", "ct-pack": "compressed-tensors"}.get(fmt, fmt.split("-")[0])
    got = _linear_tensors(r.path, SMALL["heads"], SMALL["kv_heads"], permuted=arch == "llama")
    assert set(got) == set(expected)
    for name, want in expected.items():
        qtype, x = got[name]
        assert qtype == "F32"
        assert x.shape == want.shape
        assert np.array_equal(x.view(np.uint32), want.view(np.uint32)), f"{case} {name}: not bit-equal"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["awq-g128", "gptq-4bit-sym", "ct-int8-channel"])
def test_auto_writes_the_checkpoints_blocks_directly(case, float_models, tmp_path):
    fmt, opts = CASES[case]
    arch = "llama" if case == "awq-g128" else "qwen2"  # llama: q/k rows permuted as whole blocks
    expected = quantize_folder(float_models[arch], tmp_path / "q", fmt, **opts)
    r = convert_model(tmp_path / "q", "auto", tmp_path / "auto.gguf", register=False)
    got = _linear_tensors(r.path, SMALL["heads"], SMALL["kv_heads"], permuted=arch == "llama")
    reported = {d.name: d for d in r.direct}
    assert len(reported) == len(expected) == len(got)
    assert {d.qtype for d in r.direct} == {DIRECT[case]}
    for name, want in expected.items():
        qtype, x = got[name]
        assert qtype == DIRECT[case], f"{case} {name}: {qtype}"
        err = float(np.abs(x - want).max())
        gguf_name = next(k for k in reported if k.endswith(_gguf_suffix(name)))
        assert reported[gguf_name].max_error == pytest.approx(err, rel=1e-6, abs=1e-12)
        if qtype == "Q4_1":
            # d = scale (already f16: exact), m = -scale*zero rounded to f16: the only error.
            bound = _f16_half_ulp(np.abs(want).max() * 2) + 1e-6 * np.abs(want).max()
            assert 0 < err <= bound, f"{case} {name}: error {err:.3g} > f16 rounding of m {bound:.3g}"
        else:
            assert err == 0.0, f"{case} {name}: {qtype} should hold the checkpoint exactly, error {err:.3g}"


@pytest.mark.slow
def test_auto_falls_back_where_groups_do_not_fit_blocks(float_models, tmp_path):
    """act-order mixes groups inside 32-wide blocks: dequantized and written as Q8_0 instead."""
    quantize_folder(float_models["qwen2"], tmp_path / "q", "gptq", bits=4, sym=False, act_order=True)
    r = convert_model(tmp_path / "q", "auto", tmp_path / "auto.gguf", register=False)
    assert r.direct == ()
    types = {t for t, _ in _linear_tensors(r.path, 4, 2, permuted=False).values()}
    assert types == {"Q8_0"}


def _gguf_suffix(hf_name: str) -> str:
    parts = hf_name.split(".")
    kind = next(k for k, v in _GGUF_LINEAR.items() if v == f"{parts[3]}.{parts[4]}")
    return f".{parts[2]}.{kind}.weight"


def _f16_half_ulp(x: float) -> float:
    return float(np.spacing(np.float16(x))) / 2


# -- corrupted packings ---------------------------------------------------------------------------
def _edit_tensors(folder: Path, edit) -> None:
    from quant_checkpoints import write_raw_safetensors

    p = folder / "model.safetensors"
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    codes = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "I64": "<i8", "I8": "i1", "F8_E4M3": "u1"}
    tensors = {}
    for name, spec in header.items():
        b, e = spec["data_offsets"]
        tensors[name] = (spec["dtype"], np.frombuffer(raw[8 + n + b : 8 + n + e], codes[spec["dtype"]]).reshape(spec["shape"]))
    edit(tensors)
    write_raw_safetensors(p, tensors)


def _edit_config(folder: Path, **changes) -> None:
    c = json.loads((folder / "config.json").read_text())
    c["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(c))


QZ = "model.layers.0.self_attn.q_proj.qzeros"
SC = "model.layers.0.self_attn.q_proj.scales"
DOWN = "model.layers.0.mlp.down_proj."


@pytest.mark.parametrize(
    ("fmt", "opts", "corrupt", "match"),
    [
        ("awq", {}, lambda d: _edit_tensors(d, lambda t: t.update({QZ: ("I32", t[QZ][1][:, :-1])})),
         r"^awq tensor model.layers.0.self_attn.q_proj.weight: qzeros has shape \[4, 31\], expected \[4, 32\]$"),
        ("awq", {}, lambda d: _edit_tensors(d, lambda t: t.pop(SC)), "q_proj.weight: missing scales$"),
        ("awq", {}, lambda d: _edit_config(d, group_size=100), "group size 100 does not divide the input dimension 512"),
        ("awq", {}, lambda d: _edit_config(d, version="gemv"), "^awq version 'gemv' is not supported; supported: awq gemm$"),
        ("awq", {}, lambda d: _edit_config(d, zero_point=False), "awq without zero points"),
        ("gptq", {}, lambda d: _edit_config(d, bits=3), "^gptq with 3 bits is not supported; supported: gptq with 2, 4 or 8 bits$"),
        ("gptq", {}, lambda d: _edit_config(d, checkpoint_format="marlin"), "gptq checkpoint_format 'marlin' is not supported"),
        ("gptq", {}, lambda d: _edit_tensors(d, lambda t: t.update({SC: ("F16", t[SC][1][:1])})),
         r"scales has shape \[1, 256\], expected \[4, 256\]$"),
        ("gptq", {"act_order": True}, lambda d: _edit_tensors(
            d, lambda t: t.update({"model.layers.0.self_attn.q_proj.g_idx": ("I32", np.full(512, 9, np.int32))})),
         "g_idx names groups outside 0..3$"),
        ("fp8-block", {}, lambda d: _edit_tensors(d, lambda t: t.pop(DOWN + "weight_scale_inv")),
         "^fp8 tensor model.layers.0.mlp.down_proj.weight: missing weight_scale_inv \\(or weight_scale\\)$"),
        ("fp8-block", {}, lambda d: _edit_config(d, weight_block_size=[64, 64]),
         r"weight_scale_inv has shape \[\d, \d\]; 64x64 blocks of \d+x\d+ need \[\d, \d+\]$"),
        ("ct-pack", {}, lambda d: _edit_tensors(d, lambda t: t.pop(DOWN + "weight_shape")), "down_proj.weight: missing weight_shape$"),
        ("ct-pack", {"sym": False}, lambda d: _edit_tensors(d, lambda t: t.pop(DOWN + "weight_zero_point")),
         "asymmetric, but missing weight_zero_point$"),
        ("ct-pack", {}, lambda d: _edit_config(d, format="marlin-24"),
         r"^compressed-tensors format 'marlin-24' is not supported; supported: compressed-tensors \(float-quantized, "
         r"pack-quantized, int-quantized, naive-quantized\)$"),
        ("awq", {}, lambda d: _edit_config(d, quant_method="bitsandbytes"),
         "^quantization method 'bitsandbytes' is not supported; supported: fp8 .*awq.*gptq.*compressed-tensors"),
    ],
)
def test_corrupted_packings_are_one_line_errors(fmt, opts, corrupt, match, bare, tmp_path):
    quantize_folder(bare, tmp_path / "q", fmt, **opts)
    corrupt(tmp_path / "q")
    with pytest.raises(ConversionError, match=match) as e:
        _read_quantized(tmp_path / "q")[0].close()
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_convert_model_reports_a_bad_packing_and_writes_nothing(float_models, tmp_path):
    quantize_folder(float_models["qwen2"], tmp_path / "q", "gptq", bits=4)
    _edit_tensors(tmp_path / "q", lambda t: t.pop(SC))
    with pytest.raises(ConversionError, match="^gptq tensor model.layers.0.self_attn.q_proj.weight: missing scales$"):
        convert_model(tmp_path / "q", "f16", tmp_path / "x.gguf", register=False)
    assert not (tmp_path / "x.gguf").exists()
    _edit_config(tmp_path / "q", quant_method="hqq")
    with pytest.raises(ConversionError, match="^quantization method 'hqq' is not supported"):
        convert_model(tmp_path / "q", "f16", tmp_path / "x.gguf", register=False)
    assert list(tmp_path.glob("*.gguf*")) == []


@pytest.mark.slow
def test_integer_weights_without_quantization_config_are_refused(float_models, tmp_path):
    quantize_folder(float_models["qwen2"], tmp_path / "q", "awq")
    c = json.loads((tmp_path / "q" / "config.json").read_text())
    del c["quantization_config"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConversionError, match="unexpected tensor model.layers.0.mlp.down_proj.qweight"):
        convert_model(tmp_path / "q", "f16", tmp_path / "x.gguf", register=False)


# -- logits against the numpy forward pass (llama.cpp) ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("case", ["fp8-block", "awq-g128", "gptq-4bit-act-order", "ct-int4-asym"])
def test_logits_match_numpy_forward_of_dequantized_weights(case, float_models, tmp_path):
    import llama_cpp  # noqa: F401 - a hard dependency: missing, this test fails (never skips)
    from hf_models import llama_cpp_logits
    from numpy_reference import forward_logits
    from quant_checkpoints import _read

    fmt, opts = CASES[case]
    src = float_models["llama"]
    expected = quantize_folder(src, tmp_path / "q", fmt, **opts)
    # The reference: the same folder with every quantized layer replaced by the test's dequantization.
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors"):
            (ref_dir / p.name).write_bytes(p.read_bytes())
    write_safetensors(ref_dir / "model.safetensors", _read(src) | expected, "float32")
    tokens = [int(t) for t in np.random.default_rng(5).integers(17, 49152, 32)]
    ref = forward_logits(ref_dir, tokens)
    r = convert_model(tmp_path / "q", "f32", tmp_path / "f32.gguf", register=False)
    got = llama_cpp_logits(r.path, tokens)
    err = float(np.abs(got - ref).max())
    print(f"{case}: f32 max|Δ logits| {err:.3g}")
    assert err < 1e-3
    assert (got.argmax(1) == ref.argmax(1)).all()
    # f16 output: within f16's rounding of the weights (as in test_convert_numeric).
    f16 = convert_model(tmp_path / "q", "f16", tmp_path / "f16.gguf", register=False)
    lg = llama_cpp_logits(f16.path, tokens)
    scale = float(np.abs(ref).max())
    assert float(np.abs(lg - ref).max()) < 10 * 2.0**-11 * scale


def test_cli_outtype_choices_are_the_converters():
    from edgeinfer.cli import build_parser
    from edgeinfer.convert import OUTTYPE_CHOICES

    sub = next(a for a in build_parser()._actions if a.choices and "convert" in a.choices).choices["convert"]
    outtype = next(a for a in sub._actions if a.dest == "outtype")
    assert tuple(outtype.choices) == OUTTYPE_CHOICES
