"""An independent numpy forward pass of HF llama / qwen2 / qwen3 checkpoints, in float64.

Written from the Hugging Face modelling code's conventions, not from llama.cpp's: rotate_half
rope on the original (unpermuted) q/k weights, rope_theta and llama3 rope scaling of inv_freq,
GQA by repeating k/v heads, causal softmax attention, SwiGLU MLP, q/k/v biases (qwen2), per-head
q/k RMSNorm before rope (qwen3), tied or separate lm_head. Reads safetensors with its own
few lines, so it shares nothing with the converter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

__all__ = ["load_hf_weights", "forward_logits"]


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, spec in header.items():
        b, e = spec["data_offsets"]
        buf = raw[8 + n + b : 8 + n + e]
        if spec["dtype"] == "BF16":
            a = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(buf, {"F32": "<f4", "F16": "<f2", "I64": "<i8", "BOOL": "u1"}[spec["dtype"]])
        out[name] = a.astype(np.float64).reshape(spec["shape"])
    return out


def load_hf_weights(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    weights: dict[str, np.ndarray] = {}
    for p in sorted(folder.glob("*.safetensors")):
        weights.update(_read_safetensors(p))
    return config, weights


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _inv_freq(config: dict, head_dim: int) -> np.ndarray:
    theta = config.get("rope_theta", 10000.0)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    s = config.get("rope_scaling") or {}
    kind = s.get("rope_type") or s.get("type")
    if kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled)
    elif kind == "linear":
        inv = inv / s["factor"]
    elif kind not in (None, "default"):
        raise NotImplementedError(kind)
    return inv


def _rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def forward_logits(folder: Path, tokens: list[int], layer_inputs: list[np.ndarray] | None = None,
                   matmul_inputs: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """float64 logits [len(tokens), vocab] of the HF checkpoint in `folder`. `layer_inputs`, if
    given, receives each layer's input [T, hidden] and then the last layer's output (what an
    EAGLE-3 drafter reads of its target). `matmul_inputs`, if given, has the squared inputs of
    every decoder-layer linear weight added to it, summed over the tokens: {HF weight name:
    sum_t x_t[j]^2 per input column j} (what an importance matrix holds)."""
    config, w = load_hf_weights(folder)
    hidden, n_h = config["hidden_size"], config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_h)
    hd = config.get("head_dim") or hidden // n_h
    eps = config["rms_norm_eps"]
    T = len(tokens)

    inv = _inv_freq(config, hd)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]  # [T, 1, hd]
    mask = np.triu(np.full((T, T), -np.inf), k=1)

    def into(name: str, inp: np.ndarray) -> np.ndarray:
        if matmul_inputs is not None:
            matmul_inputs[name] = matmul_inputs.get(name, 0.0) + (inp * inp).sum(axis=0)
        return inp @ w[name].T

    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if layer_inputs is not None:
            layer_inputs.append(x)
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = into(p + "self_attn.q_proj.weight", h)
        k = into(p + "self_attn.k_proj.weight", h)
        v = into(p + "self_attn.v_proj.weight", h)
        if p + "self_attn.q_proj.bias" in w:
            q = q + w[p + "self_attn.q_proj.bias"]
            k = k + w[p + "self_attn.k_proj.bias"]
            v = v + w[p + "self_attn.v_proj.bias"]
        q = q.reshape(T, n_h, hd)
        k = k.reshape(T, n_kv, hd)
        v = v.reshape(T, n_kv, hd)
        if p + "self_attn.q_norm.weight" in w:
            q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = n_h // n_kv
        k = np.repeat(k, rep, axis=1)  # head j uses kv head j // rep, as HF's repeat_kv
        v = np.repeat(v, rep, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        att = np.einsum("hts,shd->thd", scores, v).reshape(T, n_h * hd)
        x = x + into(p + "self_attn.o_proj.weight", att)
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = into(p + "mlp.gate_proj.weight", h)
        u = into(p + "mlp.up_proj.weight", h)
        x = x + into(p + "mlp.down_proj.weight", (g / (1 + np.exp(-g))) * u)
    if layer_inputs is not None:
        layer_inputs.append(x)
    x = _rms_norm(x, w["model.norm.weight"], eps)
    head = w["lm_head.weight"] if "lm_head.weight" in w and not config.get("tie_word_embeddings") else w["model.embed_tokens.weight"]
    return x @ head.T
