"""Qwen3.5 (dense): hybrid Gated DeltaNet / gated full-attention layers and a multi-token-prediction
(MTP) layer, as llama.cpp's `qwen35` architecture wants them (its converter's `conversion/qwen.py`).

What differs from the llama layout, and what the converter does about it:
- RMSNorm weights are stored zero-centred (HF computes x * (1 + w)): +1 on every norm except the
  Gated DeltaNet's output norm (`linear_attn.norm`, a plain x * w).
- Linear-attention layers (`linear_attn.*`): A_log becomes -exp(A_log) (`ssm_a`), dt_bias is
  `ssm_dt.bias`, the depthwise conv kernel [C, 1, K] becomes [C, K] in F32; when there are more
  value heads than key heads, the value heads go from HF's grouped order (per key head) to the
  tiled order ggml's broadcast uses, in every tensor that has a value-head axis.
- Full-attention layers: q_proj holds query and output gate interleaved per head, which is the
  layout llama.cpp reads; NEOX partial rope (no row permutation), interleaved M-RoPE sections.
- The MTP layer (`mtp.*`, one full-attention block) becomes block `num_hidden_layers`: its
  `fc` is `nextn.eh_proj`, its input norms `nextn.enorm` / `nextn.hnorm`, its final norm
  `nextn.shared_head_norm`; `block_count` counts it and `nextn_predict_layers` says so.

Both published layouts convert: `Qwen3_5ForCausalLM` (`model.layers.*`) and the multimodal
`Qwen3_5ForConditionalGeneration` (`model.language_model.layers.*`, whose vision tower is left
out: llama.cpp runs it from a separate mmproj file). The MoE variant is refused (see REFUSED).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import gguf
import numpy as np

from ...errors import ConversionError
from .base import Architecture, HParams, TensorSpec, _get

__all__ = ["Qwen35", "Qwen35HParams", "REFUSED"]

# Known architectures this converter does not convert, with why (architecture_for says it).
REFUSED = {
    name: "Qwen3.5 MoE checkpoints are not supported yet: their routed and shared expert layers "
    "(3-D expert tensors) are not converted; the dense Qwen3.5 models are"
    for name in ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
}

_ARCH = "qwen35"
_DEFAULT_SECTIONS = (11, 11, 10, 0)  # llama.cpp's default when a checkpoint omits mrope_section
_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35HParams(HParams):
    prefix: str = "model."  # "model.language_model." in the multimodal layout
    trunk_layers: int = 0  # num_hidden_layers; `layers` also counts the MTP block
    mtp_layers: int = 0
    recurrent: tuple[bool, ...] = ()  # per trunk layer: Gated DeltaNet (True) or full attention
    full_attention_interval: int = 4
    conv_kernel: int = 4
    k_heads: int = 0  # linear attention: key heads, value heads, and their (equal) head size
    v_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    rope_sections: tuple[int, ...] = _DEFAULT_SECTIONS


def _plus_one(x: np.ndarray) -> np.ndarray:
    return x + np.float32(1.0)


def _neg_exp(x: np.ndarray) -> np.ndarray:
    return -np.exp(x)


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ConversionError(f"config.json: {what} must be a list of non-negative integers")
    return value


class Qwen35(Architecture):
    hf_names = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    # unused (every tensor is named here): gguf before 0.19 has no QWEN35, and must still import this
    gguf_arch = getattr(gguf.MODEL_ARCH, "QWEN35", gguf.MODEL_ARCH.QWEN3)
    default_rope_theta = 10000000.0
    _multimodal: ClassVar[str] = "Qwen3_5ForConditionalGeneration"

    @property
    def name(self) -> str:
        return _ARCH

    # -- hyperparameters ---------------------------------------------------------------------
    def hparams(self, config: dict[str, Any], target: dict[str, Any] | None = None) -> Qwen35HParams:
        if target is not None:
            raise ConversionError(f"{self.name} is not a drafter: it takes no target model")
        text = config.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise ConversionError("config.json: text_config must be an object")
        c = {**config, **(text or {})}  # the text model's settings win, as in llama.cpp's converter
        archs = config.get("architectures") or []
        prefix = "model.language_model." if self._multimodal in archs else "model."

        hidden = _get(c, "hidden_size", int)
        heads = _get(c, "num_attention_heads", int)
        kv_heads = _get(c, "num_key_value_heads", int, heads)
        head_dim = _get(c, "head_dim", int) if c.get("head_dim") is not None else hidden // heads
        if heads % kv_heads:
            raise ConversionError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        n = _get(c, "num_hidden_layers", int)
        if n > 512:
            raise ConversionError(f"config.json: num_hidden_layers {n} is more than llama.cpp's 512")
        for key, want in (("attn_output_gate", True), ("attention_bias", False)):
            if c.get(key, want) is not want:
                raise ConversionError(f"config.json: {key} must be {str(want).lower()} for {self.name} (llama.cpp's layout)")
        if c.get("hidden_act", "silu") != "silu":
            raise ConversionError(f"config.json: hidden_act {c.get('hidden_act')!r} is not supported (silu only)")

        interval = _get(c, "full_attention_interval", int, 4)
        layer_types = c.get("layer_types")
        if layer_types is None:
            recurrent = tuple((i + 1) % interval != 0 for i in range(n))
        else:
            if not isinstance(layer_types, list) or len(layer_types) != n or any(t not in _LAYER_TYPES for t in layer_types):
                raise ConversionError(
                    f"config.json: layer_types must list {n} entries, each linear_attention or full_attention"
                )
            recurrent = tuple(t == "linear_attention" for t in layer_types)

        k_heads = _get(c, "linear_num_key_heads", int)
        v_heads = _get(c, "linear_num_value_heads", int)
        k_dim = _get(c, "linear_key_head_dim", int)
        v_dim = _get(c, "linear_value_head_dim", int)
        if v_heads % k_heads:
            raise ConversionError(f"config.json: linear_num_value_heads {v_heads} is not a multiple of linear_num_key_heads {k_heads}")
        if k_dim != v_dim:
            raise ConversionError(f"config.json: linear_key_head_dim {k_dim} != linear_value_head_dim {v_dim} (llama.cpp needs them equal)")
        conv_kernel = _get(c, "linear_conv_kernel_dim", int, 4)

        mtp = c.get("mtp_num_hidden_layers", 0)
        if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp not in (0, 1):
            raise ConversionError(f"config.json: mtp_num_hidden_layers {mtp!r} is not supported (llama.cpp runs 0 or 1 MTP layer)")
        if c.get("mtp_use_dedicated_embeddings"):
            raise ConversionError("config.json: mtp_use_dedicated_embeddings is not supported (llama.cpp's converter maps none)")

        rope = c.get("rope_parameters", c.get("rope_scaling")) or {}
        if not isinstance(rope, dict):
            raise ConversionError("config.json: rope_parameters must be an object")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None):
            raise ConversionError(f"config.json: rope_type {kind!r} is not supported for {self.name}")
        theta = _get({**c, **rope}, "rope_theta", float, self.default_rope_theta)
        factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ConversionError(f"config.json: partial_rotary_factor must be a number in (0, 1], got {factor!r}")
        rope_dims = int(head_dim * factor)
        if rope_dims < 2 or rope_dims % 2:
            raise ConversionError(f"config.json: partial_rotary_factor {factor} gives {rope_dims} rotated dimensions of {head_dim}")
        if "mrope_section" in rope:
            sections = _int_list(rope["mrope_section"], "rope_parameters.mrope_section")
            if not 1 <= len(sections) <= 4 or 2 * sum(sections) != rope_dims:
                raise ConversionError(f"config.json: mrope_section {sections} does not split {rope_dims} rotated dimensions")
            sections = [*sections, 0, 0, 0][:4]
        elif rope_dims == 2 * sum(_DEFAULT_SECTIONS):
            sections = list(_DEFAULT_SECTIONS)
        else:
            raise ConversionError(f"config.json: no mrope_section for {rope_dims} rotated dimensions")

        tied = bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
        return Qwen35HParams(
            vocab_size=_get(c, "vocab_size", int),
            hidden=hidden,
            layers=n + mtp,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=_get(c, "intermediate_size", int),
            rms_eps=_get(c, "rms_norm_eps", float, 1e-6),
            rope_theta=theta,
            context_length=_get(c, "max_position_embeddings", int, 262144),
            tied=tied,
            explicit_head_dim=True,
            prefix=prefix,
            trunk_layers=n,
            mtp_layers=mtp,
            recurrent=recurrent,
            full_attention_interval=interval,
            conv_kernel=conv_kernel,
            k_heads=k_heads,
            v_heads=v_heads,
            k_dim=k_dim,
            v_dim=v_dim,
            rope_dims=rope_dims,
            rope_sections=tuple(sections),
        )

    # -- tensors -----------------------------------------------------------------------------
    def tensor_specs(self, hp: HParams) -> dict[str, TensorSpec]:
        assert isinstance(hp, Qwen35HParams)
        h, p = hp.hidden, hp.prefix
        specs = {
            p + "embed_tokens.weight": TensorSpec((hp.vocab_size, h), gguf_name="token_embd.weight"),
            p + "norm.weight": TensorSpec((h,), gguf_name="output_norm.weight", fn=_plus_one),
            "lm_head.weight": TensorSpec((hp.vocab_size, h), required=not hp.tied, gguf_name="output.weight"),
        }
        for i in range(hp.trunk_layers):
            src = f"{p}layers.{i}."
            specs.update(self._common(src, i, hp))
            specs.update(self._linear(src, i, hp) if hp.recurrent[i] else self._attention(src, i, hp))
        if hp.mtp_layers:
            b = hp.trunk_layers
            specs["mtp.fc.weight"] = TensorSpec((h, 2 * h), gguf_name=f"blk.{b}.nextn.eh_proj.weight")
            for hf, gg in (("pre_fc_norm_embedding", "enorm"), ("pre_fc_norm_hidden", "hnorm"), ("norm", "shared_head_norm")):
                specs[f"mtp.{hf}.weight"] = TensorSpec((h,), gguf_name=f"blk.{b}.nextn.{gg}.weight", fn=_plus_one)
            specs.update(self._common("mtp.layers.0.", b, hp))
            specs.update(self._attention("mtp.layers.0.", b, hp))
        return specs

    def _common(self, src: str, b: int, hp: Qwen35HParams) -> dict[str, TensorSpec]:
        h, ff = hp.hidden, hp.intermediate
        return {
            src + "input_layernorm.weight": TensorSpec((h,), gguf_name=f"blk.{b}.attn_norm.weight", fn=_plus_one),
            src + "post_attention_layernorm.weight": TensorSpec((h,), gguf_name=f"blk.{b}.post_attention_norm.weight", fn=_plus_one),
            src + "mlp.gate_proj.weight": TensorSpec((ff, h), gguf_name=f"blk.{b}.ffn_gate.weight"),
            src + "mlp.up_proj.weight": TensorSpec((ff, h), gguf_name=f"blk.{b}.ffn_up.weight"),
            src + "mlp.down_proj.weight": TensorSpec((h, ff), gguf_name=f"blk.{b}.ffn_down.weight"),
        }

    def _attention(self, src: str, b: int, hp: Qwen35HParams) -> dict[str, TensorSpec]:
        h, d = hp.hidden, hp.head_dim
        a = src + "self_attn."
        return {  # q_proj: per head, d query rows then d gate rows, as llama.cpp's views read them
            a + "q_proj.weight": TensorSpec((2 * hp.heads * d, h), gguf_name=f"blk.{b}.attn_q.weight"),
            a + "k_proj.weight": TensorSpec((hp.kv_heads * d, h), gguf_name=f"blk.{b}.attn_k.weight"),
            a + "v_proj.weight": TensorSpec((hp.kv_heads * d, h), gguf_name=f"blk.{b}.attn_v.weight"),
            a + "o_proj.weight": TensorSpec((h, hp.heads * d), gguf_name=f"blk.{b}.attn_output.weight"),
            a + "q_norm.weight": TensorSpec((d,), gguf_name=f"blk.{b}.attn_q_norm.weight", fn=_plus_one),
            a + "k_norm.weight": TensorSpec((d,), gguf_name=f"blk.{b}.attn_k_norm.weight", fn=_plus_one),
        }

    def _linear(self, src: str, b: int, hp: Qwen35HParams) -> dict[str, TensorSpec]:
        h = hp.hidden
        key_dim, value_dim = hp.k_heads * hp.k_dim, hp.v_heads * hp.v_dim
        conv_dim = 2 * key_dim + value_dim
        v_rows, v_heads = self._tiled(hp, hp.v_dim), self._tiled(hp, 1)
        qkv_rows = None if v_rows is None else np.concatenate([np.arange(2 * key_dim), 2 * key_dim + v_rows])
        a = src + "linear_attn."
        return {
            a + "in_proj_qkv.weight": TensorSpec((conv_dim, h), gguf_name=f"blk.{b}.attn_qkv.weight", rows=qkv_rows),
            a + "in_proj_z.weight": TensorSpec((value_dim, h), gguf_name=f"blk.{b}.attn_gate.weight", rows=v_rows),
            a + "in_proj_a.weight": TensorSpec((hp.v_heads, h), gguf_name=f"blk.{b}.ssm_alpha.weight", rows=v_heads),
            a + "in_proj_b.weight": TensorSpec((hp.v_heads, h), gguf_name=f"blk.{b}.ssm_beta.weight", rows=v_heads),
            a + "conv1d.weight": TensorSpec((conv_dim, 1, hp.conv_kernel), gguf_name=f"blk.{b}.ssm_conv1d.weight",
                                            gguf_shape=(conv_dim, hp.conv_kernel), rows=qkv_rows, f32=True),
            a + "A_log": TensorSpec((hp.v_heads,), gguf_name=f"blk.{b}.ssm_a", rows=v_heads, fn=_neg_exp),
            a + "dt_bias": TensorSpec((hp.v_heads,), gguf_name=f"blk.{b}.ssm_dt.bias", rows=v_heads),
            a + "norm.weight": TensorSpec((hp.v_dim,), gguf_name=f"blk.{b}.ssm_norm.weight"),
            a + "out_proj.weight": TensorSpec((h, value_dim), gguf_name=f"blk.{b}.ssm_out.weight", cols=v_rows),
        }

    @staticmethod
    def _tiled(hp: Qwen35HParams, size: int) -> np.ndarray | None:
        """Value-head reordering, grouped by key head [K0: v0..v(r-1), K1: ...] -> tiled
        [v0 of K0, K1, ..., v1 of K0, K1, ...] (what ggml_repeat broadcasts), for heads of `size`
        rows; None when there is one value head per key head."""
        if hp.v_heads == hp.k_heads:
            return None
        r = hp.v_heads // hp.k_heads
        return np.arange(hp.v_heads * size).reshape(hp.k_heads, r, size).transpose(1, 0, 2).reshape(-1)

    def skip_tensor(self, name: str, hp: HParams) -> bool:
        if name.startswith(("model.visual.", "visual.")):  # the vision tower: an mmproj file's job
            return True
        return super().skip_tensor(name, hp)

    # -- metadata ----------------------------------------------------------------------------
    def write_metadata(self, w: gguf.GGUFWriter, hp: HParams) -> None:
        assert isinstance(hp, Qwen35HParams)
        super().write_metadata(w, hp)  # block_count counts the MTP block; partial rope dimensions
        # written by key (not gguf's newer add_* helpers): the pinned gguf range starts before them
        w.add_array(f"{_ARCH}.rope.dimension_sections", list(hp.rope_sections))
        w.add_ssm_conv_kernel(hp.conv_kernel)
        w.add_ssm_state_size(hp.k_dim)
        w.add_ssm_group_count(hp.k_heads)
        w.add_ssm_time_step_rank(hp.v_heads)
        w.add_ssm_inner_size(hp.v_dim * hp.v_heads)
        w.add_uint32(f"{_ARCH}.full_attention_interval", hp.full_attention_interval)
        # The MTP block is full attention (not recurrent), as llama.cpp's converter writes it.
        w.add_array(f"{_ARCH}.attention.recurrent_layers", [*hp.recurrent, *([False] * hp.mtp_layers)])
        if hp.mtp_layers:
            w.add_uint32(f"{_ARCH}.nextn_predict_layers", hp.mtp_layers)
