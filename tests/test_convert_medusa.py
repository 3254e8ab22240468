"""Medusa head checkpoints (FasterDecoding/Medusa's published layouts) convert to our `medusa` GGUF
(convert/medusa.py): Medusa-1's heads alone (`{i}.{l}.linear.*`, `{i}.{L}.weight` beside a config
naming the base model) and Medusa-2's whole model (`medusa_head.{i}.*` among the target's own
weights), one shared residual block or one per layer, F32 / F16 / BF16. Every tensor written equals
the checkpoint's (F16: numpy's rounding of it), and the heads the drafter reads from the file compute
what an independent numpy pass of the checkpoint computes (tests/medusa_heads.py). Bad input is one
line and leaves no file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hf_models import copy_with_config, make_random_hf_model, write_safetensors
from medusa_heads import make_random_medusa_heads, medusa_reference
from numpy_reference import load_hf_weights

from edgeinfer.convert import convert_model
from edgeinfer.engine.speculation.medusa import MedusaWeights
from edgeinfer.errors import ConversionError, InvalidOptionError
from edgeinfer.gguf_file import read_gguf


VOCAB = 1000  # the target's: a small SentencePiece vocabulary keeps each head's projection 1000 x 256


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    # The converter reads the vocabulary's size from the weights alone: 1000 tests what 49,152 would,
    # at a fiftieth of the cost (the default model's vocabulary made this file 11 s of the quick loop).
    corpus = "".join(Path(__file__).with_name(f).read_text() for f in ("hf_models.py", "medusa_heads.py")) * 2
    return make_random_hf_model(tmp_path_factory.mktemp("medusa-target") / "Llama-tiny", "llama", layers=1,
                                sentencepiece_corpus=corpus)


def gguf_tensor(path: Path, name: str) -> np.ndarray:
    """A tensor of the file in float32, read with gguf's own reader (not the drafter's loader)."""
    import gguf

    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(reversed([int(x) for x in t.shape])))


@pytest.mark.parametrize("layout,n_layers,shared,dtype,outtype", [
    ("medusa1", 1, False, "float32", "f32"),
    ("medusa1", 2, True, "bfloat16", "f32"),  # the published [ResBlock] * L: one block stored
    ("medusa2", 2, False, "float32", "f16"),
    ("medusa1", 0, False, "float16", "bf16"),  # no residual block: the projection alone
])
def test_heads_convert_exactly_and_compute_what_numpy_says(target, tmp_path, layout, n_layers, shared, dtype,
                                                           outtype):
    src = make_random_medusa_heads(tmp_path / "heads", target, n_heads=3, n_layers=n_layers, layout=layout,
                                   dtype=dtype, shared_block=shared)
    out = convert_model(src, outtype, tmp_path / "heads.gguf")
    assert out.architecture == "medusa" and out.manifest is None and out.outtype == outtype
    assert out.n_tensors == 3 * (2 * n_layers + 1)
    info = read_gguf(out.path)
    meta = info.metadata
    assert (meta["medusa.head_count"], meta["medusa.layer_count"]) == (3, n_layers)
    assert (meta["medusa.embedding_length"], meta["medusa.vocab_size"]) == (256, VOCAB)
    _, w = load_hf_weights(src)
    prefix = "medusa_head." if layout == "medusa2" else ""
    for i in range(3):
        for l in range(n_layers):
            k = 0 if shared else l
            got_w, got_b = gguf_tensor(out.path, f"medusa.{i}.res.{l}.weight"), gguf_tensor(out.path, f"medusa.{i}.res.{l}.bias")
            want_w = w[f"{prefix}{i}.{k}.linear.weight"]
            assert got_b.dtype == np.float32 and (got_b == w[f"{prefix}{i}.{k}.linear.bias"]).all()
            assert (got_w == (want_w.astype(np.float16) if outtype == "f16" else want_w)).all()
        proj = w[f"{prefix}{i}.{n_layers}.weight"]
        got = gguf_tensor(out.path, f"medusa.{i}.output.weight")
        if outtype == "bf16":
            assert np.abs(got - proj).max() <= np.abs(proj).max() * 2.0**-8  # bf16 keeps 8 bits of mantissa
        else:
            assert (got == (proj.astype(np.float16) if outtype == "f16" else proj)).all()
    # What the drafter reads from the file computes what the checkpoint computes.
    h = np.random.default_rng(0).standard_normal((5, 256))
    weights = MedusaWeights(out.path, info)
    got = np.stack([weights.logits(i, h.astype(np.float32)) for i in range(3)])
    want = medusa_reference(src, h)
    tol = {"f32": 1e-3, "f16": 5e-2, "bf16": 0.3}[outtype]
    assert np.abs(got - want).max() < tol * max(1.0, np.abs(want).max() / 10)


def test_medusa2_keeps_only_the_heads(target, tmp_path):
    src = make_random_medusa_heads(tmp_path / "m2", target, n_heads=2, layout="medusa2")
    info = read_gguf(convert_model(src, "f16", tmp_path / "m2.gguf").path)
    assert all(t.name.startswith("medusa.") for t in info.tensors) and len(info.tensors) == 2 * 3


def _heads(target: Path, tmp_path: Path) -> Path:
    return make_random_medusa_heads(tmp_path / "h", target, n_heads=2)


def _drop(name: str):
    def change(folder: Path) -> None:
        _, w = load_hf_weights(folder)
        del w[name]
        write_safetensors(folder / "medusa_lm_head.safetensors", w)
    return change


def _reshape(name: str):
    def change(folder: Path) -> None:
        _, w = load_hf_weights(folder)
        w[name] = w[name][:, :128]
        write_safetensors(folder / "medusa_lm_head.safetensors", w)
    return change


@pytest.mark.parametrize("config_change,weights_change,words", [
    (lambda c: c.update(medusa_num_heads=3), None, "medusa_num_heads 3"),
    (lambda c: c.update(medusa_num_heads=0), None, "medusa_num_heads must be"),
    (lambda c: c.update(medusa_num_heads="5"), None, "medusa_num_heads must be"),
    (lambda c: c.update(medusa_num_layers=2), None, "missing tensor 0.2.weight"),
    (lambda c: c.update(medusa_num_layers=-1), None, "medusa_num_layers must be"),
    (None, _drop("1.0.linear.bias"), "missing tensor 1.0.linear.bias"),
    (None, _reshape("1.0.linear.weight"), "has shape [256, 128]"),
    (None, _reshape("1.1.weight"), f"has shape [{VOCAB}, 128]"),
])
def test_hostile_heads_are_one_line_and_leave_no_file(target, tmp_path, config_change, weights_change, words):
    src = copy_with_config(_heads(target, tmp_path), tmp_path / "bad", config_change or (lambda c: None))
    if weights_change is not None:
        weights_change(src)
    with pytest.raises(ConversionError) as e:
        convert_model(src, "f32", tmp_path / "out.gguf")
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out.gguf").exists()


def test_heads_need_an_output_file_and_a_float_type(target, tmp_path):
    src = _heads(target, tmp_path)
    with pytest.raises(ConversionError, match="give an output file"):
        convert_model(src, "f16")
    with pytest.raises(InvalidOptionError, match="f32, f16, bf16"):
        convert_model(src, "q8_0", tmp_path / "q.gguf")
    assert not (tmp_path / "q.gguf").exists()


def test_torch_pickled_heads_are_refused_in_one_line_that_says_what_to_do(target, tmp_path):
    src = _heads(target, tmp_path)
    (src / "medusa_lm_head.safetensors").rename(src / "medusa_lm_head.pt")  # (its bytes are never read)
    with pytest.raises(ConversionError, match="save it as medusa_lm_head.safetensors") as e:
        convert_model(src, "f16", tmp_path / "x.gguf")
    assert "\n" not in str(e.value) and not (tmp_path / "x.gguf").exists()


def test_a_config_without_medusa_keys_is_not_taken_for_heads(target, tmp_path):
    src = _heads(target, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["medusa_num_heads"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="names no architecture"):
        convert_model(src, "f16", tmp_path / "x.gguf")
