"""Medusa heads (FasterDecoding/Medusa, Medusa-1 and -2) -> a GGUF file of heads.

A Medusa head reads the target model's last hidden state (after its final norm: what its output
layer reads) and predicts a token further ahead: head i, on the state at position t, the token at
t + 2 + i. Each head is `medusa_num_layers` residual blocks x + SiLU(W x + b) (hidden -> hidden,
with bias) and a vocabulary projection (hidden -> vocab, no bias):

    medusa_head.{i}.{l}.linear.weight / .bias   l < medusa_num_layers   (Medusa-2: in the model's shards)
    medusa_head.{i}.{L}.weight                  L = medusa_num_layers
    {i}.{l}.linear.weight, {i}.{L}.weight        (Medusa-1's medusa_lm_head file: the heads alone)

The published code builds a head's blocks as `[ResBlock(hidden)] * medusa_num_layers`: one block
repeated, so a file may hold block 0 only; its weights then serve every l.

llama.cpp has no Medusa architecture: the file is ours (`general.architecture` = "medusa"), read
by edgeinfer's Medusa drafter (engine/speculation/medusa.py), which evaluates the heads in numpy on
the hidden state llama.cpp hands over. It holds `medusa.head_count`, `medusa.layer_count`,
`medusa.embedding_length`, `medusa.vocab_size` and tensors `medusa.{i}.res.{l}.weight|bias`,
`medusa.{i}.output.weight`. It is not a model llama.cpp loads, so it is written to a file and not
registered in the store; `--speculate medusa=FILE` names it. Only safetensors are read (no torch):
a Medusa-1 `medusa_lm_head.pt` must be saved as safetensors first.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import ConversionError, InvalidOptionError
from ..fsutil import atomic_path, ensure_free_space
from .safetensors import FLOAT_DTYPES, Checkpoint, open_checkpoint

__all__ = ["is_medusa_config", "convert_medusa", "MEDUSA_ARCH", "MEDUSA_OUTTYPES", "head_tensor_names"]

MEDUSA_ARCH = "medusa"
MEDUSA_OUTTYPES: dict[str, QT] = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16}
_MAX_HEADS = 64  # the most a draft may be long (SpeculationOptions.draft_max)
_MAX_LAYERS = 16
_HEAD_KEY = re.compile(r"^(medusa_head\.)?(\d+)\.(\d+)\.")


def is_medusa_config(config: dict[str, Any]) -> bool:
    return "medusa_num_heads" in config


def head_tensor_names(i: int, n_layers: int) -> tuple[list[tuple[str, str]], str]:
    """The GGUF names of head i: [(block weight, block bias)] and its output projection."""
    return ([(f"medusa.{i}.res.{l}.weight", f"medusa.{i}.res.{l}.bias") for l in range(n_layers)],
            f"medusa.{i}.output.weight")


def _count(config: dict[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int:
    v = config.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ConversionError(f"config.json: {key} must be an integer in [{lo}, {hi}], not {v!r}")
    return v


def _f32(ckpt: Checkpoint, name: str) -> np.ndarray:
    e = ckpt.entry(name)
    raw = ckpt.where[name].array(name)
    if e.dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


class _Layout:
    """Where each head's tensors are in the checkpoint, checked against the config."""

    def __init__(self, ckpt: Checkpoint, config: dict[str, Any]):
        self.n_heads = _count(config, "medusa_num_heads", 1, _MAX_HEADS)
        self.n_layers = _count(config, "medusa_num_layers", 0, _MAX_LAYERS, 1)
        keys = [n for n in ckpt.names if _HEAD_KEY.match(n)]
        if not keys:
            raise ConversionError("no Medusa head tensors (medusa_head.{i}.* or {i}.*) in the checkpoint")
        self.prefix = "medusa_head." if any(k.startswith("medusa_head.") for k in keys) else ""
        found = {int(m.group(2)) for k in keys if (m := _HEAD_KEY.match(k)) and (m.group(1) or "") == self.prefix}
        if found != set(range(self.n_heads)):
            raise ConversionError(f"config.json says medusa_num_heads {self.n_heads}, the checkpoint has heads "
                                  f"{sorted(found)[:8]}")
        out = self.output(0)
        if out not in ckpt.where:
            raise ConversionError(f"missing tensor {out} (medusa_num_layers {self.n_layers}: the projection follows "
                                  "the blocks)")
        shape = ckpt.entry(out).shape
        if len(shape) != 2 or min(shape) < 1:
            raise ConversionError(f"tensor {out} has shape {list(shape)}; expected [vocab, hidden]")
        self.vocab, self.hidden = int(shape[0]), int(shape[1])
        h = self.hidden
        for i in range(self.n_heads):
            want = {self.output(i): (self.vocab, h)}
            for l in range(self.n_layers):
                w, b = self.source(ckpt, i, l)
                want[w], want[b] = (h, h), (h,)
            for name, sh in want.items():
                if name not in ckpt.where:
                    raise ConversionError(f"missing tensor {name}")
                e = ckpt.entry(name)
                if tuple(e.shape) != sh:
                    raise ConversionError(f"tensor {name} has shape {list(e.shape)}; expected {list(sh)}")
                if e.dtype not in FLOAT_DTYPES:
                    raise ConversionError(f"tensor {name} is {e.dtype}; Medusa heads are read as floats")

    def output(self, i: int) -> str:
        return f"{self.prefix}{i}.{self.n_layers}.weight"

    def source(self, ckpt: Checkpoint, i: int, l: int) -> tuple[str, str]:
        """Block l of head i, or block 0 where the file keeps the one shared block only."""
        k = l if f"{self.prefix}{i}.{l}.linear.weight" in ckpt.where else 0
        return f"{self.prefix}{i}.{k}.linear.weight", f"{self.prefix}{i}.{k}.linear.bias"


def convert_medusa(folder: Path, config: dict[str, Any], outtype: str | None, output: Path) -> tuple[int, int, str]:
    """Write the heads of the checkpoint in `folder` to `output`; returns (tensors, bytes read,
    outtype). Raises ConversionError (one line); on any failure nothing is left behind."""
    outtype = outtype or "f16"
    if outtype not in MEDUSA_OUTTYPES:
        raise InvalidOptionError(f"Medusa heads are written as {', '.join(MEDUSA_OUTTYPES)}, not {outtype!r}")
    qtype = MEDUSA_OUTTYPES[outtype]
    if (folder / "medusa_lm_head.pt").is_file() and not any(folder.glob("*.safetensors")):
        raise ConversionError("medusa_lm_head.pt is a torch pickle, which edgeinfer does not unpickle (no torch): "
                              "save it as medusa_lm_head.safetensors (safetensors.torch.save_file) and convert that")
    with open_checkpoint(folder) as ckpt:
        lay = _Layout(ckpt, config)
        plan: list[tuple[str, str, QT]] = []  # (gguf name, checkpoint name, type written)
        for i in range(lay.n_heads):
            blocks, out = head_tensor_names(i, lay.n_layers)
            for l, (w, b) in enumerate(blocks):
                sw, sb = lay.source(ckpt, i, l)
                plan += [(w, sw, qtype), (b, sb, QT.F32)]  # vectors stay F32
            plan.append((out, lay.output(i), qtype))
        sizes = [math.prod(ckpt.entry(s).shape) * (4 if t == QT.F32 else 2) for _, s, t in plan]
        ensure_free_space(output.parent, sum(sizes) + (16 << 20), "the converted Medusa heads")
        with atomic_path(output) as tmp:
            w = gguf.GGUFWriter(tmp, MEDUSA_ARCH)
            try:
                w.add_name(f"{folder.name} (Medusa heads)")
                w.add_type(gguf.GGUFType.MODEL)
                w.add_uint32(f"{MEDUSA_ARCH}.head_count", lay.n_heads)
                w.add_uint32(f"{MEDUSA_ARCH}.layer_count", lay.n_layers)
                w.add_uint32(f"{MEDUSA_ARCH}.embedding_length", lay.hidden)
                w.add_uint32(f"{MEDUSA_ARCH}.vocab_size", lay.vocab)
                base = config.get("base_model_name_or_path")
                if isinstance(base, str) and base:
                    w.add_base_model_count(1)
                    w.add_base_model_name(0, base)
                for (name, src, t), n in zip(plan, sizes):
                    w.add_tensor_info(name, ckpt.entry(src).shape, np.dtype(np.float32), n, raw_dtype=t)
                w.write_header_to_file()
                w.write_kv_data_to_file()
                w.write_ti_data_to_file()
                for _, src, t in plan:  # one tensor in memory at a time
                    x = _f32(ckpt, src)
                    if not np.isfinite(x).all():
                        raise ConversionError(f"tensor {src} holds non-finite values")
                    w.write_tensor_data(x if t == QT.F32 else x.astype(np.float16) if t == QT.F16
                                        else gguf.quants.quantize(x, QT.BF16))
                w.flush()
            finally:
                w.close()
        n_src = sum(ckpt.entry(s).n_bytes for _, s, _ in plan)
    return len(plan), n_src, outtype
