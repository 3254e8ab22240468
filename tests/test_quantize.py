"""Quantization through llama.cpp's quantizer: requested tensor types, fallbacks, imatrix, clean failure."""

from __future__ import annotations

import _thread
import ctypes
import warnings
from pathlib import Path

import numpy as np
import pytest

# slow tier: every test here runs llama.cpp's quantizer (a child process) on a real model
pytestmark = pytest.mark.slow

K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


def make_synthetic_gguf(path: Path, *, n_embd: int = 256, n_ff: int = 512, n_layer: int = 2, n_head: int = 4,
                        n_head_kv: int = 2, seed: int = 0) -> Path:
    """A llama model with random F16 weights (every row length a multiple of 256) and SmolLM2's real
    tokenizer (copied from the default model's metadata)."""
    import gguf

    from edgeinfer.default_model import default_model_file
    from edgeinfer.gguf_file import read_gguf

    src = read_gguf(default_model_file(), keep_arrays=True).metadata
    n_vocab = len(src["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("synthetic-llama")
    w.add_block_count(n_layer)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value in src.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:  # token list, token types (int -> INT32), scores (float -> FLOAT32), merges
            w.add_array(key, list(value))

    def mat(rows: int, cols: int) -> np.ndarray:  # numpy [rows, cols] -> GGUF shape (cols, rows)
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))).astype(np.float16)

    hd = n_embd // n_head
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(n_head_kv * hd, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(n_head_kv * hd, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", mat(n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def synthetic_f16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_gguf(tmp_path_factory.mktemp("synthetic") / "synthetic-llama-f16.gguf")


def _leftovers(home: Path) -> list[Path]:
    models = home / "models"
    return [p for p in models.rglob("*") if p.is_file()] if models.exists() else []


def test_params_struct_matches_pinned_binding():
    import llama_cpp

    from edgeinfer.quantize import PARAMS_SIZE

    p = llama_cpp.llama_model_quantize_params
    assert llama_cpp.__version__ == "0.3.36"
    assert ctypes.sizeof(p) == PARAMS_SIZE == 64
    # layout of llama.h: 4 × int32, 6 bools, then 4 pointers and a size_t
    assert p.imatrix.offset == 24 and p.tt_overrides.offset == 40 and p.max_buf_size.offset == 56
    assert ctypes.sizeof(llama_cpp.llama_model_imatrix_data) == 24
    assert ctypes.sizeof(llama_cpp.llama_model_tensor_override) == 16


def test_the_child_processes_start_with_llama_cpp_s_bindings_only():
    """What the quantizer child and the load probe import to reach llama.cpp: the ctypes bindings,
    in an isolated interpreter, without the llama_cpp package's high-level half (its Llama class
    with numpy and jinja2, three quarters of a child's start-up)."""
    import subprocess
    import sys

    import edgeinfer

    helper = Path(edgeinfer.__file__).with_name("child_llama.py")
    code = ("import runpy, sys; ll = runpy.run_path(sys.argv[1])['bindings'](); ll.llama_backend_init(); "
            "print(ll.llama_model_quantize_default_params().nthread, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'jinja2') or m == 'llama_cpp.llama'))")
    r = subprocess.run([sys.executable, "-I", "-c", code, str(helper)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(maxsplit=1)[1].strip() == "[]", r.stdout


# Types whose blk.* weight matrices must all come out in exactly the requested ggml type.
PURE = {"Q8_0": "Q8_0", "Q4_0": "Q4_0", "F16": "F16", "BF16": "BF16", "Q6_K": "Q6_K", "IQ4_NL": "IQ4_NL"}
# k-quant mixes: the base type, plus the larger k-types the recipe gives some tensors.
MIXES = {
    "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K",
    "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "IQ4_XS": "IQ4_XS",
}  # fmt: skip


@pytest.mark.slow
def test_every_type_gives_the_requested_tensor_types(synthetic_f16: Path):
    from edgeinfer import read_gguf
    from edgeinfer.quantize import available_quant_types, quantize_model

    available = set(available_quant_types())
    assert set(PURE) | set(MIXES) <= available
    sizes = {}
    for qtype in list(PURE) + list(MIXES):
        # output and embedding stay F16 (copied): the vocabulary-sized tensors would dominate the time
        r = quantize_model(synthetic_f16, qtype, output_type="F16", embedding_type="F16", tag=qtype.lower(), n_threads=2)
        assert r.manifest.tag == qtype.lower() and r.manifest.derived_from == str(synthetic_f16.resolve())
        assert r.fallbacks == (), (qtype, r.fallbacks)  # every row is a multiple of 256 here
        info = read_gguf(r.path)
        blk = [t for t in info.tensors if len(t.shape) == 2 and t.name.startswith("blk.")]
        assert all(t.type_name == "F32" for t in info.tensors if len(t.shape) == 1)
        if qtype in PURE:
            assert {t.type_name for t in blk} == {PURE[qtype]}, qtype
        else:
            base = MIXES[qtype]
            got = [t.type_name for t in blk]
            assert got.count(base) >= len(got) // 2, (qtype, got)  # most tensors get the base type
            assert set(got) <= K_TYPES | {base}, (qtype, got)  # the rest only larger k-types
        # effective bits per weight: from the tensor bytes actually in the file
        assert r.bits_per_weight == pytest.approx(8 * sum(t.n_bytes for t in info.tensors) / info.parameter_count)
        sizes[qtype] = r.size
    # the nominal order holds when nothing falls back
    assert sizes["Q2_K"] < sizes["Q3_K_M"] < sizes["Q4_K_M"] < sizes["Q5_K_M"] < sizes["Q6_K"] < sizes["Q8_0"] < sizes["F16"]


def test_a_quantization_walks_only_its_output_s_vocabulary_once(synthetic_f16: Path, vocabulary_walks):
    """Walking the vocabulary and merges is most of a GGUF read: a quantization walks its output's
    once (not again after the rename to its final name), and a source read before not at all (nor
    the default model that each new store registers)."""
    from edgeinfer.quantize import quantize_model

    walked = vocabulary_walks
    quantize_model(synthetic_f16, "Q8_0", output_type="F16", embedding_type="F16", tag="walk-a")
    assert walked  # (this process may not have read the source, or the default model, before)
    walked.clear()
    quantize_model(synthetic_f16, "Q4_0", output_type="F16", embedding_type="F16", tag="walk-b")
    assert sorted(walked) == ["tokenizer.ggml.merges", "tokenizer.ggml.tokens"]  # the output only


def test_output_embedding_types_and_overrides(synthetic_f16: Path):
    from edgeinfer import read_gguf
    from edgeinfer.quantize import quantize_model

    r = quantize_model(synthetic_f16, "Q4_K_M", output_type="Q8_0", embedding_type="Q5_K",
                       overrides=[(r"blk\.0\.ffn_down", "F16"), (r"attn_q", "Q6_K")], n_threads=2)
    types = {t.name: t.type_name for t in read_gguf(r.path).tensors}
    assert types["output.weight"] == "Q8_0"
    assert types["token_embd.weight"] == "Q5_K"
    assert types["blk.0.ffn_down.weight"] == "F16"
    assert types["blk.0.attn_q.weight"] == types["blk.1.attn_q.weight"] == "Q6_K"
    assert r.manifest.tag == "q4_k_m-custom"
    assert r.manifest.source["overrides"] == [[r"blk\.0\.ffn_down", "F16"], ["attn_q", "Q6_K"]]


def test_progress_events_cover_every_tensor(synthetic_f16: Path):
    from edgeinfer import read_gguf
    from edgeinfer.quantize import quantize_model

    events = []
    r = quantize_model(synthetic_f16, "Q4_0", on_progress=events.append, n_threads=2)
    tensors = read_gguf(r.path).tensors
    assert [e.tensor_index for e in events] == list(range(1, len(tensors) + 1))
    assert all(e.n_tensors == len(tensors) for e in events)
    by_name = {t.name: t.type_name for t in tensors}
    assert {e.tensor_name: e.type_name for e in events} == by_name


@pytest.mark.slow
def test_smollm2_fallbacks_are_reported(default_model_path: Path):
    from edgeinfer import QuantizationError, Store, read_gguf
    from edgeinfer.quantize import quantize_model

    # the default model is Q4_1: requantizing needs the explicit flag, and warns
    with pytest.raises(QuantizationError, match="allow-requantize"):
        quantize_model("smollm2-135m-instruct:q4_1", "Q4_K_M")
    with pytest.warns(UserWarning, match="requantizing"):
        r = quantize_model("smollm2-135m-instruct:q4_1", "Q4_K_M", allow_requantize=True, n_threads=2)
    assert r.manifest.ref == "smollm2-135m-instruct:q4_k_m"
    assert r.manifest.derived_from == "smollm2-135m-instruct:q4_1" and r.requantized
    info = read_gguf(r.path)
    # independently: every matrix whose rows (576) are not a multiple of 256 is a fallback, the rest is not
    expected = {t.name for t in info.tensors if len(t.shape) == 2 and t.shape[0] % 256 and t.type_name not in K_TYPES}
    assert {f.tensor for f in r.fallbacks} == expected
    assert len(expected) > 100
    assert all(f.got in {"Q5_0", "Q8_0", "Q5_1", "Q4_0"} and f.shape[0] == 576 for f in r.fallbacks)
    assert r.bits_per_weight > 4.9  # well above Q4_K's 4.5 because of the fallbacks
    assert Store().get("smollm2-135m-instruct:q4_k_m").bits_per_weight == pytest.approx(r.bits_per_weight, abs=1e-3)


def test_interrupted_quantization_leaves_nothing(synthetic_f16: Path, edgeinfer_home: Path):
    from edgeinfer import Store
    from edgeinfer.quantize import quantize_model

    def ctrl_c(ev):  # runs on the quantizer's thread: deliver a real Ctrl-C to the main thread
        if ev.tensor_index == 3:
            _thread.interrupt_main()

    with pytest.raises(KeyboardInterrupt):
        quantize_model(synthetic_f16, "Q6_K", on_progress=ctrl_c, n_threads=2)
    assert Store().find("synthetic-llama:q6_k") is None
    assert _leftovers(edgeinfer_home) == []
    # and the logger is usable again: a following quantization reports progress
    events = []
    quantize_model(synthetic_f16, "Q6_K", on_progress=events.append, n_threads=2)
    assert events and events[-1].tensor_index == events[-1].n_tensors


def test_cancel_stops_the_quantizer_mid_file(synthetic_f16: Path, edgeinfer_home: Path):
    """A cancel between tensors ends the C call at once (its child process is killed): the
    tensors after it are never quantized and nothing is left behind."""
    import threading

    from edgeinfer import Cancelled, Store, read_gguf
    from edgeinfer.quantize import quantize_model

    stop = threading.Event()
    seen = []

    def on_progress(ev):
        seen.append(ev.tensor_index)
        if ev.tensor_index == 2:
            stop.set()

    with pytest.raises(Cancelled):
        quantize_model(synthetic_f16, "Q6_K", on_progress=on_progress, n_threads=1, cancel=stop)
    n_tensors = len(read_gguf(synthetic_f16).tensors)
    print(f"cancelled after tensor {max(seen)} of {n_tensors}")
    assert 2 <= max(seen) < n_tensors  # the tensors after the cancel were never quantized
    assert Store().find("synthetic-llama:q6_k") is None
    assert _leftovers(edgeinfer_home) == []


def test_failed_quantization_leaves_nothing(synthetic_f16: Path, edgeinfer_home: Path, tmp_path: Path):
    from edgeinfer import QuantizationError, Store
    from edgeinfer.imatrix import write_imatrix
    from edgeinfer.quantize import quantize_model

    bad = tmp_path / "wrong-size.imatrix.gguf"  # an imatrix of the wrong width: llama.cpp throws mid-file
    write_imatrix(bad, {"blk.0.attn_q.weight": np.ones((1, 128))}, {"blk.0.attn_q.weight": np.ones(1)})
    with pytest.raises(QuantizationError, match="imatrix size"):
        quantize_model(synthetic_f16, "Q4_K_M", imatrix=bad, n_threads=2)
    assert Store().find("synthetic-llama:q4_k_m-imat") is None
    assert _leftovers(edgeinfer_home) == []


def test_imatrix_is_read_and_used(synthetic_f16: Path, tmp_path: Path):
    from edgeinfer import read_gguf
    from edgeinfer.errors import InvalidModelError
    from edgeinfer.imatrix import read_imatrix, write_imatrix
    from edgeinfer.quantize import quantize_model

    info = read_gguf(synthetic_f16)
    rng = np.random.default_rng(1)
    sums, counts = {}, {}
    for t in info.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            sums[t.name] = rng.uniform(0.0, 50.0, size=(1, t.shape[0])) ** 3  # very uneven importance
            counts[t.name] = np.array([7.0])
    path = tmp_path / "m.imatrix.gguf"
    write_imatrix(path, sums, counts, datasets=("eval.txt",), chunk_count=3)
    im = read_imatrix(path)
    assert im.datasets == ("eval.txt",) and im.chunk_count == 3 and len(im) == len(sums)
    name = "blk.1.ffn_down.weight"
    np.testing.assert_allclose(im.entries[name], (sums[name] / 7.0).reshape(-1), rtol=1e-6)

    fast = dict(output_type="F16", embedding_type="F16", n_threads=2)  # vocabulary tensors copied, not quantized
    plain = quantize_model(synthetic_f16, "Q4_K_M", **fast)
    weighted = quantize_model(synthetic_f16, "Q4_K_M", imatrix=path, **fast)
    assert weighted.manifest.tag == "q4_k_m-custom-imat"
    a, b = read_gguf(plain.path), read_gguf(weighted.path)
    ta = {t.name: t for t in a.tensors}
    differs = []
    with open(plain.path, "rb") as fa, open(weighted.path, "rb") as fb:
        for t in b.tensors:
            if t.name in sums:
                fa.seek(ta[t.name].offset)
                fb.seek(t.offset)
                differs.append(fa.read(t.n_bytes) != fb.read(t.n_bytes))
    assert all(differs)  # every tensor with importance data was quantized differently

    broken = tmp_path / "broken.imatrix.gguf"
    write_imatrix(broken, {"x.weight": np.ones((1, 256))}, {"x.weight": np.array([-1.0])})
    with pytest.raises(InvalidModelError, match="negative"):
        read_imatrix(broken)


def test_bad_requests_are_one_line_errors(synthetic_f16: Path):
    from edgeinfer import InvalidOptionError, StoreError
    from edgeinfer.quantize import quantize_model

    with pytest.raises(InvalidOptionError, match="unknown quant type"):
        quantize_model(synthetic_f16, "Q7_K")
    with pytest.raises(InvalidOptionError, match="output tensor"):
        quantize_model(synthetic_f16, "Q4_0", output_type="Q9")
    with pytest.raises(InvalidOptionError, match="regex"):
        quantize_model(synthetic_f16, "Q4_0", overrides=[("blk.(", "Q8_0")])
    quantize_model(synthetic_f16, "Q4_0", n_threads=2)
    with pytest.raises(StoreError, match="already in the store"):
        quantize_model(synthetic_f16, "Q4_0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an F16 source is not a requantization: no warning
        quantize_model(synthetic_f16, "Q4_0", overwrite=True, n_threads=2)


def test_cli_quantize_ladder(synthetic_f16: Path, capsys: pytest.CaptureFixture[str]):
    from edgeinfer import Store
    from edgeinfer.cli import main

    assert main(["quantize", str(synthetic_f16), "--types", "Q8_0,Q4_K_M", "--threads", "2", "--embedding-type", "F16"]) == 0
    out = capsys.readouterr().out
    assert "synthetic-llama:q8_0-custom" in out and "synthetic-llama:q4_k_m-custom" in out and "bits/weight" in out
    assert {m.ref for m in Store().list()} >= {"synthetic-llama:q8_0-custom", "synthetic-llama:q4_k_m-custom"}
    assert main(["quantize", "smollm2-135m-instruct:q4_1", "--type", "Q4_K_M"]) == 1
    assert "allow-requantize" in capsys.readouterr().err


@pytest.mark.slow
def test_sigint_in_a_real_cli_process_leaves_nothing(synthetic_f16: Path, edgeinfer_home: Path):
    """Ctrl-C while llama.cpp writes the file: exit 130, no store entry, no partial file."""
    import os
    import signal
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, EDGEINFER_HOME=str(edgeinfer_home))
    proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "quantize", str(synthetic_f16), "--type", "IQ4_XS",
                             "--threads", "1"], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    partial: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None:  # wait until llama.cpp has written bytes
        partial = [p for p in _leftovers(edgeinfer_home) if p.name.endswith(".partial") and p.stat().st_size > 0]
        if partial:
            break
        time.sleep(0.02)
    assert partial, "quantization never started writing"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    assert b"interrupted" in err
    assert _leftovers(edgeinfer_home) == []
    assert not list((edgeinfer_home / "manifests").glob("synthetic-llama/*.json"))


def test_failing_progress_callback_aborts_cleanly(synthetic_f16: Path, edgeinfer_home: Path):
    from edgeinfer import Store
    from edgeinfer.quantize import quantize_model

    def broken(ev):
        raise RuntimeError("front end went away")

    with pytest.raises(RuntimeError, match="front end went away"):
        quantize_model(synthetic_f16, "Q4_0", output_type="F16", embedding_type="F16", on_progress=broken, n_threads=2)
    assert Store().find("synthetic-llama:q4_0-custom") is None
    assert _leftovers(edgeinfer_home) == []


def _nvfp4_reference(x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_nvfp4_ref then dequantize, in numpy: per 16 values a UE4M3 scale of
    amax/6 (gguf-py's port of ggml_fp32_to_ue4m3), each value the nearest of kvalues*scale (the
    first on a tie, as its strict `<` loop)."""
    from gguf.quants import NVFP4

    g = x.reshape(-1, 16).astype(np.float32)
    d = NVFP4.ue4m3_to_fp32(NVFP4.fp32_to_ue4m3(np.abs(g).max(axis=1) / np.float32(6.0)))[:, None]
    kv = np.array(NVFP4.kvalues, np.float32)
    best = np.abs(kv[None, None, :] * d[:, :, None] - g[:, :, None]).argmin(axis=2)
    return (kv[best] * d).reshape(x.shape)


def test_fp4_types_from_f16(synthetic_f16: Path):
    """`quantize --types NVFP4,MXFP4`: every weight of the blocks in the FP4 type (the pinned
    quantizer has no recipe of its own for either on a dense model: TYPE_RECIPES), the vocabulary
    tensors Q8_0, the file type written over; the blocks are llama.cpp's reference rounding,
    checked against gguf-py's MXFP4 quantizer and a numpy NVFP4 one."""
    import gguf

    from edgeinfer import read_gguf
    from edgeinfer.quantize import available_quant_types, quantize_model

    assert {"NVFP4", "MXFP4", "IQ2_XS", "IQ3_XXS", "IQ1_S"} <= set(available_quant_types())
    src = read_gguf(synthetic_f16)
    raw_src = np.memmap(synthetic_f16, dtype=np.uint8, mode="r")
    weights = {t.name: np.frombuffer(raw_src[t.offset : t.offset + t.n_bytes], np.float16).astype(np.float32)
               .reshape(t.shape[1], t.shape[0]) for t in src.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    for qtype, file_type in (("NVFP4", "NVFP4"), ("MXFP4", "MXFP4_MOE")):
        r = quantize_model(synthetic_f16, qtype, n_threads=2)
        assert r.manifest.tag == qtype.lower() and r.manifest.quant == file_type
        info = read_gguf(r.path)
        types = {t.name: t.type_name for t in info.tensors if len(t.shape) == 2}
        assert {types[n] for n in weights} == {qtype}
        assert types["token_embd.weight"] == "Q8_0" and types.get("output.weight", "Q8_0") == "Q8_0"
        raw = np.memmap(r.path, dtype=np.uint8, mode="r")
        for t in info.tensors:
            if t.name not in weights:
                continue
            blocks = np.asarray(raw[t.offset : t.offset + t.n_bytes]).reshape(t.shape[1], -1)
            w = weights[t.name]
            if qtype == "MXFP4":
                assert np.array_equal(blocks, gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)), t.name
            else:
                got = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.NVFP4).reshape(w.shape)
                assert np.array_equal(got, _nvfp4_reference(w)), t.name
