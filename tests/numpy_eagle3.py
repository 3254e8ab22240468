"""An independent numpy forward pass of an HF EAGLE-3 drafter (SpecForge's LlamaForCausalLMEagle3),
in float64, from the target's hidden states.

As SpecForge trains it: g = fc([f_low, f_mid, f_high]) fuses three of the target's layer inputs;
the decoder layer attends over [input_layernorm(embed(token)), hidden_norm(g)] with rotate_half
rope on the original q/k weights, adds g back (the residual), then the SwiGLU MLP; `norm` and
`lm_head` give draft-vocabulary logits, which d2t (offsets) places at target ids. Embeddings are
the drafter's own or, without them, the target's. It shares nothing with the converter.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from numpy_reference import load_hf_weights

__all__ = ["eagle3_features", "eagle3_logits"]


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def eagle3_features(drafter: Path, states: np.ndarray) -> np.ndarray:
    """g [T, hidden] from the concatenated target states [T, 3 * target_hidden]."""
    _, w = load_hf_weights(Path(drafter))
    return states @ w["fc.weight"].T


def eagle3_logits(drafter: Path, target: Path, tokens: list[int], g: np.ndarray) -> np.ndarray:
    """float64 [T, target vocab]: the drafter's logits for input pairs (tokens[i], g[i]) at
    positions 0..T-1; ids outside the draft vocabulary are -inf."""
    config, w = load_hf_weights(Path(drafter))  # d2t comes as float64: exact for these ids
    eps, n_h, n_kv = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["hidden_size"] // n_h
    T = len(tokens)
    if "embed_tokens.weight" in w:
        emb = w["embed_tokens.weight"][np.asarray(tokens)]
    else:
        _, tw = load_hf_weights(Path(target))
        emb = tw["model.embed_tokens.weight"][np.asarray(tokens)]
    m = "midlayer."
    x = np.concatenate([_rms(emb, w[m + "input_layernorm.weight"], eps), _rms(g, w[m + "hidden_norm.weight"], eps)], -1)
    q = (x @ w[m + "self_attn.q_proj.weight"].T).reshape(T, n_h, hd)
    k = (x @ w[m + "self_attn.k_proj.weight"].T).reshape(T, n_kv, hd)
    v = (x @ w[m + "self_attn.v_proj.weight"].T).reshape(T, n_kv, hd)
    inv = 1.0 / config.get("rope_theta", 10000.0) ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = np.repeat(k, n_h // n_kv, axis=1), np.repeat(v, n_h // n_kv, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd) + np.triu(np.full((T, T), -np.inf), k=1)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    h = g + np.einsum("hts,shd->thd", s, v).reshape(T, n_h * hd) @ w[m + "self_attn.o_proj.weight"].T
    y = _rms(h, w[m + "post_attention_layernorm.weight"], eps)
    gate, up = y @ w[m + "mlp.gate_proj.weight"].T, y @ w[m + "mlp.up_proj.weight"].T
    h = h + (gate / (1 + np.exp(-gate)) * up) @ w[m + "mlp.down_proj.weight"].T
    draft = _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T
    out = np.full((T, config["vocab_size"]), -np.inf)
    d2t = w["d2t"].astype(np.int64) + np.arange(draft.shape[1]) if "d2t" in w else np.arange(draft.shape[1])
    out[:, d2t] = draft
    return out
