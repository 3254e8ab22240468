"""Embeddings: `edgeinfer.engine.embedding.Embedder`, `edgeinfer embed`, `/v1/embeddings`, and the
converter's sentence-transformers support (a Qwen3-Embedding-shaped checkpoint written here).

The independent reference is llama-cpp-python's own path on the same file (`Llama(embedding=True,
pooling_type=...).embed`, which tokenizes, batches and pools without our code), and for the
converted model also a float64 numpy forward pass of the HF checkpoint. llama-cpp-python's default
has flash attention off, as the engines loaded here (`flash_attn=False`); where our default (auto:
on for the CPU) is compared, the reference gets `flash_attn=True` (llama.cpp's CPU flash attention
accumulates V in f16: ~5e-4 apart from the other path, on unit vectors).

The module's tests build an Embedder over an engine's model (`_embedder`); the engines' public
`embed` (Engine and BatchEngine share it), the CLI and the server go through the same class.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hf_models import (
    QWEN3_EMBEDDING_PROMPTS,
    make_embedding_hf_model,
    write_safetensors,
)

import edgeinfer
from edgeinfer import EmbedOptions
from edgeinfer.convert.embedding import embedding_files, read_embedding_spec
from edgeinfer.engine.embedding import Embedder

POOLING_CODES = {"mean": 1, "cls": 2, "last": 3}
TEXTS = [
    "The weather is lovely today.",
    "It's so sunny outside!",
    "He drove to the stadium.",
    "Gravity is a force that attracts two bodies towards each other.",
    "ok",
]
QUERY = QWEN3_EMBEDDING_PROMPTS["query"]


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert text and "\n" not in text and "Traceback" not in text, text
    return text


def _lcp(path: Path, texts: list, *, pooling: str | None = None, normalize: bool = True, flash_attn: bool = False,
         n_ctx: int = 512, kv_f32: bool = False) -> np.ndarray:
    """llama-cpp-python's embeddings of `texts` (strings) on `path`, float64."""
    import llama_cpp

    threads = edgeinfer.LoadOptions().threads
    kw: dict = {"embedding": True, "n_ctx": n_ctx, "n_threads": threads, "n_threads_batch": threads, "verbose": False,
                "flash_attn": flash_attn}
    if pooling is not None:
        kw["pooling_type"] = POOLING_CODES[pooling]
    if kv_f32:
        kw["type_k"] = kw["type_v"] = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(str(path), **kw)
    try:
        return np.array(llm.embed(texts, normalize=normalize), dtype=np.float64)
    finally:
        llm.close()


def _embedder(engine, **kw) -> Embedder:
    """An Embedder over the engine's model: the module itself, its attributes and limits (the
    public `engine.embed` is the same object behind a lock: test_the_engines_embed_is_the_embedder)."""
    return Embedder(engine._runtime, **kw)


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_embedding_dir(tmp_path_factory) -> Path:
    """A Qwen3-Embedding-8B-shaped HF repository (bare decoder, no lm_head, last-token pooling,
    Normalize, Qwen's prompts, MRL down to 32) with random weights."""
    return make_embedding_hf_model(tmp_path_factory.mktemp("hf") / "Qwen3-Embedding-Tiny")


@pytest.fixture(scope="module")
def qwen3_embedding_gguf(qwen3_embedding_dir, tmp_path_factory) -> Path:
    """The repository converted to an F32 GGUF (outside any store)."""
    from edgeinfer.convert import convert_model

    out = tmp_path_factory.mktemp("gguf") / "qwen3-embedding-tiny-f32.gguf"
    convert_model(qwen3_embedding_dir, "f32", output=out, register=False,
                  store=edgeinfer.Store(tmp_path_factory.mktemp("convert-store")))
    return out


@pytest.fixture(scope="module")
def f16_default(default_model_copy) -> Path:
    return default_model_copy("F16")


# -- options and requests (no model) ---------------------------------------------------------------


@pytest.mark.parametrize("kw, says", [
    ({"pooling": "none"}, "one vector per token"),
    ({"pooling": "rank"}, "reranker"),
    ({"pooling": "max"}, "unknown pooling"),
    ({"pooling": 3}, "must be a string"),
    ({"normalize": "yes"}, "normalize must be"),
    ({"dimensions": 0}, "at least 1"),
    ({"dimensions": True}, "must be an integer"),
    ({"dimensions": 1.5}, "must be an integer"),
    ({"truncate": 1}, "truncate must be"),
    ({"prompt_name": ""}, "must not be empty"),
    ({"prompt_name": "query", "prompt": "x"}, "not both"),
    ({"prompt": b"x"}, "must be a string"),
])
def test_options_refuse_bad_values_in_one_line(kw, says):
    with pytest.raises(edgeinfer.InvalidOptionError) as e:
        EmbedOptions(**kw).validate()
    assert says in _one_line(e.value)


def test_request_parsing_takes_openai_shapes_and_refuses_the_rest():
    from edgeinfer_server import APIError
    from edgeinfer_server.embeddings import MAX_INPUTS, parse_embeddings

    assert parse_embeddings({"input": "hi"}).inputs == ("hi",)
    assert parse_embeddings({"input": ["a", "b"]}).inputs == ("a", "b")
    assert parse_embeddings({"input": [1, 2, 3]}).inputs == ((1, 2, 3),)  # one input as token ids
    assert parse_embeddings({"input": [[1, 2], [3]]}).inputs == ((1, 2), (3,))
    r = parse_embeddings({"input": "x", "encoding_format": "base64", "dimensions": 64, "pooling": "mean",
                          "normalize": False, "prompt_name": "query", "truncate": True, "user": "u", "model": "m"})
    assert r.base64 and r.model == "m"
    assert r.options == EmbedOptions(pooling="mean", normalize=False, dimensions=64, truncate=True, prompt_name="query")
    bad = [
        ({"input": []}, "empty list"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, f"more than the {MAX_INPUTS}"),
        ({"input": ["x"] * 10_000}, "10000 items"),
        ({"input": [""]}, "empty string"),
        ({"input": 5}, "must be a string"),
        ({"input": [1.5]}, "must be a string or a list of token ids"),
        ({"input": [[1, True]]}, "must hold integers"),
        ({"input": [[]]}, "empty list of token ids"),
        ({"input": ["a", 3]}, "input[1]"),
        ({"input": None}, "must be a string"),
        ({}, "'input' is required"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "positive integer"),
        ({"input": "x", "dimensions": True}, "positive integer"),
        ({"input": "x", "normalize": "yes"}, "true or false"),
        ({"input": "x", "pooling": "rank"}, "reranker"),
        ({"input": "x", "model": 3}, "'model' must be a string"),
        ({"input": "x", "input_type": "query"}, "unknown field 'input_type'"),
        (["x"], "JSON object"),
    ]
    for body, says in bad:
        with pytest.raises(APIError) as e:
            parse_embeddings(body)
        assert e.value.status == 400 and says in _one_line(e.value), (body, str(e.value))


def test_converter_reads_what_sentence_transformers_declares(qwen3_embedding_dir, tmp_path):
    spec = read_embedding_spec(qwen3_embedding_dir, 256)
    assert (spec.pooling, spec.normalize, spec.prompts, spec.min_dimensions) == ("last", True, QWEN3_EMBEDDING_PROMPTS, 32)
    assert embedding_files(["config.json", "modules.json", "1_Pooling/config.json", "2_Dense/config.json",
                            "README.md", "config_sentence_transformers.json", "x/1_Pooling/config.json"]) == [
        "1_Pooling/config.json", "README.md", "config_sentence_transformers.json", "modules.json"]

    def variant(name: str, **kw) -> Path:
        import shutil

        d = tmp_path / name
        d.mkdir()
        for f in ("modules.json", "config_sentence_transformers.json", "README.md"):
            shutil.copy(qwen3_embedding_dir / f, d / f)
        shutil.copytree(qwen3_embedding_dir / "1_Pooling", d / "1_Pooling")
        for rel, content in kw.items():
            (d / rel.replace("__", "/")).write_text(content if isinstance(content, str) else json.dumps(content))
        return d

    mean = variant("mean", **{"1_Pooling__config.json": {"pooling_mode_mean_tokens": True},
                              "modules.json": [{"path": "", "type": "sentence_transformers.models.Transformer"},
                                               {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}],
                              "README.md": "# no claims\n"})
    spec = read_embedding_spec(mean, 256)
    assert (spec.pooling, spec.normalize, spec.min_dimensions) == ("mean", False, None)
    assert read_embedding_spec(variant("mode", **{"1_Pooling__config.json": {"pooling_mode": "cls"}}), 256).pooling == "cls"
    assert read_embedding_spec(tmp_path, 256) is None  # no modules.json: a generative model
    refused = {
        "max": ({"1_Pooling__config.json": {"pooling_mode_max_tokens": True}}, "max"),
        "two": ({"1_Pooling__config.json": {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}}, "exactly one"),
        "dense": ({"modules.json": [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                                    {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]}, "Dense"),
        "outside": ({"modules.json": [{"path": "../x", "type": "sentence_transformers.models.Pooling"}]}, "outside"),
        "nopool": ({"modules.json": [{"path": "", "type": "sentence_transformers.models.Transformer"}]}, "no Pooling"),
        "badjson": ({"modules.json": "{"}, "not valid JSON"),
        "default": ({"config_sentence_transformers.json": {"prompts": {"q": "x"}, "default_prompt_name": "p"}}, "default prompt"),
    }
    for name, (files, says) in refused.items():
        with pytest.raises(edgeinfer.ConversionError) as e:
            read_embedding_spec(variant(name, **files), 256)
        assert says in _one_line(e.value), name


# -- the library against llama-cpp-python ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_each_pooling_equals_llama_cpp_python(f16_default, pooling):
    """The default model (it declares no pooling) with each pooling chosen, raw and normalized,
    several texts in one decode, against llama-cpp-python's own path on the same file."""
    with edgeinfer.load(f16_default, n_ctx=512, flash_attn=False) as engine, _embedder(engine) as emb:
        assert emb.declared_pooling is None and emb.dimensions == 576
        raw = emb.embed(TEXTS, EmbedOptions(pooling=pooling, normalize=False))
        default = emb.embed(TEXTS, EmbedOptions(pooling=pooling))  # a generative model's default: raw
        normed = emb.embed(TEXTS, EmbedOptions(pooling=pooling, normalize=True))
    assert raw.pooling == pooling and not raw.normalized and raw.vectors.shape == (len(TEXTS), 576)
    assert np.array_equal(default.vectors, raw.vectors)
    ref_raw = _lcp(f16_default, TEXTS, pooling=pooling, normalize=False)
    ref_unit = _lcp(f16_default, TEXTS, pooling=pooling, normalize=True)
    d_raw = np.abs(raw.vectors - ref_raw).max()
    d_unit = np.abs(normed.vectors - ref_unit).max()
    print(f"{pooling}: max |ours - llama-cpp-python| raw {d_raw:.3g} (values up to {np.abs(ref_raw).max():.1f}), "
          f"normalized {d_unit:.3g}")
    assert d_raw <= 1e-5 * max(1.0, np.abs(ref_raw).max()) and d_unit <= 1e-5
    assert np.allclose(np.linalg.norm(normed.vectors, axis=1), 1.0, atol=1e-6)
    assert raw.token_counts == tuple(len(t) for t in _lcp_tokens(f16_default, TEXTS))


def _lcp_tokens(path: Path, texts: list[str]) -> list[list[int]]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        return [llm.tokenize(t.encode()) for t in texts]
    finally:
        llm.close()


@pytest.mark.slow
def test_many_inputs_are_packed_into_decodes_in_order(qwen3_embedding_gguf):
    """300 inputs take several decodes (at most 256 sequences and 512 tokens each, as llama-cpp-python
    packs them): 256 two-token texts fill the first decode on both counts, longer ones the next.
    Every vector is the one llama-cpp-python gives, in input order."""
    texts = ["hi"] * 270 + [f"text {i} " + "with several more words " * (i % 7) for i in range(30)]
    with edgeinfer.load(qwen3_embedding_gguf, n_ctx=512, flash_attn=False, kv_type="f32") as engine, \
            _embedder(engine) as emb:
        ours = emb.embed(texts)
        assert ours.token_counts[:256] == (2,) * 256
    ref = _lcp(qwen3_embedding_gguf, texts, kv_f32=True)
    assert ours.vectors.shape == ref.shape and np.abs(ours.vectors - ref).max() <= 1e-5


@pytest.mark.slow
def test_converted_qwen3_embedding_equals_llama_cpp_python_and_numpy(qwen3_embedding_dir, qwen3_embedding_gguf):
    """The converted Qwen3-Embedding-shaped model declares last-token pooling, L2 normalization,
    its prompts and Matryoshka sizes; its vectors are llama-cpp-python's (which reads the pooling
    from the GGUF) and the HF checkpoint's own last hidden state (numpy, float64), normalized."""
    from numpy_reference import forward_logits, load_hf_weights

    with edgeinfer.load(qwen3_embedding_gguf, n_ctx=512, flash_attn=False, kv_type="f32") as engine, \
            _embedder(engine) as emb:
        assert (emb.declared_pooling, emb.normalize_default, emb.min_dimensions) == ("last", True, 32)
        assert emb.prompts == QWEN3_EMBEDDING_PROMPTS and emb.default_prompt_name is None
        ours = emb.embed(TEXTS)
        tokens = [engine.tokenize(t) for t in TEXTS]
        by_ids = emb.embed(tokens)
        query = emb.embed(["What is gravity?"], EmbedOptions(prompt_name="query"))
        literal = emb.embed([QUERY + "What is gravity?"])
        own_prompt = emb.embed(["What is gravity?"], EmbedOptions(prompt="Instruct: define it\nQuery:"))
        raw = emb.embed(TEXTS, EmbedOptions(normalize=False))
        short = emb.embed(TEXTS, EmbedOptions(dimensions=64))
        mean = emb.embed(TEXTS, EmbedOptions(pooling="mean"))
    assert ours.pooling == "last" and ours.normalized and ours.dimensions == 256
    assert all(t[-1] == 0 for t in tokens)  # the tokenizer's post-processor appends <|endoftext|> (id 0 here)
    ref = _lcp(qwen3_embedding_gguf, TEXTS, kv_f32=True)
    print(f"converted qwen3 (last): max |ours - llama-cpp-python| {np.abs(ours.vectors - ref).max():.3g}")
    assert np.abs(ours.vectors - ref).max() <= 1e-5
    assert np.abs(mean.vectors - _lcp(qwen3_embedding_gguf, TEXTS, pooling="mean", kv_f32=True)).max() <= 1e-5
    # the HF checkpoint's final hidden state at the last token: numpy's forward pass reads logits, so
    # its copy of the checkpoint gets an lm_head whose first rows are the identity (logits = hidden)
    config, w = load_hf_weights(qwen3_embedding_dir)
    hidden = config["hidden_size"]
    head = np.zeros((config["vocab_size"], hidden), np.float32)
    head[:hidden] = np.eye(hidden, dtype=np.float32)
    ref_dir = qwen3_embedding_gguf.parent / "numpy-reference"
    ref_dir.mkdir(exist_ok=True)
    write_safetensors(ref_dir / "model.safetensors",
                      {**{f"model.{k}": v.astype(np.float32) for k, v in w.items()}, "lm_head.weight": head})
    (ref_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    for i, toks in enumerate(tokens):
        x = forward_logits(ref_dir, toks)[-1, :hidden]
        d = np.abs(ours.vectors[i] - x / np.linalg.norm(x)).max()
        assert d <= 1e-5, (i, d)
    assert np.array_equal(by_ids.vectors, ours.vectors) and by_ids.token_counts == ours.token_counts
    assert np.array_equal(query.vectors, literal.vectors) and query.token_counts == literal.token_counts
    assert not np.allclose(own_prompt.vectors, query.vectors)
    expect = raw.vectors[:, :64] / np.linalg.norm(raw.vectors[:, :64], axis=1, keepdims=True)
    assert short.dimensions == 64 and np.abs(short.vectors - expect).max() <= 1e-6


@pytest.mark.slow
def test_hostile_inputs_get_one_line_errors(f16_default, qwen3_embedding_gguf):
    with edgeinfer.load(qwen3_embedding_gguf, n_ctx=256, flash_attn=False) as engine:
        emb = _embedder(engine, max_tokens=256)
        assert emb.max_tokens == 256
        empty = emb.embed([])
        assert empty.vectors.shape == (0, 256) and empty.prompt_tokens == 0
        long_text = "word " * 400
        cases = [
            (("x" * 3,), {"options": "mean"}, edgeinfer.InvalidOptionError, "EmbedOptions"),
            ((b"bytes",), {}, edgeinfer.InvalidOptionError, "got bytes"),
            ((5,), {}, edgeinfer.InvalidOptionError, "got int"),
            (([1, 2],), {}, edgeinfer.InvalidOptionError, "[[1, 2, 3]]"),
            ((["ok", None],), {}, edgeinfer.InvalidOptionError, "input 1"),
            (([""],), {}, edgeinfer.InvalidOptionError, "empty string"),
            (([[]],), {}, edgeinfer.InvalidOptionError, "empty list of token ids"),
            (([[1, 2.0]],), {}, edgeinfer.InvalidOptionError, "integer"),
            (([[10**9]],), {}, edgeinfer.InvalidOptionError, "outside the vocabulary"),
            (([[-1]],), {}, edgeinfer.InvalidOptionError, "outside the vocabulary"),
            ((["\ud800"],), {}, edgeinfer.InvalidOptionError, "lone surrogate"),
            (([long_text],), {}, edgeinfer.ContextLengthError, "more than the 256"),
            (([[1, 2]],), {"options": EmbedOptions(prompt_name="query")}, edgeinfer.InvalidOptionError, "token-id"),
            ((["x"],), {"options": EmbedOptions(prompt_name="passage")}, edgeinfer.InvalidOptionError, "query"),
            ((["x"],), {"options": EmbedOptions(dimensions=8)}, edgeinfer.InvalidOptionError, "[32, 256]"),
            ((["x"],), {"options": EmbedOptions(dimensions=300)}, edgeinfer.InvalidOptionError, "at most 256"),
        ]
        for args, kw, error, says in cases:
            with pytest.raises(error) as e:
                emb.embed(*args, **kw)
            assert says in _one_line(e.value), (args, kw, str(e.value))
        gone = threading.Event()
        gone.set()
        with pytest.raises(edgeinfer.Cancelled):  # polled before each decode (the server's client gone)
            emb.embed(["x"], cancel=gone)
        cut = emb.embed([long_text, "short"], EmbedOptions(truncate=True))
        assert cut.truncated == (True, False) and cut.token_counts[0] == 256
        eos_kept = emb.embed([engine.tokenize(long_text)[:255] + [0]])  # truncation keeps the trailing EOS
        assert np.abs(cut.vectors[0] - eos_kept.vectors[0]).max() <= 1e-6
        with pytest.raises(edgeinfer.InvalidOptionError):
            Embedder(engine._runtime, n_seq_max=10_000)
        emb.close()
        with pytest.raises(edgeinfer.EngineClosedError):
            emb.embed(["x"])
    with edgeinfer.load(f16_default, n_ctx=256) as engine, _embedder(engine) as emb:
        with pytest.raises(edgeinfer.InvalidOptionError) as e:
            emb.embed(["x"])
        assert "declares no pooling type" in _one_line(e.value)
        with pytest.raises(edgeinfer.InvalidOptionError) as e:
            emb.embed(["x"], EmbedOptions(pooling="mean", dimensions=64))
        assert "Matryoshka" in _one_line(e.value)


@pytest.mark.slow
def test_calls_from_many_threads_are_serialized(qwen3_embedding_gguf):
    """Server threads share one Embedder: each call's vectors are what it gives alone."""
    groups = [[f"thread {i} text {j}" for j in range(1 + i % 3)] for i in range(8)]
    with edgeinfer.load(qwen3_embedding_gguf, n_ctx=256) as engine, _embedder(engine) as emb:
        alone = [emb.embed(g).vectors for g in groups]
        got: dict[int, np.ndarray] = {}
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                for _ in range(3):
                    got[i] = emb.embed(groups[i], EmbedOptions(pooling="mean" if i % 2 else None)).vectors
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for i, g in enumerate(groups):
            expect = emb.embed(g, EmbedOptions(pooling="mean")).vectors if i % 2 else alone[i]
            assert np.abs(got[i] - expect).max() <= 1e-6


# -- the command line ------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_embeds_lines_with_every_flag(qwen3_embedding_gguf, f16_default, tmp_path, capsys, monkeypatch):
    from edgeinfer.cli import main

    texts = tmp_path / "texts.txt"
    texts.write_text("What is gravity?\n" + "word " * 300 + "\n")
    assert main(["embed", str(qwen3_embedding_gguf), "-f", str(texts), "--json", "--dimensions", "64",
                 "--prompt-name", "query", "--truncate", "--ctx", "256"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["usage"]["prompt_tokens"] > 256 and out["edgeinfer"]["truncated"] == [1]
    got = np.array([d["embedding"] for d in out["data"]])
    with edgeinfer.load(qwen3_embedding_gguf, n_ctx=256) as engine, _embedder(engine, max_tokens=256) as emb:
        lib = emb.embed(["What is gravity?", "word " * 300], EmbedOptions(dimensions=64, prompt_name="query", truncate=True))
    assert got.shape == (2, 64) and np.abs(got - lib.vectors).max() <= 1e-6

    # a chat model: --pooling chosen, raw (--no-normalize) and normalized, from standard input
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(TEXTS).encode() + b"\n")))
    assert main(["embed", str(f16_default), "-f", "-", "--pooling", "cls", "--no-normalize", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    raw = np.array([[float(x) for x in line.split()] for line in captured.out.splitlines()])
    assert raw.shape == (len(TEXTS), 576) and "cls pooling" in captured.err
    assert np.abs(raw - _lcp(f16_default, TEXTS, pooling="cls", normalize=False, flash_attn=True)).max() <= 1e-4
    texts.write_text("\n".join(TEXTS))
    assert main(["embed", str(f16_default), "-f", str(texts), "--pooling", "last", "--normalize", "--kv-type", "f16"]) == 0
    unit = np.array([[float(x) for x in line.split()] for line in capsys.readouterr().out.splitlines()])
    assert np.allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-6)
    assert np.abs(unit - _lcp(f16_default, TEXTS, pooling="last", flash_attn=True)).max() <= 1e-5

    texts.write_text("one\n\nthree\n")
    for argv, says in [
        (["embed", str(qwen3_embedding_gguf), "-f", str(texts)], "line 2 is empty"),
        (["embed", str(f16_default), "-f", str(tmp_path / "none.txt")], "cannot read"),
    ]:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    texts.write_text("fine\n")
    assert main(["embed", str(f16_default), "-f", str(texts)]) == 1
    err = capsys.readouterr().err
    assert "declares no pooling type" in err and "`--pooling mean`" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        main(["embed", str(f16_default), "-f", str(texts), "--pooling", "rank"])
    assert e.value.code == 2


# -- pull: a sentence-transformers repository becomes a working embedding model ---------------------


@pytest.mark.slow
def test_pull_of_an_embedding_repo_gives_an_embedding_model(qwen3_embedding_dir, tmp_path, monkeypatch):
    from hub_server import local_hub

    files = {p.relative_to(qwen3_embedding_dir).as_posix(): p for p in sorted(qwen3_embedding_dir.rglob("*"))
             if p.is_file()}
    assert "1_Pooling/config.json" in files
    with local_hub(monkeypatch, tmp_path / "hf-cache") as hub:
        hub.add_repo("Qwen/Qwen3-Embedding-Tiny", files)
        result = edgeinfer.pull("Qwen/Qwen3-Embedding-Tiny", quant="Q8_0")
    path = Path(result.manifest.file)
    with edgeinfer.load(result.manifest.ref, n_ctx=512, flash_attn=False) as engine, _embedder(engine) as emb:
        assert (emb.declared_pooling, emb.normalize_default, emb.min_dimensions) == ("last", True, 32)
        assert emb.prompts == QWEN3_EMBEDDING_PROMPTS
        ours = emb.embed(TEXTS)
    assert np.abs(ours.vectors - _lcp(path, TEXTS)).max() <= 1e-5


# -- the server, with the real openai client ---------------------------------------------------------


@pytest.fixture(scope="module")
def embed_server(qwen3_embedding_gguf, tmp_path_factory):
    from test_server import Server

    s = Server(qwen3_embedding_gguf, tmp_path_factory.mktemp("serve-embed"), "--parallel", "1", "--ctx", "512")
    yield s
    assert s.stop() == 0


@pytest.mark.slow
def test_openai_client_embeddings_equal_llama_cpp_python(embed_server, qwen3_embedding_gguf):
    from test_server import MODEL_FILE

    client = embed_server.client()
    ref = _lcp(qwen3_embedding_gguf, TEXTS, flash_attn=True)  # the server's flash attention: llama.cpp's auto (on)
    as_float = client.embeddings.create(model=MODEL_FILE, input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in as_float.data])
    print(f"server (last, float): max |ours - llama-cpp-python| {np.abs(got - ref).max():.3g}")
    assert [d.index for d in as_float.data] == list(range(len(TEXTS))) and np.abs(got - ref).max() <= 1e-5
    tokens = _lcp_tokens(qwen3_embedding_gguf, TEXTS)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(map(len, tokens))
    decoded = client.embeddings.create(model=MODEL_FILE, input=TEXTS)  # the client asks for base64 and decodes it
    assert np.array_equal(np.array([d.embedding for d in decoded.data], np.float32), got.astype(np.float32))
    b64 = client.embeddings.create(model=MODEL_FILE, input=TEXTS[:2], encoding_format="base64")
    assert np.array_equal(np.frombuffer(base64.b64decode(b64.data[1].embedding), "<f4"), got[1].astype(np.float32))
    one_ids = client.embeddings.create(model=MODEL_FILE, input=tokens[0], encoding_format="float")
    many_ids = client.embeddings.create(model=MODEL_FILE, input=tokens[:3], encoding_format="float")
    assert np.allclose(one_ids.data[0].embedding, got[0], atol=1e-6)
    assert np.allclose([d.embedding for d in many_ids.data], got[:3], atol=1e-6)
    short = client.embeddings.create(model=MODEL_FILE, input=TEXTS, dimensions=64, encoding_format="float")
    raw = client.embeddings.create(model=MODEL_FILE, input=TEXTS, encoding_format="float", extra_body={"normalize": False})
    raw_v = np.array([d.embedding for d in raw.data])
    assert np.abs(raw_v - _lcp(qwen3_embedding_gguf, TEXTS, normalize=False, flash_attn=True)).max() <= 1e-5
    expect = raw_v[:, :64] / np.linalg.norm(raw_v[:, :64], axis=1, keepdims=True)
    assert np.abs(np.array([d.embedding for d in short.data]) - expect).max() <= 1e-6
    for pooling in ("mean", "cls"):
        r = client.embeddings.create(model=MODEL_FILE, input=TEXTS, encoding_format="float", extra_body={"pooling": pooling})
        ref_p = _lcp(qwen3_embedding_gguf, TEXTS, pooling=pooling, flash_attn=True)
        print(f"server ({pooling}): max |ours - llama-cpp-python| {np.abs(np.array([d.embedding for d in r.data]) - ref_p).max():.3g}")
        assert np.abs(np.array([d.embedding for d in r.data]) - ref_p).max() <= 1e-5
    q = client.embeddings.create(model=MODEL_FILE, input="What is gravity?", encoding_format="float",
                                 extra_body={"prompt_name": "query"})
    literal = client.embeddings.create(model=MODEL_FILE, input=QUERY + "What is gravity?", encoding_format="float")
    assert q.data[0].embedding == literal.data[0].embedding and q.usage.prompt_tokens == literal.usage.prompt_tokens
    long_text = "word " * 700
    cut = client.embeddings.create(model=MODEL_FILE, input=[long_text], encoding_format="float", extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == 512


@pytest.mark.slow
def test_server_refuses_hostile_requests_with_400(embed_server):
    import httpx2 as httpx
    from test_server import MODEL_FILE

    url = embed_server.url + "/embeddings"
    cases = [
        ({"input": []}, 400, "empty list"),
        ({"input": ["x"] * 10_000}, 400, "10000 items"),
        ({"input": "word " * 700}, 400, "more than the 512"),
        ({"input": [[1, 10**9]]}, 400, "outside the vocabulary"),
        ({"input": [1.5]}, 400, "input[0]"),
        ({"input": {"text": "x"}}, 400, "must be a string"),
        ({"input": "x", "dimensions": 8}, 400, "[32, 256]"),
        ({"input": "x", "prompt_name": "passage"}, 400, "no prompt named"),
        ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
        ({"input": "x", "model": "other:model"}, 404, "is not in the store"),
    ]
    with httpx.Client(timeout=60) as http:
        for body, status, says in cases:
            body.setdefault("model", MODEL_FILE)
            r = http.post(url, json=body)
            assert r.status_code == status, (body, r.text)
            message = r.json()["error"]["message"]
            assert says in message and "\n" not in message, (body, message)
        r = http.post(url, json={"input": "word " * 700, "model": MODEL_FILE})
        assert r.json()["error"]["code"] == "context_length_exceeded"
        # the server still answers after all that
        assert http.post(url, json={"input": "fine", "model": MODEL_FILE}).status_code == 200


@pytest.mark.slow
def test_the_engines_embed_is_the_embedder(f16_default):
    """Engine.embed and BatchEngine.embed (one embedder on a context of its own, made on first use)
    give the module's vectors, also while a generation runs on the same BatchEngine."""
    texts = ["a cat sat on the mat", "quantum chromodynamics", "a cat on a mat"]
    mean = EmbedOptions(pooling="mean")  # a chat model declares no pooling of its own
    with edgeinfer.load(f16_default, n_ctx=512, flash_attn=False) as engine, _embedder(engine) as emb:
        reference = emb.embed(texts, mean).vectors
        assert np.array_equal(engine.embed(texts, mean).vectors, reference)
    with edgeinfer.BatchEngine.load(f16_default, n_ctx=1024, flash_attn=False,
                                    batch=edgeinfer.BatchOptions(parallel=2, calibrate_when_idle=False)) as be:
        gen = be.generate("Once upon a time", edgeinfer.GenerateOptions(max_tokens=32))
        assert np.array_equal(be.embed(texts, mean).vectors, reference)
        assert gen.result().finish_reason in ("length", "eos")
    with pytest.raises(edgeinfer.EngineClosedError):
        be.embed(texts, mean)
