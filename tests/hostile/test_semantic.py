"""Well-formed GGUF files that llama.cpp would abort on: each is refused by our validation with
one line naming the key or tensor, and loading it through the engine never kills the process."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as T

from edgeinfer import InvalidModelError
from edgeinfer.gguf_file import read_gguf
from edgeinfer.validate import PROBE_ENV, check_semantics, probe_load, validate_file

from .gguf_samples import DROP, N_EMBD, TOKENS, write_model

# name -> (write_model overrides, the key or tensor the message must name)
CASES = {
    "duplicate token text": ({"meta": {"tokenizer.ggml.tokens": (TOKENS[:-1] + [TOKENS[-2]], T.ARRAY)}},
                             "tokenizer.ggml.tokens"),
    "block_count 2^32-1": ({"meta": {"llama.block_count": (2**32 - 1, T.UINT32)}}, "llama.block_count"),
    "NaN rms epsilon": ({"meta": {"llama.attention.layer_norm_rms_epsilon": (math.nan, T.FLOAT32)}},
                        "llama.attention.layer_norm_rms_epsilon"),
    "negative rms epsilon": ({"meta": {"llama.attention.layer_norm_rms_epsilon": (-1e-5, T.FLOAT32)}},
                             "llama.attention.layer_norm_rms_epsilon"),
    "infinite rope base": ({"meta": {"llama.rope.freq_base": (math.inf, T.FLOAT32)}}, "llama.rope.freq_base"),
    "tokenizer model none": ({"meta": {"tokenizer.ggml.model": ("none", T.STRING)}}, "tokenizer.ggml.model"),
    "unknown tokenizer model": ({"meta": {"tokenizer.ggml.model": ("sentencepiece2", T.STRING)}}, "tokenizer.ggml.model"),
    "F16 output_norm": ({"tensors": {"output_norm.weight": np.ones(N_EMBD, np.float16)}}, "output_norm.weight"),
    "heads do not divide embedding": ({"meta": {"llama.attention.head_count": (3, T.UINT32)}}, "llama.attention.head_count"),
    "kv heads do not divide heads": ({"meta": {"llama.attention.head_count_kv": (3, T.UINT32)}},
                                     "llama.attention.head_count_kv"),
    "zero kv heads": ({"meta": {"llama.attention.head_count_kv": (0, T.UINT32)}}, "llama.attention.head_count_kv"),
    "zero context": ({"meta": {"llama.context_length": (0, T.UINT32)}}, "llama.context_length"),
    "unknown rope scaling": ({"meta": {"llama.rope.scaling.type": ("sideways", T.STRING)}}, "llama.rope.scaling.type"),
    "experts used without experts": ({"meta": {"llama.expert_used_count": (2, T.UINT32)}}, "expert_count"),
    "scores shorter than vocabulary": ({"meta": {"tokenizer.ggml.scores": ([0.0] * 10, T.ARRAY)}}, "tokenizer.ggml.scores"),
    "token types shorter than vocabulary": ({"meta": {"tokenizer.ggml.token_type": ([1] * 10, T.ARRAY)}},
                                            "tokenizer.ggml.token_type"),
    "eos id out of range": ({"meta": {"tokenizer.ggml.eos_token_id": (10**6, T.UINT32)}}, "tokenizer.ggml.eos_token_id"),
    "add_bos without a BOS": ({"meta": {"tokenizer.ggml.bos_token_id": DROP, "tokenizer.ggml.model": ("t5", T.STRING),
                                        "tokenizer.ggml.add_bos_token": (True, T.BOOL)}}, "add_bos_token"),
    "missing tokenizer": ({"meta": {"tokenizer.ggml.tokens": DROP}}, "tokenizer.ggml.tokens"),
    "missing layer tensor": ({"tensors": {"blk.1.ffn_up.weight": DROP}}, "blk.1.ffn_up.weight"),
    "layer past block_count": ({"meta": {"llama.block_count": (1, T.UINT32)}}, "blk.1."),
    "embedding of the wrong vocabulary size": (
        {"tensors": {"token_embd.weight": np.zeros((len(TOKENS) - 1, N_EMBD), np.float32)}}, "token_embd.weight"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_with_one_line_naming_the_key(tmp_path, case):
    overrides, named = CASES[case]
    path = write_model(tmp_path / "bad.gguf", **overrides)
    with pytest.raises(InvalidModelError) as info:
        validate_file(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("bad.gguf: ")
    assert named in message


def test_the_sample_itself_is_accepted(tmp_path):
    info = validate_file(write_model(tmp_path / "good.gguf"))
    assert info.architecture == "llama"
    qwen3 = validate_file(write_model(tmp_path / "qwen3.gguf", arch="qwen3"))
    assert qwen3.architecture == "qwen3"


def test_default_model_passes(default_model_path):
    check_semantics(read_gguf(default_model_path))


def test_duplicates_found_in_a_large_vocabulary(tmp_path):
    # over 256 tokens the reader does not keep the list: the duplicate is found while skipping it
    extra = [f"▁x{i}" for i in range(400)]
    tokens = TOKENS + extra + ["▁x17"]
    n = len(tokens)
    meta = {"tokenizer.ggml.tokens": (tokens, T.ARRAY), "tokenizer.ggml.scores": ([0.0] * n, T.ARRAY),
            "tokenizer.ggml.token_type": ([1] * n, T.ARRAY)}
    path = write_model(tmp_path / "dup.gguf", meta=meta,
                       tensors={"token_embd.weight": np.zeros((n, N_EMBD), np.float32)})
    with pytest.raises(InvalidModelError, match=rf"tokens {len(TOKENS) + 17} and {n - 1} have the same text"):
        validate_file(path)


def test_empty_token_counts_as_llama_cpp_names_it(tmp_path):
    tokens = list(TOKENS)
    tokens[-1] = ""  # llama.cpp stores it as "[EMPTY_i]"; a real token of that text collides
    tokens[-2] = f"[EMPTY_{len(tokens) - 1}]"
    path = write_model(tmp_path / "empty.gguf", meta={"tokenizer.ggml.tokens": (tokens, T.ARRAY)})
    with pytest.raises(InvalidModelError, match="same text"):
        validate_file(path)


# -- what llama.cpp itself does with these files, in a child process ----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", ["duplicate token text", "block_count 2^32-1", "NaN rms epsilon",
                                  "tokenizer model none", "F16 output_norm"])
def test_llama_cpp_would_have_failed_and_the_probe_says_why(tmp_path, case):
    """The cases of issue 12, fed to llama.cpp directly (no semantic check): the child process
    fails (an abort or a refusal), the parent gets one line and lives."""
    path = write_model(tmp_path / "bad.gguf", **CASES[case][0])
    with pytest.raises(InvalidModelError, match=r"^llama\.cpp could not load bad\.gguf: ") as info:
        probe_load(path)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_probe_accepts_the_sample(tmp_path):
    probe_load(write_model(tmp_path / "good.gguf"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["duplicate token text", "block_count 2^32-1", "NaN rms epsilon",
                                  "tokenizer model none", "F16 output_norm"])
def test_engine_load_of_a_bad_file_never_kills_the_process(tmp_path, case):
    """`edgeinfer.load` in a separate interpreter: a clean InvalidModelError, exit status 0."""
    path = write_model(tmp_path / "bad.gguf", **CASES[case][0])
    code = (
        "import sys, edgeinfer\n"
        "try:\n"
        f"    edgeinfer.load({str(path)!r}, n_ctx=64)\n"
        "except edgeinfer.InvalidModelError as e:\n"
        "    print('refused:', e)\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != PROBE_ENV}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("refused: bad.gguf: ")


# -- the gate: validation, then one child-process load per file --------------------------------


def test_register_refuses_what_llama_cpp_would_abort_on(tmp_path):
    from edgeinfer import Store

    store = Store()
    bad = write_model(tmp_path / "bad.gguf", **CASES["F16 output_norm"][0])
    with pytest.raises(InvalidModelError, match="output_norm.weight"):
        store.register(bad, "bad", "f16norm", owned=False)
    assert all(m.name != "bad" for m in store.list())


@pytest.fixture
def probes(monkeypatch) -> list[str]:
    """The child-process load turned on, recorded instead of run (what is tested is when it runs)."""
    from edgeinfer.validate import admission

    calls: list[str] = []
    monkeypatch.setenv(PROBE_ENV, "1")
    monkeypatch.setattr(admission, "_passed_in_this_process", set())
    monkeypatch.setattr(admission, "probe_load", lambda path, **_: calls.append(Path(path).name))
    return calls


def test_a_file_is_probed_once_then_remembered(tmp_path, probes):
    import shutil

    from edgeinfer import Store
    from edgeinfer.validate import admit

    store = Store()
    first = write_model(tmp_path / "one.gguf")
    admit(first, store)
    admit(first, store)
    assert probes == ["one.gguf"]
    shutil.copy(first, tmp_path / "copy.gguf")  # the same bytes elsewhere: known by content
    admit(tmp_path / "copy.gguf", store)
    assert probes == ["one.gguf"]
    other = write_model(tmp_path / "two.gguf", meta={"general.name": ("another", T.STRING)})
    admit(other, store)
    assert probes == ["one.gguf", "two.gguf"]


def test_registration_records_the_check_in_the_manifest(tmp_path, probes):
    from edgeinfer import Store
    from edgeinfer.validate import admit

    store = Store()
    path = write_model(tmp_path / "m.gguf")
    manifest = store.register(path, "sample", "f32", owned=False)
    assert probes == ["m.gguf"]
    assert manifest.load_checked == manifest.sha256
    admit(path, Store(), store.get("sample:f32"))  # a fresh process: the manifest says it loaded
    assert probes == ["m.gguf"]


def test_a_failed_probe_is_not_remembered(tmp_path, monkeypatch):
    import edgeinfer.validate as validate
    from edgeinfer import Store
    from edgeinfer.validate import admission

    calls = []

    def refuse(path, **_):
        calls.append(path)
        raise InvalidModelError(f"llama.cpp could not load {Path(path).name}: no")

    monkeypatch.setenv(PROBE_ENV, "1")
    monkeypatch.setattr(admission, "_passed_in_this_process", set())
    monkeypatch.setattr(admission, "probe_load", refuse)
    path = write_model(tmp_path / "m.gguf")
    for _ in range(2):
        with pytest.raises(InvalidModelError, match="llama.cpp could not load m.gguf"):
            validate.admit(path, Store())
    assert len(calls) == 2


@pytest.mark.slow
def test_register_refuses_what_only_llama_cpp_finds(tmp_path, monkeypatch):
    """A file our rules let through (rope.dimension_count 8 for 16-wide heads: llama.cpp's llama
    wants them equal) is refused by the real child-process load, in one line, and not registered."""
    from edgeinfer import Store

    monkeypatch.setenv(PROBE_ENV, "1")
    path = write_model(tmp_path / "rot.gguf", meta={"llama.rope.dimension_count": (8, T.UINT32)})
    validate_file(path)
    store = Store()
    with pytest.raises(InvalidModelError, match=r"^llama\.cpp could not load rot\.gguf: .*n_rot") as info:
        store.register(path, "rot", "f32", owned=False)
    assert "\n" not in str(info.value)
    assert all(m.name != "rot" for m in store.list())


def test_a_second_validation_skips_the_vocabulary_walk_only_for_the_same_file(tmp_path, monkeypatch):
    import edgeinfer.gguf_file as gguf_file
    from edgeinfer import Store

    store = Store()
    path = write_model(tmp_path / "m.gguf")
    first = validate_file(path, store)
    walks = []
    original = gguf_file._Cursor.first_duplicate
    monkeypatch.setattr(gguf_file._Cursor, "first_duplicate", lambda self, *a: walks.append(1) or original(self, *a))
    again = validate_file(path, store)
    assert walks == []  # stepped over: the same file, unchanged
    assert again.metadata == first.metadata and again.tensors == first.tensors
    # the same path rewritten with a duplicated token: walked again, and refused
    write_model(path, **CASES["duplicate token text"][0])
    with pytest.raises(InvalidModelError, match="same text"):
        validate_file(path, store)
    assert walks == [1]


# -- pull: a GGUF taken as it is passes the same gate before it is registered -------------------


@pytest.fixture
def local_hub(tmp_path, monkeypatch):
    from hub_server import local_hub

    with local_hub(monkeypatch, tmp_path / "hf-cache") as server:
        yield server


def test_pull_refuses_what_llama_cpp_would_abort_on(tmp_path, local_hub, probes):
    import edgeinfer
    from edgeinfer import Store

    bad = write_model(tmp_path / "bad.gguf", **CASES["F16 output_norm"][0])
    local_hub.add_repo("evil/Bad-GGUF", {"Bad-F32.gguf": bad})
    with pytest.raises(InvalidModelError, match="output_norm.weight") as info:
        edgeinfer.pull("evil/Bad-GGUF")
    assert "\n" not in str(info.value)
    assert probes == []  # refused before llama.cpp saw it, even in a child
    assert all(m.name != "bad" for m in Store().list())


def test_pull_loads_a_new_file_once_in_a_child_and_records_it(tmp_path, local_hub, probes):
    import edgeinfer

    good = write_model(tmp_path / "good.gguf")
    local_hub.add_repo("kind/Good-GGUF", {"Good-F32.gguf": good})
    manifest = edgeinfer.pull("kind/Good-GGUF").manifest
    assert probes == ["Good-F32.gguf"]
    assert manifest.load_checked == manifest.sha256
