"""EAGLE-3 drafter checkpoints convert to llama.cpp's `eagle3`, with their target named (the layers
it reads, their width) as llama.cpp expects, and what llama.cpp computes from them agrees with an
independent numpy pass (tests/numpy_eagle3.py): the target's layer inputs it reads, the fused
features its encoder makes of them, and its decoder's logits at the draft vocabulary's target ids.

The drafter is tiny and random, in SpecForge's layout (`midlayer.*`, `fc`, `lm_head` over a draft
vocabulary, int64 `d2t` offsets, no tokenizer), over a tiny random qwen3 target.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp  # noqa: F401 - a hard dependency: missing, these tests fail (never skip)
import numpy as np
import pytest

from edgeinfer.convert import convert_model
from edgeinfer.errors import ConversionError
from edgeinfer.gguf_file import read_gguf
from edgeinfer.validate import probe_load, validate_file

from hf_models import copy_with_config, make_random_eagle3_drafter, make_random_hf_model
from llama_ext import context, decode_tokens, ext, logits_rows, process_pairs
from numpy_eagle3 import eagle3_features, eagle3_logits
from numpy_reference import forward_logits

AUX = [1, 4, 6]  # the target layers (inputs) the drafter reads


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    """(target folder, drafter folder, target f32 GGUF, drafter f32 GGUF)."""
    root = tmp_path_factory.mktemp("eagle3")
    target = make_random_hf_model(root / "Qwen3-tiny", "qwen3", layers=8, heads=4, kv_heads=2)
    drafter = make_random_eagle3_drafter(root / "Qwen3-tiny-eagle3", target, aux_layers=AUX)
    t = convert_model(target, "f32", root / "target.gguf", register=False).path
    d = convert_model(drafter, "f32", root / "drafter.gguf", register=False, target=target).path
    return target, drafter, t, d


def test_drafter_gguf_names_its_target_and_maps_its_vocabulary(pair):
    target, drafter, _, path = pair
    info = validate_file(path)
    meta = info.metadata
    assert meta["general.architecture"] == "eagle3" and meta["eagle3.block_count"] == 1
    assert meta["eagle3.target_layers"] == AUX and meta["eagle3.target_hidden_size"] == 256
    assert meta["eagle3.norm_before_residual"] is False and meta["eagle3.norm_before_fc"] is False
    assert meta["tokenizer.ggml.pre"] == "qwen2" and meta["tokenizer.ggml.tokens"].length == 49152  # the target's
    t = {x.name: x for x in info.tensors}
    assert t["fc.weight"].shape == (768, 256) and t["blk.0.attn_q.weight"].shape == (512, 256)
    assert t["output.weight"].shape == (256, 4096) and "token_embd.weight" not in t  # the target's at run time
    assert t["d2t"].type_name == "I64"
    ids = np.fromfile(path, dtype="<i8", count=4096, offset=t["d2t"].offset)
    tables = (drafter / "model-tables.safetensors").read_bytes()
    n = int.from_bytes(tables[:8], "little")
    offsets = np.frombuffer(tables[8 + n: 8 + n + 4096 * 8], "<i8")
    assert (ids == offsets + np.arange(4096)).all()  # absolute target ids, as llama.cpp wants


@pytest.mark.slow
def test_drafter_loads_alone_in_the_probe(pair):
    probe_load(pair[3])  # weights only: its context needs the target's


@pytest.mark.slow
def test_encoder_and_decoder_match_numpy(pair):
    """Target context with its layer inputs extracted; drafter context linked to it (ctx_other:
    the target's token embeddings); encoder batch of fused features, decoder batch of
    (token[P+1], g[P]) pairs at positions P, as common/speculative.cpp's draft-eagle3 does."""
    target, drafter, tpath, dpath = pair
    x = ext()
    ll = x.ll
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    mt = ll.llama_model_load_from_file(str(tpath).encode(), mp)
    md = ll.llama_model_load_from_file(str(dpath).encode(), mp)
    ct = cd = None
    try:
        ids = [x.target_layer_ids(md)[i] for i in range(x.target_layer_ids_n(md))]
        assert ids == AUX
        rng = np.random.default_rng(3)
        tokens = [int(t) for t in rng.integers(17, 49152, 24)]
        T, n_embd, n_vocab = len(tokens), 256, ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(mt))
        ct = context(mt)
        for i in ids:
            x.set_embeddings_layer_inp(ct, i, True)
        decode_tokens(ct, tokens)
        feats = np.concatenate([np.ctypeslib.as_array(x.get_embeddings_layer_inp(ct, i), shape=(T, n_embd)).copy()
                                for i in ids], axis=1)
        layer_inputs: list[np.ndarray] = []
        forward_logits(target, tokens, layer_inputs=layer_inputs)
        f_err = np.abs(feats - np.concatenate([layer_inputs[i] for i in ids], axis=1)).max()

        cd = context(md, other=ct)
        x.set_embeddings_nextn(cd, True, True)  # the encoder's output and the decoder's pre-norm state
        assert process_pairs(cd, None, feats, list(range(T)), encode=True) == 0
        g = np.ctypeslib.as_array(x.get_embeddings_nextn(cd), shape=(T, n_embd)).copy()
        g_err = np.abs(g - eagle3_features(drafter, feats.astype(np.float64))).max()

        assert process_pairs(cd, tokens[1:], g[:-1], list(range(T - 1))) == 0
        got = logits_rows(cd, T - 1, n_vocab)
        want = eagle3_logits(drafter, target, tokens[1:], g[:-1].astype(np.float64))
        drafted = np.isfinite(want)
        assert (np.isfinite(got) == drafted).all() and drafted.sum(1).max() == 4096  # only draft ids get logits
        err = np.abs(got[drafted] - want[drafted]).max()
        print(f"eagle3: target states max|Δ| {f_err:.3g}, features {g_err:.3g}, logits {err:.3g} "
              f"(scale {np.abs(want[drafted]).max():.3g})")
        assert f_err < 1e-4 and g_err < 1e-4 and err < 1e-3
        assert (got.argmax(1) == want.argmax(1)).all()
    finally:
        for ctx in (cd, ct):
            if ctx:
                ll.llama_free(ctx)
        ll.llama_model_free(md)
        ll.llama_model_free(mt)


def test_a_llama_named_drafter_is_still_eagle3(pair, tmp_path):
    """llama.cpp's rule: a one-layer llama with a draft vocabulary is an EAGLE-3 drafter."""
    target, drafter, _, _ = pair
    src = copy_with_config(drafter, tmp_path / "d", lambda c: c.update(architectures=["LlamaForCausalLM"]))
    out = convert_model(src, "f16", tmp_path / "d.gguf", register=False, target=target)
    assert out.architecture == "eagle3" and read_gguf(out.path).metadata["eagle3.target_layers"] == AUX


@pytest.mark.parametrize("change,with_target,words", [
    (lambda c: c.pop("eagle_config"), False, "target model's folder"),
    (lambda c: None, False, "target_hidden_size"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2]), True, "3 layer indices"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]), True, "past the target"),
    (lambda c: c.update(vocab_size=32000), True, "vocab_size"),
    (lambda c: c.update(draft_vocab_size=2048), True, "has shape"),
    (lambda c: c.update(num_hidden_layers=2), True, "1 layer"),
])
def test_hostile_drafter_config_is_one_line_conversion_error(pair, tmp_path, change, with_target, words):
    target, drafter, _, _ = pair
    src = copy_with_config(drafter, tmp_path / "d", change)
    with pytest.raises(ConversionError) as e:
        convert_model(src, "f32", tmp_path / "out.gguf", register=False, target=target if with_target else None)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out.gguf").exists()


def test_a_d2t_outside_the_vocabulary_is_refused(pair, tmp_path):
    target, drafter, _, _ = pair
    src = copy_with_config(drafter, tmp_path / "d", lambda c: None)
    raw = bytearray((drafter / "model-tables.safetensors").read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n: 8 + n + 8] = (10**6).to_bytes(8, "little", signed=True)  # draft id 0 -> a target id past the end
    (src / "model-tables.safetensors").unlink()
    (src / "model-tables.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ConversionError, match="outside the target's vocabulary"):
        convert_model(src, "f32", tmp_path / "out.gguf", register=False, target=target)


def test_validator_refuses_what_the_eagle3_graph_would_trip_on(pair):
    import dataclasses

    from edgeinfer.errors import InvalidModelError
    from edgeinfer.validate import check_semantics

    info = read_gguf(pair[3])
    check_semantics(info)
    for change, words in (({"eagle3.block_count": 2}, "1 layer"), ({"eagle3.target_layers": [1, 2]}, "target_layers"),
                          ({"eagle3.target_hidden_size": 128}, "fc.weight")):
        with pytest.raises(InvalidModelError, match=words):
            check_semantics(dataclasses.replace(info, metadata={**info.metadata, **change}))
