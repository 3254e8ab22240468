"""Qwen3.5 checkpoints (hybrid Gated DeltaNet + gated attention, with an MTP layer) convert to
llama.cpp's `qwen35`, and what llama.cpp computes from them agrees with an independent numpy
forward pass (tests/numpy_qwen35.py): the model's logits, the final hidden state it hands to the
MTP head (`embeddings_nextn`), and the MTP head's own logits in an MTP context linked to it.

The checkpoints are tiny and random, in the published layout (Qwen/Qwen3.5-0.8B's config and
tensor names), with twice as many value heads as key heads so the value-head reordering counts.
llama.cpp runs with an f32 KV cache: an f32 conversion must match the float64 reference to 1e-3.
Run with -s to see the measured errors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import llama_cpp  # noqa: F401 - a hard dependency: missing, these tests fail (never skip)
import numpy as np
import pytest

from edgeinfer.convert import convert_model
from edgeinfer.errors import ConversionError, InvalidModelError
from edgeinfer.gguf_file import read_gguf
from edgeinfer.validate import check_semantics, validate_file

from hf_models import copy_with_config, llama_cpp_logits, make_random_qwen35_model
from llama_ext import context, decode_tokens, ext, logits_rows, process_pairs
from numpy_qwen35 import Qwen35Reference

N_TOKENS = 40
CASES = {
    # Qwen/Qwen3.5-0.8B's own layout: multimodal wrapper, tied embeddings, MTP layer
    "multimodal": dict(),
    # the text-only class, untied head, one value head per key head, attention first
    "causal-untied": dict(multimodal=False, tied=False, v_heads=2,
                          layer_types=("full_attention", "linear_attention", "linear_attention", "full_attention")),
}


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    rng = np.random.default_rng(7)
    return [int(t) for t in rng.integers(17, 49152, N_TOKENS)]  # skip the special tokens


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    """The published-layout checkpoint and its f32 GGUF (made once for this module)."""
    root = tmp_path_factory.mktemp("qwen35")
    src = make_random_qwen35_model(root / "Qwen3.5-tiny")
    out = convert_model(src, "f32", root / "tiny.gguf", register=False)
    return src, out.path


def test_gguf_has_the_hybrid_layers_and_the_mtp_block_as_llama_cpp_writes_them(converted):
    _, path = converted
    info = read_gguf(path)
    meta = info.metadata
    assert meta["general.architecture"] == "qwen35" and meta["tokenizer.ggml.pre"] == "qwen35"
    assert meta["qwen35.block_count"] == 5 and meta["qwen35.nextn_predict_layers"] == 1
    assert meta["qwen35.attention.recurrent_layers"] == [True, True, True, False, False]
    assert meta["qwen35.rope.dimension_sections"] == [11, 11, 10, 0] and meta["qwen35.rope.dimension_count"] == 64
    assert (meta["qwen35.ssm.conv_kernel"], meta["qwen35.ssm.state_size"], meta["qwen35.ssm.group_count"],
            meta["qwen35.ssm.time_step_rank"], meta["qwen35.ssm.inner_size"]) == (4, 64, 2, 4, 256)
    t = {x.name: x for x in info.tensors}
    for name in ("blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight",
                 "blk.4.nextn.shared_head_norm.weight", "blk.4.attn_q.weight", "blk.4.ffn_down.weight"):
        assert name in t, name
    assert t["blk.4.nextn.eh_proj.weight"].shape == (512, 256)
    assert t["blk.0.ssm_conv1d.weight"].shape == (4, 512) and t["blk.0.ssm_conv1d.weight"].type_name == "F32"
    assert t["blk.0.ssm_a"].shape == (4,) and "blk.0.ssm_dt.bias" in t and "blk.3.attn_qkv.weight" not in t
    assert "output.weight" not in t  # tied
    assert not any("visual" in name or name.startswith("v.") for name in t)  # the vision tower stays out
    validate_file(path)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_the_numpy_reference(case, tmp_path, tokens, converted):
    if case == "multimodal":
        src, path = converted
    else:
        src = make_random_qwen35_model(tmp_path / case, **CASES[case])
        path = convert_model(src, "f32", tmp_path / "f32.gguf", register=False).path
    ref = Qwen35Reference(src).logits(tokens)
    gap = ref.max(axis=1) - np.sort(ref, axis=1)[:, -2]
    assert gap.min() > 2e-3, "the reference has a near-tie at argmax: pick another seed"
    got = llama_cpp_logits(path, tokens, n_threads=1)
    err = np.abs(got - ref).max()
    print(f"qwen35 {case}: max|Δ| {err:.3g} (logit scale {np.abs(ref).max():.3g})")
    assert err < 1e-3
    assert (got.argmax(1) == ref.argmax(1)).all()


@pytest.mark.slow
def test_mtp_head_runs_in_an_mtp_context_and_matches_numpy(converted, tokens):
    """load_mtp=True, a target context that hands over its final hidden state (h_nextn, unmasked),
    and an MTP context (ctx_type MTP, ctx_other = the target's) fed (token p, h[p-1]) pairs."""
    src, path = converted
    x = ext()
    ll = x.ll
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers, mp.load_mtp = 0, True
    model = ll.llama_model_load_from_file(str(path).encode(), mp)
    assert model
    tgt = dft = None
    try:
        assert ll.llama_model_n_layer_nextn(model) == 1 and ll.llama_model_n_layer(model) == 4
        n_embd, n_vocab = ll.llama_model_n_embd(model), ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        ref = Qwen35Reference(src)
        tgt = context(model)
        x.set_embeddings_nextn(tgt, True, False)
        decode_tokens(tgt, tokens)
        h = np.ctypeslib.as_array(x.get_embeddings_nextn(tgt), shape=(len(tokens), n_embd)).copy()
        h_err = np.abs(h - ref.hidden(tokens)).max()

        dft = context(model, mtp=True, other=tgt)
        x.set_embeddings_nextn(dft, True, True)
        rows = np.vstack([np.zeros((1, n_embd), np.float32), h[:-1]])  # h[p-1] beside token p; zeros at 0
        assert process_pairs(dft, tokens, rows, list(range(len(tokens)))) == 0
        got = logits_rows(dft, len(tokens), n_vocab)
        want = ref.mtp_logits(tokens, h.astype(np.float64))
        err = np.abs(got - want).max()
        print(f"qwen35 h_nextn max|Δ| {h_err:.3g}; MTP logits max|Δ| {err:.3g} (scale {np.abs(want).max():.3g})")
        assert h_err < 1e-4 and err < 1e-3
        assert (got.argmax(1) == want.argmax(1)).all()
    finally:
        for ctx in (dft, tgt):
            if ctx:
                ll.llama_free(ctx)
        ll.llama_model_free(model)


# -- bad input: one line, no file ------------------------------------------------------------------
def _text(cfg: dict) -> dict:
    return cfg["text_config"]


HOSTILE = {
    "layer_types length": (lambda c: _text(c).update(layer_types=["linear_attention"]), "layer_types"),
    "layer type name": (lambda c: _text(c)["layer_types"].__setitem__(0, "mamba"), "layer_types"),
    "value heads": (lambda c: _text(c).update(linear_num_value_heads=3), "linear_num_value_heads"),
    "head sizes": (lambda c: _text(c).update(linear_value_head_dim=32), "linear_key_head_dim"),
    "two MTP layers": (lambda c: _text(c).update(mtp_num_hidden_layers=2), "mtp_num_hidden_layers"),
    "ungated attention": (lambda c: _text(c).update(attn_output_gate=False), "attn_output_gate"),
    "mrope sections": (lambda c: _text(c)["rope_parameters"].update(mrope_section=[10, 10, 10]), "mrope_section"),
    "rotary factor": (lambda c: _text(c)["rope_parameters"].update(partial_rotary_factor="a quarter"), "partial_rotary_factor"),
    "rope type": (lambda c: _text(c)["rope_parameters"].update(rope_type="yarn"), "rope_type"),
    "dedicated MTP embeddings": (lambda c: _text(c).update(mtp_use_dedicated_embeddings=True), "mtp_use_dedicated_embeddings"),
    "text_config type": (lambda c: c.update(text_config=[1]), "text_config"),
    "MoE": (lambda c: c.update(architectures=["Qwen3_5MoeForConditionalGeneration"]), "MoE"),
    "no MTP layer in config, MTP tensors present": (lambda c: _text(c).update(mtp_num_hidden_layers=0), "unexpected tensor mtp."),
    "hidden size": (lambda c: _text(c).update(hidden_size=128), "has shape"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_random_qwen35_model(tmp_path_factory.mktemp("qwen35-hostile") / "src", hidden=256, intermediate=256)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_config_is_one_line_conversion_error(case, pristine, tmp_path):
    mutate, words = HOSTILE[case]
    src = copy_with_config(pristine, tmp_path / "src", mutate)
    with pytest.raises(ConversionError) as e:
        convert_model(src, "f32", tmp_path / "out.gguf", register=False)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out.gguf").exists()


# -- the validator knows qwen35 ------------------------------------------------------------------
def _with(info, meta=None, tensors=None):
    return dataclasses.replace(info, metadata={**info.metadata, **(meta or {})}, tensors=tensors or info.tensors)


@pytest.mark.parametrize("change,words", [
    ({"qwen35.ssm.time_step_rank": 3}, "time_step_rank"),
    ({"qwen35.ssm.inner_size": 128}, "inner_size"),
    ({"qwen35.attention.value_length": 128}, "value_length"),
    ({"qwen35.rope.dimension_sections": [11, 11]}, "dimension_sections"),
    ({"qwen35.attention.recurrent_layers": [True, False]}, "recurrent_layers"),
    ({"qwen35.nextn_predict_layers": 5}, "nextn_predict_layers"),
])
def test_validator_refuses_what_the_qwen35_graph_asserts_on(converted, change, words):
    info = read_gguf(converted[1])
    check_semantics(info)
    with pytest.raises(InvalidModelError, match=words):
        check_semantics(_with(info, change))


def test_validator_wants_each_layer_types_tensors(converted):
    info = read_gguf(converted[1])
    for gone in ("blk.1.ssm_a", "blk.3.attn_q_norm.weight", "blk.4.nextn.eh_proj.weight"):
        with pytest.raises(InvalidModelError, match="missing"):
            check_semantics(_with(info, tensors=tuple(t for t in info.tensors if t.name != gone)))
    f16_conv = tuple(dataclasses.replace(t, type_name="F16") if t.name == "blk.0.ssm_conv1d.weight" else t
                     for t in info.tensors)
    with pytest.raises(InvalidModelError, match="conv kernel must be F32"):
        check_semantics(_with(info, tensors=f16_conv))
    # a layer marked full attention has no attention tensors here
    flags = [False, True, True, False, False]
    with pytest.raises(InvalidModelError, match="blk.0.attn_q"):
        check_semantics(_with(info, {"qwen35.attention.recurrent_layers": flags}))
