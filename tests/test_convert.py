"""edgeinfer convert: structure of the output, bad input, interruption, the CLI (no llama.cpp needed)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from edgeinfer import read_gguf
from edgeinfer.cli import main
from edgeinfer.convert import ConvertProgress, NonFiniteWeightWarning, convert_model, supported_architectures
from edgeinfer.convert.safetensors import SafetensorsFile, open_checkpoint
from edgeinfer.errors import Cancelled, ConversionError
from edgeinfer.store import Store

from hf_models import make_random_hf_model, write_safetensors

SMALL = dict(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, dtype="float16")


@pytest.fixture(scope="module")
def small_models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hf-small")
    return {
        "llama": make_random_hf_model(base / "tiny-llama", "llama", **SMALL),
        "qwen2": make_random_hf_model(base / "tiny-qwen2", "qwen2", **SMALL),
        "qwen3": make_random_hf_model(base / "tiny-qwen3", "qwen3", **SMALL),
    }


@pytest.fixture
def model(small_models, tmp_path) -> Path:
    """A private copy of the small llama folder that a test may damage."""
    return Path(shutil.copytree(small_models["llama"], tmp_path / "tiny-llama"))


def _store_files() -> dict[str, int]:
    root = Store().root
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != ".store.lock"}


def _assert_nothing_written(before: dict[str, int]) -> None:
    after = _store_files()
    assert after == before, f"store changed: {set(after) ^ set(before)}"


def _metadata(path: Path) -> dict:
    return read_gguf(path).metadata


# -- what a conversion writes ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch,pre,gguf_arch",
    [("llama", "smollm", "llama"), ("qwen2", "qwen2", "qwen2"), ("qwen3", "qwen2", "qwen3")],
)
def test_convert_registers_model_with_identified_pre_tokenizer(small_models, arch, pre, gguf_arch):
    result = convert_model(small_models[arch], "f16")
    m = result.manifest
    assert m is not None and m.ref == f"tiny-{arch}:f16" and m.owned
    assert result.path == Store().model_path(f"tiny-{arch}", "f16") and result.path.exists()
    assert m.derived_from == str(small_models[arch].resolve())
    assert m.source["kind"] == "convert" and m.architecture == gguf_arch
    meta = _metadata(result.path)
    assert meta["general.architecture"] == gguf_arch
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == pre
    assert meta["tokenizer.ggml.bos_token_id"] == 1 and meta["tokenizer.ggml.eos_token_id"] == 2
    assert "im_start" in meta["tokenizer.chat_template"]
    info = read_gguf(result.path)
    types = {t.name: t.type_name for t in info.tensors}
    assert "output.weight" not in types  # tied embeddings
    assert all(t == "F32" for n, t in types.items() if n.endswith("norm.weight") or n.endswith(".bias"))
    assert types["blk.0.attn_q.weight"] == "F16"
    if arch == "qwen2":
        assert "blk.0.attn_q.bias" in types
    if arch == "qwen3":
        assert "blk.0.attn_q_norm.weight" in types and meta["qwen3.attention.key_length"] == 64
    assert Store().get(f"tiny-{arch}:f16").sha256 == m.sha256


@pytest.mark.slow
def test_default_outtype_follows_source_dtype_and_q8_0(tmp_path):
    src = make_random_hf_model(tmp_path / "bf", "llama", **{**SMALL, "dtype": "bfloat16"}, tied=False)
    r = convert_model(src)
    assert r.outtype == "bf16" and r.manifest.ref == "bf:bf16"
    types = {t.name: t.type_name for t in read_gguf(r.path).tensors}
    assert types["output.weight"] == "BF16" and types["blk.0.ffn_down.weight"] == "BF16"
    q = convert_model(src, "q8_0", name="Other Name")
    assert q.manifest.ref == "other-name:q8_0" and q.manifest.quant == "Q8_0"
    qt = {t.name: t.type_name for t in read_gguf(q.path).tensors}
    assert qt["blk.0.ffn_down.weight"] == "Q8_0" and qt["output_norm.weight"] == "F32"


@pytest.mark.slow
def test_output_file_is_external_and_sharded_equals_single(small_models, tmp_path):
    single = convert_model(small_models["llama"], "f32", tmp_path / "single.gguf")
    assert single.manifest is not None and not single.manifest.owned
    sharded_dir = make_random_hf_model(tmp_path / "tiny-llama", "llama", **SMALL, shards=3)
    assert len(list(sharded_dir.glob("*.safetensors"))) == 3
    sharded = convert_model(sharded_dir, "f32", tmp_path / "sharded.gguf", register=False)
    assert sharded.manifest is None
    a, b = read_gguf(single.path), read_gguf(sharded.path)
    assert [(t.name, t.shape, t.type_name) for t in a.tensors] == [(t.name, t.shape, t.type_name) for t in b.tensors]
    da, db = single.path.read_bytes(), sharded.path.read_bytes()
    for ta, tb in zip(a.tensors, b.tensors):
        assert da[ta.offset : ta.offset + ta.n_bytes] == db[tb.offset : tb.offset + tb.n_bytes], ta.name


@pytest.mark.slow
def test_llama3_rope_scaling_writes_rope_freqs(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    src = make_random_hf_model(tmp_path / "l3", "llama", **SMALL, rope_theta=500000.0, rope_scaling=scaling,
                               pre_tokenizer="llama-bpe")
    r = convert_model(src, "f16")
    meta = _metadata(r.path)
    assert meta["tokenizer.ggml.pre"] == "llama-bpe"
    freqs = [t for t in read_gguf(r.path).tensors if t.name == "rope_freqs.weight"]
    assert freqs and freqs[0].shape == (16,) and freqs[0].type_name == "F32"


def test_progress_events_cover_every_tensor(small_models):
    events: list[ConvertProgress] = []
    r = convert_model(small_models["qwen2"], "f32", on_progress=events.append)
    assert [e.index for e in events] == list(range(1, r.n_tensors + 1))
    assert events[-1].bytes_done == events[-1].bytes_total == r.source_bytes
    assert {e.tensor for e in events} == {t.name for t in read_gguf(r.path).tensors}


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "remove,match",
    [("config.json", "missing config.json"), ("model.safetensors", "no safetensors weights"),
     ("tokenizer.json", "no tokenizer.json")],
)
def test_missing_files(model, remove, match):
    before = _store_files()
    (model / remove).unlink()
    with pytest.raises(ConversionError, match=match):
        convert_model(model)
    _assert_nothing_written(before)


def test_unsupported_architecture_names_the_supported_ones(model):
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError) as e:
        convert_model(model)
    msg = str(e.value)
    assert "GPTNeoXForCausalLM" in msg
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in msg and name in supported_architectures()
    assert "\n" not in msg


@pytest.mark.parametrize(
    "key,value,match",
    [("intermediate_size", 256, r"mlp\.gate_proj\.weight has shape \[128, 64\] but config.json implies \[256, 64\]"),
     ("num_key_value_heads", 2, r"k_proj\.weight has shape"),
     ("num_hidden_layers", 2, r"missing tensor model\.layers\.1\."),
     ("vocab_size", 1000, r"(token id|embed_tokens)")],
)
def test_shapes_contradicting_config(model, key, value, match):
    before = _store_files()
    cfg = json.loads((model / "config.json").read_text())
    cfg[key] = value
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=match):
        convert_model(model)
    _assert_nothing_written(before)


def test_unexpected_tensor_is_refused(model):
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 0 + 1
    (model / "config.json").write_text(json.dumps(cfg))
    f = SafetensorsFile(model / "model.safetensors")
    tensors = {n: f.array(n).astype(np.float32) for n in f.tensors}
    f.close()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(16, np.float32)  # skipped silently
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.ones(64, np.float32)
    write_safetensors(model / "model.safetensors", tensors, "float16")
    with pytest.raises(ConversionError, match=r"unexpected tensor model\.layers\.0\.self_attn\.o_proj\.bias"):
        convert_model(model)


def test_truncated_safetensors(model):
    before = _store_files()
    p = model / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])
    with pytest.raises(ConversionError, match="truncated"):
        convert_model(model)
    _assert_nothing_written(before)


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    path.write_bytes(len(hj).to_bytes(8, "little") + hj + raw[8 + n :])


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda h: h["model.norm.weight"].update(data_offsets=[0, 10**9]), "ends at byte"),
        (lambda h: h["model.norm.weight"].update(data_offsets=[4, 2]), "invalid data_offsets"),
        (lambda h: h["model.norm.weight"].update(shape=[65]), "needs 130 bytes but its offsets span 128"),
        (lambda h: h["model.norm.weight"].update(data_offsets=[h["model.embed_tokens.weight"]["data_offsets"][0],
                                                               h["model.embed_tokens.weight"]["data_offsets"][0] + 128]),
         "overlap"),
        (lambda h: h["model.norm.weight"].update(dtype="Q4"), "unknown dtype"),
        (lambda h: h["model.norm.weight"].update(dtype="I64", shape=[16]), "only F32, F16 and BF16"),
    ],
)
def test_header_lying_about_offsets(model, edit, match):
    _rewrite_header(model / "model.safetensors", edit)
    with pytest.raises(ConversionError, match=match):
        convert_model(model)


def test_header_length_past_end(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(ConversionError, match="runs past the end"):
        SafetensorsFile(p)
    p.write_bytes((2).to_bytes(8, "little") + b"[]")
    with pytest.raises(ConversionError, match="not a JSON object"):
        SafetensorsFile(p)


def test_index_naming_a_missing_shard(tmp_path):
    src = make_random_hf_model(tmp_path / "m", "llama", **SMALL, shards=2)
    next(iter(sorted(src.glob("model-*.safetensors")))).unlink()
    with pytest.raises(ConversionError, match="missing weight shard model-00001-of-00002"):
        open_checkpoint(src)


def test_unknown_pre_tokenizer_is_an_error(model):
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Whitespace"}
    (model / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConversionError, match="unknown BPE pre-tokenizer.*supported: gpt-2, gpt-4o, llama-bpe, qwen2, qwen35, smollm"):
        convert_model(model)


@pytest.mark.parametrize("form", ["pairs", "strings"])
def test_merges_are_what_gguf_py_reads(model, form):
    """Both tokenizer.json forms of the merges (pairs, which may hold spaces; "a b" strings) give
    the merges gguf-py's own SpecialVocab reads, and a merge of another shape is a clear error."""
    import gguf

    from edgeinfer.convert.tokenizer import load_vocab

    tok = json.loads((model / "tokenizer.json").read_text())
    pairs = tok["model"]["merges"]
    assert isinstance(pairs[0], list)
    pairs[:2] = [["a b", "c"], [" x", "y  "]]  # spaces inside parts: stored as U+0120
    tok["model"]["merges"] = pairs if form == "pairs" else [" ".join(p) for p in pairs[2:]]
    (model / "tokenizer.json").write_text(json.dumps(tok))
    reference = gguf.SpecialVocab(model, load_merges=True).merges
    assert reference and load_vocab(model, None).special.merges == reference

    tok["model"]["merges"] = pairs[2:] + [["a", "b", "c"]]
    (model / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConversionError, match=rf"merge {len(pairs) - 2} is \['a', 'b', 'c'\], not a string or a pair"):
        load_vocab(model, None)


def test_nan_and_inf_weights_warn_naming_the_tensor(model):
    f = SafetensorsFile(model / "model.safetensors")
    tensors = {n: f.array(n).astype(np.float32) for n in f.tensors}
    f.close()
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = np.nan
    tensors["model.layers.0.self_attn.v_proj.weight"][0, 0] = np.inf
    write_safetensors(model / "model.safetensors", tensors, "float16")
    with pytest.warns(NonFiniteWeightWarning) as rec:
        r = convert_model(model, "f16")
    msgs = [str(w.message) for w in rec if issubclass(w.category, NonFiniteWeightWarning)]
    assert any("model.layers.0.mlp.up_proj.weight" in m for m in msgs)
    assert any("model.layers.0.self_attn.v_proj.weight" in m for m in msgs)
    assert len(r.warnings) == 2 and r.path.exists()


@pytest.mark.slow
def test_interrupt_mid_conversion_leaves_store_as_it_was(model):
    first = convert_model(model, "f16")  # an existing model of the same name:tag must survive
    before = _store_files()

    def interrupt(ev: ConvertProgress) -> None:
        if ev.index == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_model(model, "f16", on_progress=interrupt)
    _assert_nothing_written(before)
    assert Store().get("tiny-llama:f16").sha256 == first.manifest.sha256
    with pytest.raises(KeyboardInterrupt):
        convert_model(model, "q8_0", on_progress=interrupt)
    _assert_nothing_written(before)
    assert not list(first.path.parent.glob("*.partial"))


def test_cancel_event_raises_cancelled(model, tmp_path):
    import threading

    ev = threading.Event()
    ev.set()
    out = tmp_path / "x.gguf"
    with pytest.raises(Cancelled):
        convert_model(model, "f32", out, cancel=ev)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


# -- the CLI ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_convert(model, capsys):
    assert main(["convert", str(model), "--outtype", "q8_0", "--name", "cli-model"]) == 0
    out = capsys.readouterr().out
    assert "cli-model:q8_0" in out
    assert Store().get("cli-model:q8_0").quant == "Q8_0"


def test_cli_convert_errors_are_one_line(model, capsys):
    (model / "tokenizer.json").unlink()
    assert main(["convert", str(model)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("edgeinfer: error: no tokenizer.json") and len(err) == 1
    assert main(["convert", str(model.parent / "does-not-exist")]) == 1
    assert "no such model folder" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_nan_warning_is_printed(model, capsys):
    f = SafetensorsFile(model / "model.safetensors")
    tensors = {n: f.array(n).astype(np.float32) for n in f.tensors}
    f.close()
    tensors["model.norm.weight"][0] = np.inf
    write_safetensors(model / "model.safetensors", tensors, "float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CLI must catch and print it, not raise
        assert main(["convert", str(model)]) == 0
    assert "edgeinfer: warning: tensor model.norm.weight has NaN or Inf values" in capsys.readouterr().err


@pytest.mark.slow
def test_values_too_large_for_f16_warn(model):
    f = SafetensorsFile(model / "model.safetensors")
    tensors = {n: f.array(n).astype(np.float32) for n in f.tensors}
    f.close()
    tensors["model.layers.0.mlp.down_proj.weight"][1, 2] = 1e6
    write_safetensors(model / "model.safetensors", tensors, "float32")
    with pytest.warns(NonFiniteWeightWarning, match="model.layers.0.mlp.down_proj.weight has values too large for f16"):
        convert_model(model, "f16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_model(model, "f32")  # f32 holds them: no warning


def test_name_of_a_hub_cache_snapshot(small_models, tmp_path):
    snap = tmp_path / "models--SomeOrg--Tiny-Model-1B" / "snapshots" / ("ab" * 20)
    shutil.copytree(small_models["qwen2"], snap)
    r = convert_model(snap, "f16", repo_id="SomeOrg/Tiny-Model-1B")
    assert r.manifest.ref == "tiny-model-1b:f16"
    assert r.manifest.derived_from == "SomeOrg/Tiny-Model-1B" and r.manifest.source["repo"] == "SomeOrg/Tiny-Model-1B"
    assert _metadata(r.path)["general.source.repo_url"] == "https://huggingface.co/SomeOrg/Tiny-Model-1B"


def test_damaged_sentencepiece_model(model):
    (model / "tokenizer.model").write_bytes(b"\x0a\x05not a model" * 10)
    with pytest.raises(ConversionError, match="tokenizer.model is not a valid SentencePiece model"):
        convert_model(model)


@pytest.mark.slow
def test_converter_imports_no_ml_framework():
    import subprocess
    import sys

    code = (
        "import sys, edgeinfer.convert, edgeinfer.cli.convert\n"
        "bad = [m for m in ('torch', 'transformers', 'tokenizers', 'safetensors', 'textual', 'rich') if m in sys.modules]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


@pytest.mark.slow
def test_output_file_does_not_take_over_another_models_name(model, tmp_path):
    owned = convert_model(model, "f16")
    with pytest.raises(ConversionError, match="tiny-llama:f16 is already in the store"):
        convert_model(model, "f16", tmp_path / "elsewhere.gguf")
    assert not (tmp_path / "elsewhere.gguf").exists()
    assert Store().get("tiny-llama:f16").file == owned.manifest.file
    ext = convert_model(model, "f16", tmp_path / "elsewhere.gguf", name="tiny-llama-copy")
    assert ext.manifest.ref == "tiny-llama-copy:f16" and not ext.manifest.owned
