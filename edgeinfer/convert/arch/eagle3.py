"""EAGLE-3 drafters: llama.cpp's `eagle3` architecture (its converter: `conversion/llama.py`).

An EAGLE-3 drafter is one llama decoder layer that reads the target model's hidden states: `fc`
fuses three of the target's layer inputs (3 x target hidden -> draft hidden), the layer's
attention takes [input_layernorm(token embedding), hidden_norm(fused state)] (2 x hidden wide),
and its LM head covers a smaller draft vocabulary whose ids `d2t` maps to target ids. Token
embeddings (and, without a head, the LM head) may come from the target at run time.

Published layouts: SpecForge / EAGLE's `LlamaForCausalLMEagle3` (`midlayer.*`) and the
speculators library's `Eagle3Speculator` (`layers.0.*`, settings under transformer_layer_config).
The drafter's config does not always say which target layers it reads nor how wide they are:
then the target model's own config.json supplies them (`convert_model(..., target=FOLDER)`), as
llama.cpp's --target-model-dir does; its tokenizer is the drafter's vocabulary. What llama.cpp
wants to know of the target is written as `eagle3.target_layers` / `eagle3.target_hidden_size`;
the target's name, where its config gives one, as general.base_model.0.name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from ...errors import ConversionError
from .base import HParams, TensorSpec, _get
from .llama import Llama

if TYPE_CHECKING:
    from ..safetensors import Checkpoint

__all__ = ["Eagle3", "Eagle3HParams", "is_eagle3_config"]

_ARCH = "eagle3"


def is_eagle3_config(config: dict[str, Any]) -> bool:
    """llama.cpp's own test: a one-layer llama with a draft vocabulary is an EAGLE-3 drafter,
    whatever its `architectures` says."""
    layer_cfg = config.get("transformer_layer_config")
    c = {**config, **layer_cfg} if isinstance(layer_cfg, dict) else config
    return "draft_vocab_size" in c and c.get("num_hidden_layers") == 1


@dataclass(frozen=True)
class Eagle3HParams(HParams):
    prefix: str = "midlayer."
    draft_vocab: int = 0
    target_layers: tuple[int, ...] = ()
    target_hidden: int = 0
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    target_name: str | None = None


class Eagle3(Llama):
    hf_names = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel")

    @property
    def name(self) -> str:
        return _ARCH

    # -- hyperparameters ---------------------------------------------------------------------
    def hparams(self, config: dict[str, Any], target: dict[str, Any] | None = None) -> Eagle3HParams:
        layer_cfg = config.get("transformer_layer_config")
        if layer_cfg is not None and not isinstance(layer_cfg, dict):
            raise ConversionError("config.json: transformer_layer_config must be an object")
        c = {**config, **(layer_cfg or {})}
        if c.get("num_hidden_layers") != 1:
            raise ConversionError(f"config.json: an EAGLE-3 drafter has 1 layer, not {c.get('num_hidden_layers')!r}")
        base = super().hparams(c)
        t = {**target, **(target.get("text_config") or {})} if target is not None else None
        if t is not None and _get(t, "vocab_size", int) != base.vocab_size:
            raise ConversionError(f"config.json: vocab_size {base.vocab_size} is not the target's ({t.get('vocab_size')})")
        draft_vocab = _get(c, "draft_vocab_size", int, base.vocab_size)
        if draft_vocab > base.vocab_size:
            raise ConversionError(f"config.json: draft_vocab_size {draft_vocab} exceeds vocab_size {base.vocab_size}")

        eagle = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
        layers = c.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        n_target = _get(t, "num_hidden_layers", int) if t is not None else None
        if layers is None:
            if n_target is None:
                raise ConversionError("config.json does not say which target layers the drafter reads "
                                      "(eagle_aux_hidden_state_layer_ids): give the target model's folder")
            layers = [2, n_target // 2, n_target - 3]  # llama.cpp's (and EAGLE-3's) default
        if (not isinstance(layers, list) or len(layers) != 3
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
            raise ConversionError(f"config.json: eagle_aux_hidden_state_layer_ids must be 3 layer indices, not {layers!r}")
        if n_target is not None and max(layers) > n_target:  # == n_target: the target's final state
            raise ConversionError(f"target layer {max(layers)} is past the target's {n_target} layers")
        if c.get("target_hidden_size") is not None:
            target_hidden = _get(c, "target_hidden_size", int)
        elif t is not None:
            target_hidden = _get(t, "hidden_size", int)
        else:
            raise ConversionError("config.json has no target_hidden_size: give the target model's folder")

        archs = config.get("architectures") or []
        prefix = "layers.0." if "Eagle3Speculator" in archs or layer_cfg is not None else "midlayer."
        name = t.get("_name_or_path") if t is not None else None
        return Eagle3HParams(
            **{f: getattr(base, f) for f in HParams.__dataclass_fields__},
            prefix=prefix,
            draft_vocab=draft_vocab,
            target_layers=tuple(layers),
            target_hidden=target_hidden,
            norm_before_residual=bool(c.get("norm_before_residual", False)),
            norm_before_fc=bool(c.get("norm_before_fc", False)),
            target_name=name if isinstance(name, str) and name else None,
        )

    # -- tensors -----------------------------------------------------------------------------
    def tensor_specs(self, hp: HParams) -> dict[str, TensorSpec]:
        assert isinstance(hp, Eagle3HParams)
        h, d = hp.hidden, hp.head_dim
        q, kv = hp.heads * d, hp.kv_heads * d
        m = hp.prefix
        return {
            m + "input_layernorm.weight": TensorSpec((h,), gguf_name="blk.0.attn_norm.weight"),
            m + "hidden_norm.weight": TensorSpec((h,), gguf_name="blk.0.attn_norm_2.weight"),
            # the attention reads [embedding, fused state]: 2 x hidden columns; llama's rope order
            m + "self_attn.q_proj.weight": TensorSpec((q, 2 * h), permute_heads=hp.heads, gguf_name="blk.0.attn_q.weight"),
            m + "self_attn.k_proj.weight": TensorSpec((kv, 2 * h), permute_heads=hp.kv_heads, gguf_name="blk.0.attn_k.weight"),
            m + "self_attn.v_proj.weight": TensorSpec((kv, 2 * h), gguf_name="blk.0.attn_v.weight"),
            m + "self_attn.o_proj.weight": TensorSpec((h, q), gguf_name="blk.0.attn_output.weight"),
            m + "post_attention_layernorm.weight": TensorSpec((h,), gguf_name="blk.0.ffn_norm.weight"),
            m + "mlp.gate_proj.weight": TensorSpec((hp.intermediate, h), gguf_name="blk.0.ffn_gate.weight"),
            m + "mlp.up_proj.weight": TensorSpec((hp.intermediate, h), gguf_name="blk.0.ffn_up.weight"),
            m + "mlp.down_proj.weight": TensorSpec((h, hp.intermediate), gguf_name="blk.0.ffn_down.weight"),
            "fc.weight": TensorSpec((h, 3 * hp.target_hidden), gguf_name="fc.weight"),
            "input_norm.weight": TensorSpec((3 * hp.target_hidden,), required=hp.norm_before_fc,
                                            gguf_name="enc.output_norm.weight"),
            "norm.weight": TensorSpec((h,), gguf_name="output_norm.weight"),
            "lm_head.weight": TensorSpec((hp.draft_vocab, h), gguf_name="output.weight"),
            # its own token embeddings (else the target's are used at run time)
            "embed_tokens.weight": TensorSpec((hp.vocab_size, h), required=False, gguf_name="token_embd.weight"),
        }

    def skip_tensor(self, name: str, hp: HParams) -> bool:
        # d2t becomes a table of target ids (checkpoint_tensors); t2d is not used at run time
        return name in ("d2t", "t2d") or super().skip_tensor(name, hp)

    def checkpoint_tensors(self, ckpt: Checkpoint, hp: HParams) -> dict[str, np.ndarray]:
        assert isinstance(hp, Eagle3HParams)
        if "d2t" not in ckpt.where:
            if hp.draft_vocab != hp.vocab_size:
                raise ConversionError(f"missing tensor d2t (the draft vocabulary of {hp.draft_vocab} ids needs its map)")
            return {}
        entry = ckpt.entry("d2t")
        if entry.dtype not in ("I64", "I32") or entry.shape != (hp.draft_vocab,):
            raise ConversionError(f"tensor d2t is {entry.dtype}{list(entry.shape)}; expected I64[{hp.draft_vocab}]")
        # stored as offsets (target id - draft id); llama.cpp wants the target ids themselves
        ids = ckpt.where["d2t"].array("d2t").astype(np.int64) + np.arange(hp.draft_vocab, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= hp.vocab_size):
            raise ConversionError(f"tensor d2t maps draft ids outside the target's vocabulary of {hp.vocab_size}")
        if np.unique(ids).size != ids.size:
            raise ConversionError("tensor d2t maps two draft ids to the same target id")
        return {"d2t": ids}

    # -- metadata ----------------------------------------------------------------------------
    def write_metadata(self, w: gguf.GGUFWriter, hp: HParams) -> None:
        assert isinstance(hp, Eagle3HParams)
        super().write_metadata(w, hp)
        w.add_array(f"{_ARCH}.target_layers", list(hp.target_layers))
        w.add_uint32(f"{_ARCH}.target_hidden_size", hp.target_hidden)
        w.add_bool(f"{_ARCH}.norm_before_residual", hp.norm_before_residual)
        w.add_bool(f"{_ARCH}.norm_before_fc", hp.norm_before_fc)
        if hp.target_name:
            w.add_base_model_count(1)
            w.add_base_model_name(0, hp.target_name)
