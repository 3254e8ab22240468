"""A small, real GGUF that llama.cpp loads (llama architecture, an SPM vocabulary with byte
tokens, random F32 weights), with any metadata entry or tensor type changed on request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType as T

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER, N_CTX = 64, 4, 2, 128, 2, 128
_WORDS = ["▁Hello", "▁world", "▁the", "▁a", "▁is", "!", ",", "▁"] + [f"▁w{i}" for i in range(24)]
TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _WORDS
DROP = object()  # an override value that removes the key


def default_metadata(arch: str = "llama") -> dict[str, tuple[Any, T]]:
    n_vocab = len(TOKENS)
    types = [2, 3, 3] + [6] * 256 + [1] * len(_WORDS)  # unknown, control, byte, normal
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(_WORDS))]
    return {
        "general.name": ("hostile-sample", T.STRING),
        f"{arch}.context_length": (N_CTX, T.UINT32),
        f"{arch}.embedding_length": (N_EMBD, T.UINT32),
        f"{arch}.block_count": (N_LAYER, T.UINT32),
        f"{arch}.feed_forward_length": (N_FF, T.UINT32),
        f"{arch}.attention.head_count": (N_HEAD, T.UINT32),
        f"{arch}.attention.head_count_kv": (N_HEAD_KV, T.UINT32),
        f"{arch}.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32),
        f"{arch}.rope.freq_base": (10000.0, T.FLOAT32),
        f"{arch}.rope.dimension_count": (N_EMBD // N_HEAD, T.UINT32),
        "tokenizer.ggml.model": ("llama", T.STRING),
        "tokenizer.ggml.tokens": (list(TOKENS), T.ARRAY),
        "tokenizer.ggml.scores": (scores, T.ARRAY),
        "tokenizer.ggml.token_type": (types, T.ARRAY),
        "tokenizer.ggml.bos_token_id": (1, T.UINT32),
        "tokenizer.ggml.eos_token_id": (2, T.UINT32),
        "tokenizer.ggml.unknown_token_id": (0, T.UINT32),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", T.STRING),
    }


def default_tensors(arch: str = "llama", seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n_vocab, kv = len(TOKENS), N_EMBD // N_HEAD * N_HEAD_KV

    def w(rows: int, cols: int) -> np.ndarray:  # numpy shape (rows, cols) = GGUF [cols, rows]
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    t = {"token_embd.weight": w(n_vocab, N_EMBD), "output_norm.weight": np.ones(N_EMBD, np.float32)}
    for i in range(N_LAYER):
        b = f"blk.{i}."
        t |= {
            b + "attn_norm.weight": np.ones(N_EMBD, np.float32),
            b + "attn_q.weight": w(N_EMBD, N_EMBD),
            b + "attn_k.weight": w(kv, N_EMBD),
            b + "attn_v.weight": w(kv, N_EMBD),
            b + "attn_output.weight": w(N_EMBD, N_EMBD),
            b + "ffn_norm.weight": np.ones(N_EMBD, np.float32),
            b + "ffn_gate.weight": w(N_FF, N_EMBD),
            b + "ffn_up.weight": w(N_FF, N_EMBD),
            b + "ffn_down.weight": w(N_EMBD, N_FF),
        }
        if arch == "qwen3":
            t[b + "attn_q_norm.weight"] = np.ones(N_EMBD // N_HEAD, np.float32)
            t[b + "attn_k_norm.weight"] = np.ones(N_EMBD // N_HEAD, np.float32)
    return t


def write_model(
    path: Path,
    *,
    arch: str = "llama",
    meta: dict[str, Any] | None = None,
    tensors: dict[str, Any] | None = None,
) -> Path:
    """Write the sample model. `meta` overrides entries: key -> (value, GGUFValueType), or DROP.
    `tensors` overrides tensors: name -> array, or DROP."""
    entries = default_metadata(arch)
    for key, value in (meta or {}).items():
        if value is DROP:
            entries.pop(key, None)
        else:
            entries[key] = value
    arrays = default_tensors(arch)
    for name, value in (tensors or {}).items():
        if value is DROP:
            arrays.pop(name, None)
        else:
            arrays[name] = value
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in entries.items():
        if vtype == T.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for name, array in arrays.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
