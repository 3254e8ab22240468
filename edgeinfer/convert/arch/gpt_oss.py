"""OpenAI gpt-oss (`GptOssForCausalLM`, gpt-oss-20b/120b) as llama.cpp's `gpt-oss` architecture
(LLM_ARCH_OPENAI_MOE; its converter's `conversion/gpt_oss.py`, its loader's `models/openai-moe.cpp`).

A mixture of experts with attention sinks and alternating sliding-window / full attention, NEOX
rope with yarn scaling (no row permutation), biases on q/k/v/o, the router and every expert.
What the converter does beyond the llama layout:
- The experts come as stacks. MXFP4 checkpoints (`quant_method: mxfp4`) store `gate_up_proj_blocks`
  [E, 2I, H/32, 16] + `_scales` [E, 2I, H/32] and `down_proj_blocks` [E, H, I/32, 16] + `_scales`;
  gate and up rows are interleaved (even rows gate, odd rows up). The blocks go into GGUF MXFP4 as
  they are (outtype auto; quantized/fp4.py), gate and up from alternate rows. BF16 releases store
  `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] input-major: read transposed (views.py).
- `gate_up_proj_bias` [E, 2I] splits the same way into the gate and up biases.
- Biases and the router stay F32 whatever the outtype (llama.cpp adds the expert biases with
  ggml_add_id, and its converter keeps the router F32).
- llama.cpp's graph fixes the SwiGLU clamp (limit 7, alpha 1.702) and the sliding pattern (layer 0
  sliding, then alternating), and reads no yarn beta: checkpoints that differ are refused, not
  converted into a model that computes something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gguf

from ...errors import ConversionError
from ..quantized.base import Part
from ..quantized.fp4 import StackedMXFP4Tensor
from ..views import ColumnsView, TransposedStack
from .base import Architecture, HParams, TensorSpec, _get

if TYPE_CHECKING:
    from ..quantized.base import QuantizedTensor
    from ..safetensors import Checkpoint

__all__ = ["GptOss", "GptOssHParams"]

_ARCH = "gpt-oss"
_SWIGLU_LIMIT = 7.0  # llama.cpp's build_moe_ffn: LLM_FFN_SWIGLU_OAI_MOE, a constant
_YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}  # llama.cpp's defaults; it reads no key for them here
_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssHParams(HParams):
    experts: int = 0
    experts_used: int = 0
    sliding_window: int = 0


class GptOss(Architecture):
    hf_names = ("GptOssForCausalLM",)
    # unused (every tensor is named here): the pinned gguf range starts before GPT_OSS
    gguf_arch = getattr(gguf.MODEL_ARCH, "GPT_OSS", gguf.MODEL_ARCH.LLAMA)
    default_rope_theta = 150000.0

    @property
    def name(self) -> str:
        return _ARCH

    # -- hyperparameters ---------------------------------------------------------------------
    def hparams(self, config: dict[str, Any], target: dict[str, Any] | None = None) -> GptOssHParams:
        hp = super().hparams(config, target)
        if hp.tied:
            raise ConversionError("config.json: tie_word_embeddings is not supported for gpt-oss "
                                  "(llama.cpp's gpt-oss reads a separate output tensor)")
        experts = _get(config, "num_local_experts", int)
        key = "num_experts_per_tok" if "num_experts_per_tok" in config else "experts_per_token"
        used = _get(config, key, int)
        if used > experts or experts > 1024:
            raise ConversionError(f"config.json: {key} {used} of num_local_experts {experts} (llama.cpp: at most 1024)")
        window = _get(config, "sliding_window", int)
        layer_types = config.get("layer_types")
        want = [_LAYER_TYPES[i % 2] for i in range(hp.layers)]
        if layer_types is not None and layer_types != want:
            raise ConversionError("config.json: layer_types must alternate sliding_attention and full_attention "
                                  "from layer 0 (the only pattern llama.cpp's gpt-oss runs)")
        limit = config.get("swiglu_limit", _SWIGLU_LIMIT)
        if limit != _SWIGLU_LIMIT:
            raise ConversionError(f"config.json: swiglu_limit {limit!r} is not supported (llama.cpp's gpt-oss "
                                  f"clamps at {_SWIGLU_LIMIT:g})")
        self._check_rope(hp.rope_scaling)
        fields = {f: getattr(hp, f) for f in HParams.__dataclass_fields__}
        return GptOssHParams(**fields, experts=experts, experts_used=used, sliding_window=window)

    @staticmethod
    def _check_rope(s: dict[str, Any] | None) -> None:
        kind = str((s or {}).get("rope_type") or (s or {}).get("type") or "default").lower()
        if kind == "default":
            return
        if kind != "yarn":
            raise ConversionError(f"config.json: rope_scaling type {kind!r} is not supported for gpt-oss (yarn only)")
        assert s is not None
        for key in ("factor", "original_max_position_embeddings"):
            v = s.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConversionError(f"config.json: yarn rope_scaling needs a positive {key}, got {v!r}")
        for key, default in _YARN_BETAS.items():
            if float(s.get(key, default)) != default:
                raise ConversionError(f"config.json: yarn {key} {s[key]!r} is not supported (llama.cpp's gpt-oss "
                                      f"uses {default:g})")
        for key in ("attention_factor", "attn_factor", "extrapolation_factor", "mscale", "mscale_all_dim"):
            if s.get(key) not in (None, 1, 1.0):  # llama.cpp reads none of them for gpt-oss
                raise ConversionError(f"config.json: yarn {key} {s[key]!r} is not supported for gpt-oss")

    # -- tensors -----------------------------------------------------------------------------
    def tensor_specs(self, hp: HParams) -> dict[str, TensorSpec]:
        assert isinstance(hp, GptOssHParams)
        h, d, e, ff = hp.hidden, hp.head_dim, hp.experts, hp.intermediate
        q, kv = hp.heads * d, hp.kv_heads * d
        specs = {
            "model.embed_tokens.weight": TensorSpec((hp.vocab_size, h), gguf_name="token_embd.weight"),
            "model.norm.weight": TensorSpec((h,), gguf_name="output_norm.weight"),
            "lm_head.weight": TensorSpec((hp.vocab_size, h), gguf_name="output.weight"),
        }
        for i in range(hp.layers):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            a, x = p + "self_attn.", p + "mlp.experts."
            for hf, gg, shape in (("q_proj", "attn_q", (q, h)), ("k_proj", "attn_k", (kv, h)),
                                  ("v_proj", "attn_v", (kv, h)), ("o_proj", "attn_output", (h, q))):
                specs[f"{a}{hf}.weight"] = TensorSpec(shape, gguf_name=f"{b}{gg}.weight")
                specs[f"{a}{hf}.bias"] = TensorSpec(shape[:1], gguf_name=f"{b}{gg}.bias")
            specs.update({
                p + "input_layernorm.weight": TensorSpec((h,), gguf_name=b + "attn_norm.weight"),
                p + "post_attention_layernorm.weight": TensorSpec((h,), gguf_name=b + "post_attention_norm.weight"),
                a + "sinks": TensorSpec((hp.heads,), gguf_name=b + "attn_sinks.weight"),
                p + "mlp.router.weight": TensorSpec((e, h), gguf_name=b + "ffn_gate_inp.weight", f32=True),
                p + "mlp.router.bias": TensorSpec((e,), gguf_name=b + "ffn_gate_inp.bias"),
                # logical names (regroup): the stored stacks split, rows = experts x outputs
                x + "gate_proj.weight": TensorSpec((e * ff, h), gguf_name=b + "ffn_gate_exps.weight", gguf_shape=(e, ff, h)),
                x + "up_proj.weight": TensorSpec((e * ff, h), gguf_name=b + "ffn_up_exps.weight", gguf_shape=(e, ff, h)),
                x + "down_proj.weight": TensorSpec((e * h, ff), gguf_name=b + "ffn_down_exps.weight", gguf_shape=(e, h, ff)),
                x + "gate_proj.bias": TensorSpec((e, ff), gguf_name=b + "ffn_gate_exps.bias", f32=True),
                x + "up_proj.bias": TensorSpec((e, ff), gguf_name=b + "ffn_up_exps.bias", f32=True),
                x + "down_proj_bias": TensorSpec((e, h), gguf_name=b + "ffn_down_exps.bias", f32=True),
            })
        return specs

    def regroup(self, ckpt: Checkpoint, hp: HParams, quantized: dict[str, QuantizedTensor]
                ) -> tuple[dict[str, QuantizedTensor], set[str]]:
        assert isinstance(hp, GptOssHParams)
        out, used = dict(quantized), set()
        names = set(ckpt.names)
        e, ff, h = hp.experts, hp.intermediate, hp.hidden

        def part(name: str) -> Part:
            used.add(name)
            return Part(ckpt.where[name], ckpt.entry(name))

        def stack(name: str, rows: int, cols: int, step: int) -> QuantizedTensor | None:
            """The stored stack `name` (MXFP4 blocks or a float [E, cols, rows]) as [E * rows, cols]."""
            t = out.pop(name, None)
            if t is not None:  # MXFP4: [E, step * rows, cols / 32, 16]
                want = [e, step * rows, cols // 32, 16]
                if not isinstance(t, StackedMXFP4Tensor) or t.stack != (e, step * rows) or t.shape[1] != cols:
                    got = t.parts["blocks"].entry.shape if "blocks" in t.parts else t.shape
                    raise ConversionError(f"tensor {name}_blocks has shape {list(got)} but config.json implies {want}")
                return t
            if name in names:  # BF16 releases: input-major [E, cols, step * rows]
                p = part(name)
                if p.entry.shape != (e, cols, step * rows):
                    raise ConversionError(f"tensor {name} has shape {list(p.entry.shape)} but config.json implies "
                                          f"{[e, cols, step * rows]}")
                return TransposedStack(name, p)
            raise ConversionError(f"missing tensor {name}_blocks (or {name}, unquantized)")

        for i in range(hp.layers):
            x = f"model.layers.{i}.mlp.experts."
            gate_up = stack(x + "gate_up_proj", ff, h, 2)
            gate, up = x + "gate_proj.weight", x + "up_proj.weight"
            if isinstance(gate_up, StackedMXFP4Tensor):
                out[gate], out[up] = gate_up.split(gate, up)
            else:
                src = gate_up.parts["src"]  # type: ignore[union-attr]
                out[gate], out[up] = TransposedStack(gate, src, 2, 0), TransposedStack(up, src, 2, 1)
            down = stack(x + "down_proj", h, ff, 1)
            down.name = x + "down_proj.weight"  # type: ignore[union-attr]
            out[down.name] = down  # type: ignore[union-attr]
            if x + "gate_up_proj_bias" not in names:  # said here: the specs know only the halves' names
                raise ConversionError(f"missing tensor {x}gate_up_proj_bias")
            p = part(x + "gate_up_proj_bias")  # [E, 2I], interleaved like the weights
            out[x + "gate_proj.bias"], out[x + "up_proj.bias"] = (
                ColumnsView(x + "gate_proj.bias", p, 2, 0), ColumnsView(x + "up_proj.bias", p, 2, 1))
        return out, used

    # -- metadata ----------------------------------------------------------------------------
    def write_metadata(self, w: gguf.GGUFWriter, hp: HParams) -> None:
        assert isinstance(hp, GptOssHParams)
        super().write_metadata(w, hp)  # feed_forward_length, key/value length, rope
        w.add_expert_count(hp.experts)
        w.add_expert_used_count(hp.experts_used)
        w.add_expert_feed_forward_length(hp.intermediate)
        w.add_sliding_window(hp.sliding_window)

    def write_rope_scaling(self, w: gguf.GGUFWriter, hp: HParams) -> None:
        super().write_rope_scaling(w, hp)
        s = hp.rope_scaling or {}
        if str(s.get("rope_type") or s.get("type") or "").lower() == "yarn":  # as llama.cpp's converter writes
            w.add_rope_scaling_yarn_beta_fast(float(s.get("beta_fast", _YARN_BETAS["beta_fast"])))
            w.add_rope_scaling_yarn_beta_slow(float(s.get("beta_slow", _YARN_BETAS["beta_slow"])))
