"""An independent numpy forward pass of HF Qwen3.5 checkpoints (and of their MTP layer), in float64.

Written from the Hugging Face modelling code's conventions (transformers' modeling_qwen3_5.py), not
from llama.cpp's graph: zero-centred RMSNorm (x * (1 + w)); Gated DeltaNet layers with a causal
depthwise conv + SiLU over [q, k, v], L2-normalised q/k, q scaled by 1/sqrt(d_k), decay
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), the delta-rule recurrence token by
token, key heads repeated over their group of value heads (repeat_interleave), and a gated RMSNorm
(x * w * silu(z)); full-attention layers whose q_proj gives query and gate per head, per-head q/k
norms, rotate_half rope on the first `partial_rotary_factor` of each head (text positions: the three
M-RoPE sections coincide), sigmoid output gate. It reads the checkpoint's own tensor names (both the
multimodal and the causal-LM layouts) and shares nothing with the converter.

The MTP layer (`mtp.*`, as vLLM and llama.cpp run it): at position p it reads the embedding of token
p and the target's final (normed) hidden state at p - 1 (zeros at p = 0), projects
fc([enorm(e), hnorm(h)]) and runs one full-attention decoder layer over those positions, then
mtp.norm and the (tied) LM head: its logits at p guess token p + 2.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from numpy_reference import load_hf_weights

__all__ = ["Qwen35Reference"]


def _rms(x: np.ndarray, w: np.ndarray, eps: float, zero_centred: bool = True) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * (1.0 + w) if zero_centred else y * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


class Qwen35Reference:
    """The weights and settings of one checkpoint; `logits`, `hidden` and `mtp_logits` run it."""

    def __init__(self, folder: Path):
        config, self.w = load_hf_weights(Path(folder))
        self.c = {**config, **(config.get("text_config") or {})}
        multimodal = "Qwen3_5ForConditionalGeneration" in (config.get("architectures") or [])
        self.prefix = "model.language_model." if multimodal else "model."
        c = self.c
        self.eps = c["rms_norm_eps"]
        self.heads, self.kv_heads, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        rope = c.get("rope_parameters") or {}
        self.rope_dims = int(self.hd * rope.get("partial_rotary_factor", 0.25))
        self.theta = rope.get("rope_theta", 10000000.0)
        tied = c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        self.head = self.w[self.prefix + "embed_tokens.weight"] if tied else self.w["lm_head.weight"]

    # -- the trunk -----------------------------------------------------------------------------
    def hidden(self, tokens: list[int]) -> np.ndarray:
        """float64 [T, hidden]: the final hidden states after the model's last norm."""
        w, p = self.w, self.prefix
        x = w[p + "embed_tokens.weight"][np.asarray(tokens)]
        for i, kind in enumerate(self.c["layer_types"]):
            lp = f"{p}layers.{i}."
            h = _rms(x, w[lp + "input_layernorm.weight"], self.eps)
            x = x + (self._gated_deltanet(h, lp + "linear_attn.") if kind == "linear_attention" else self._attention(h, lp))
            x = x + self._mlp(x, lp)
        return _rms(x, w[p + "norm.weight"], self.eps)

    def logits(self, tokens: list[int]) -> np.ndarray:
        return self.hidden(tokens) @ self.head.T

    # -- the MTP layer -------------------------------------------------------------------------
    def mtp_logits(self, tokens: list[int], h: np.ndarray) -> np.ndarray:
        """float64 [T, vocab]: MTP logits at each position p of `tokens`, fed the target's final
        hidden state h[p - 1] (zeros at p = 0)."""
        w = self.w
        e = w[self.prefix + "embed_tokens.weight"][np.asarray(tokens)]
        h_prev = np.vstack([np.zeros((1, h.shape[1])), h[:-1]])
        both = np.concatenate([_rms(e, w["mtp.pre_fc_norm_embedding.weight"], self.eps),
                               _rms(h_prev, w["mtp.pre_fc_norm_hidden.weight"], self.eps)], axis=-1)
        x = both @ w["mtp.fc.weight"].T
        lp = "mtp.layers.0."
        x = x + self._attention(_rms(x, w[lp + "input_layernorm.weight"], self.eps), lp)
        x = x + self._mlp(x, lp)
        return _rms(x, w["mtp.norm.weight"], self.eps) @ self.head.T

    # -- blocks --------------------------------------------------------------------------------
    def _mlp(self, x: np.ndarray, lp: str) -> np.ndarray:
        w = self.w
        h = _rms(x, w[lp + "post_attention_layernorm.weight"], self.eps)
        return (_silu(h @ w[lp + "mlp.gate_proj.weight"].T) * (h @ w[lp + "mlp.up_proj.weight"].T)) @ w[lp + "mlp.down_proj.weight"].T

    def _attention(self, h: np.ndarray, lp: str) -> np.ndarray:
        w, a = self.w, lp + "self_attn."
        T, n_h, n_kv, d, rd = h.shape[0], self.heads, self.kv_heads, self.hd, self.rope_dims
        qg = (h @ w[a + "q_proj.weight"].T).reshape(T, n_h, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(T, n_h * d)
        k = (h @ w[a + "k_proj.weight"].T).reshape(T, n_kv, d)
        v = (h @ w[a + "v_proj.weight"].T).reshape(T, n_kv, d)
        q, k = _rms(q, w[a + "q_norm.weight"], self.eps), _rms(k, w[a + "k_norm.weight"], self.eps)
        inv = 1.0 / self.theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
        q = np.concatenate([q[..., :rd] * cos + _rotate_half(q[..., :rd]) * sin, q[..., rd:]], -1)
        k = np.concatenate([k[..., :rd] * cos + _rotate_half(k[..., :rd]) * sin, k[..., rd:]], -1)
        k, v = np.repeat(k, n_h // n_kv, axis=1), np.repeat(v, n_h // n_kv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(d) + np.triu(np.full((T, T), -np.inf), k=1)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", s, v).reshape(T, n_h * d) * _sigmoid(gate)
        return out @ w[a + "o_proj.weight"].T

    def _gated_deltanet(self, h: np.ndarray, a: str) -> np.ndarray:
        w, c = self.w, self.c
        T = h.shape[0]
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        mixed = h @ w[a + "in_proj_qkv.weight"].T  # [T, 2 nk dk + nv dv]
        kern = w[a + "conv1d.weight"][:, 0, :]  # [C, K]: causal depthwise, zero history
        K = kern.shape[1]
        padded = np.vstack([np.zeros((K - 1, mixed.shape[1])), mixed])
        conv = sum(padded[j : j + T] * kern[:, j] for j in range(K))
        conv = _silu(conv)
        q = conv[:, : nk * dk].reshape(T, nk, dk)
        k = conv[:, nk * dk : 2 * nk * dk].reshape(T, nk, dk)
        v = conv[:, 2 * nk * dk :].reshape(T, nv, dv)
        q, k = _l2norm(q), _l2norm(k)
        q = q / math.sqrt(dk)
        q, k = np.repeat(q, nv // nk, axis=1), np.repeat(k, nv // nk, axis=1)  # value head j reads key head j // r
        beta = _sigmoid(h @ w[a + "in_proj_b.weight"].T)  # [T, nv]
        g = -np.exp(w[a + "A_log"]) * _softplus(h @ w[a + "in_proj_a.weight"].T + w[a + "dt_bias"])
        state = np.zeros((nv, dk, dv))
        out = np.zeros((T, nv, dv))
        for t in range(T):
            state = state * np.exp(g[t])[:, None, None]
            kv_mem = np.einsum("hkv,hk->hv", state, k[t])
            delta = (v[t] - kv_mem) * beta[t][:, None]
            state = state + np.einsum("hk,hv->hkv", k[t], delta)
            out[t] = np.einsum("hkv,hk->hv", state, q[t])
        z = (h @ w[a + "in_proj_z.weight"].T).reshape(T, nv, dv)
        normed = _rms(out, w[a + "norm.weight"], self.eps, zero_centred=False) * _silu(z)
        return normed.reshape(T, nv * dv) @ w[a + "out_proj.weight"].T
