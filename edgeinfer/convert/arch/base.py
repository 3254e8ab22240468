"""What every llama-family architecture shares: hyperparameters, expected tensors, metadata.

An architecture module subclasses `Architecture`, sets a few class attributes and overrides the
hooks that differ (extra tensors, rope permutation, extra metadata). The converter asks it three
things: the expected HF tensors and their shapes, how to reorder rows of a tensor, and which GGUF
metadata to write.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import gguf
import numpy as np

from ...errors import ConversionError

if TYPE_CHECKING:
    from ..quantized.base import QuantizedTensor
    from ..safetensors import Checkpoint

__all__ = ["HParams", "Architecture", "TensorSpec"]


@dataclass(frozen=True)
class HParams:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    rope_theta: float
    context_length: int
    tied: bool
    rope_scaling: dict[str, Any] | None = None
    explicit_head_dim: bool = False
    rope_dims: int = 0  # rotated dimensions of each head where not all are (partial rope); 0: head_dim


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    required: bool = True
    # Rows come in groups of `permute_heads` heads that must be reordered from HF's rotate_half
    # rope layout to llama.cpp's interleaved (NORM) layout; 0 = no reordering.
    permute_heads: int = 0
    # Architectures whose tensors gguf's name map does not know (qwen35's hybrid and MTP layers,
    # eagle3) name the GGUF tensor here.
    gguf_name: str | None = None
    # The GGUF tensor's shape where it differs from the HF one (a [C, 1, K] conv kernel as [C, K]).
    gguf_shape: tuple[int, ...] | None = None
    # Transforms, applied to float32 row blocks in this order: output row i is source row rows[i]
    # (a permutation), output column j is source column cols[j], then fn elementwise.
    rows: np.ndarray | None = field(default=None, compare=False)
    cols: np.ndarray | None = field(default=None, compare=False)
    fn: Callable[[np.ndarray], np.ndarray] | None = field(default=None, compare=False)
    f32: bool = False  # kept F32 whatever the outtype (llama.cpp wants conv kernels in F32)

    @property
    def transformed(self) -> bool:
        return self.rows is not None or self.cols is not None or self.fn is not None


def _get(config: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = config.get(key, default)
    if value is None:
        raise ConversionError(f"config.json has no {key}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ConversionError(f"config.json: {key} must be a positive integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        raise ConversionError(f"config.json: {key} must be a number, got {value!r}")
    return kind(value)


class Architecture:
    """The llama layout; subclasses change what differs."""

    hf_names: ClassVar[tuple[str, ...]] = ()
    gguf_arch: ClassVar[gguf.MODEL_ARCH]
    rope_permute: ClassVar[bool] = False  # True for rope type NORM (llama), False for NEOX (qwen)
    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False
    default_rope_theta: ClassVar[float] = 10000.0

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.gguf_arch]

    # -- hyperparameters ---------------------------------------------------------------------
    def hparams(self, config: dict[str, Any], target: dict[str, Any] | None = None) -> HParams:
        """`target` is the config.json of the model a drafter drafts for (eagle3); others take none."""
        if target is not None:
            raise ConversionError(f"{self.name} is not a drafter: it takes no target model")
        hidden = _get(config, "hidden_size", int)
        heads = _get(config, "num_attention_heads", int)
        kv_heads = _get(config, "num_key_value_heads", int, heads)
        explicit = config.get("head_dim") is not None
        head_dim = _get(config, "head_dim", int) if explicit else hidden // heads
        if not explicit and hidden % heads:
            raise ConversionError(f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        if heads % kv_heads:
            raise ConversionError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if head_dim % 2:
            raise ConversionError(f"config.json: head dimension {head_dim} is odd; rope needs an even one")
        scaling = config.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ConversionError("config.json: rope_scaling must be an object or null")
        return HParams(
            vocab_size=_get(config, "vocab_size", int),
            hidden=hidden,
            layers=_get(config, "num_hidden_layers", int),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=_get(config, "intermediate_size", int),
            rms_eps=_get(config, "rms_norm_eps", float, 1e-6),
            rope_theta=_get(config, "rope_theta", float, self.default_rope_theta),
            context_length=_get(config, "max_position_embeddings", int, 2048),
            tied=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=scaling or None,
            explicit_head_dim=explicit,
        )

    # -- tensors -----------------------------------------------------------------------------
    def tensor_specs(self, hp: HParams) -> dict[str, TensorSpec]:
        """Every HF tensor name this architecture reads, with its expected shape."""
        h, q, kv = hp.hidden, hp.heads * hp.head_dim, hp.kv_heads * hp.head_dim
        perm_q = hp.heads if self.rope_permute else 0
        perm_k = hp.kv_heads if self.rope_permute else 0
        specs = {
            "model.embed_tokens.weight": TensorSpec((hp.vocab_size, h)),
            "model.norm.weight": TensorSpec((h,)),
            "lm_head.weight": TensorSpec((hp.vocab_size, h), required=not hp.tied),
        }
        for i in range(hp.layers):
            p = f"model.layers.{i}."
            specs[p + "input_layernorm.weight"] = TensorSpec((h,))
            specs[p + "post_attention_layernorm.weight"] = TensorSpec((h,))
            specs[p + "self_attn.q_proj.weight"] = TensorSpec((q, h), permute_heads=perm_q)
            specs[p + "self_attn.k_proj.weight"] = TensorSpec((kv, h), permute_heads=perm_k)
            specs[p + "self_attn.v_proj.weight"] = TensorSpec((kv, h))
            specs[p + "self_attn.o_proj.weight"] = TensorSpec((h, q))
            specs[p + "mlp.gate_proj.weight"] = TensorSpec((hp.intermediate, h))
            specs[p + "mlp.up_proj.weight"] = TensorSpec((hp.intermediate, h))
            specs[p + "mlp.down_proj.weight"] = TensorSpec((h, hp.intermediate))
            if self.qkv_bias:
                specs[p + "self_attn.q_proj.bias"] = TensorSpec((q,), permute_heads=perm_q)
                specs[p + "self_attn.k_proj.bias"] = TensorSpec((kv,), permute_heads=perm_k)
                specs[p + "self_attn.v_proj.bias"] = TensorSpec((kv,))
            if self.qk_norm:
                specs[p + "self_attn.q_norm.weight"] = TensorSpec((hp.head_dim,))
                specs[p + "self_attn.k_norm.weight"] = TensorSpec((hp.head_dim,))
        return specs

    def skip_tensor(self, name: str, hp: HParams) -> bool:
        """Tensors present in some checkpoints that GGUF does not need."""
        if name.endswith(".rotary_emb.inv_freq"):
            return True
        return name == "lm_head.weight" and hp.tied  # a saved copy of the tied embedding

    def extra_tensors(self, hp: HParams) -> dict[str, np.ndarray]:
        """Tensors computed from the config (GGUF name -> float32 array)."""
        return {}

    def checkpoint_tensors(self, ckpt: Checkpoint, hp: HParams) -> dict[str, np.ndarray]:
        """Tensors computed from non-weight checkpoint entries (GGUF name -> float32 or int64 array),
        e.g. eagle3's draft-to-target vocabulary table; the entries themselves are skipped."""
        return {}

    def regroup(self, ckpt: Checkpoint, hp: HParams, quantized: dict[str, QuantizedTensor]
                ) -> tuple[dict[str, QuantizedTensor], set[str]]:
        """Tensors read as other tensors than stored (gpt-oss's fused, interleaved expert stacks
        split into llama.cpp's gate/up/down): the quantization scheme's tensors with these added
        or renamed (row-streamed like them), and the stored names they consume."""
        return quantized, set()

    # -- metadata ----------------------------------------------------------------------------
    def write_metadata(self, w: gguf.GGUFWriter, hp: HParams) -> None:
        w.add_context_length(hp.context_length)
        w.add_embedding_length(hp.hidden)
        w.add_block_count(hp.layers)
        w.add_feed_forward_length(hp.intermediate)
        w.add_head_count(hp.heads)
        w.add_head_count_kv(hp.kv_heads)
        w.add_rope_freq_base(hp.rope_theta)
        w.add_layer_norm_rms_eps(hp.rms_eps)
        w.add_vocab_size(hp.vocab_size)
        w.add_rope_dimension_count(hp.rope_dims or hp.head_dim)
        if hp.explicit_head_dim:
            w.add_key_length(hp.head_dim)
            w.add_value_length(hp.head_dim)
        self.write_rope_scaling(w, hp)

    def write_rope_scaling(self, w: gguf.GGUFWriter, hp: HParams) -> None:
        s = hp.rope_scaling
        if not s:
            return
        kind = str(s.get("rope_type") or s.get("type") or "").lower()
        if kind == "default":
            return
        if kind == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(s["factor"]))
            return
        if kind == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(s["factor"]))
            w.add_rope_scaling_orig_ctx_len(int(s["original_max_position_embeddings"]))
            return
        raise ConversionError(f"rope_scaling type {kind!r} is not supported for {self.name}")
