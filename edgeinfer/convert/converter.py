"""Hugging Face folder (config.json + safetensors + tokenizer.json) -> GGUF, one tensor at a time.

Everything is checked before the first byte is written (config, tokenizer, every tensor's
presence and shape). The GGUF header and tensor table are written first; then each tensor is read
from the memory map in row blocks, converted, written and its source pages dropped, so peak memory
is a few row blocks, not the model. The file appears under its final name only when complete.

Quantized checkpoints (FP8, AWQ, GPTQ, compressed-tensors; NVFP4/MXFP4: see `quantized`, `fp4`) are
dequantized row block by row block; with outtype "auto" the 4-bit (and 8-bit symmetric) layers whose
groups a GGUF block type holds as they are go straight into Q4_1/Q4_0/Q8_0/MXFP4/NVFP4 blocks,
without a second rounding (an NVFP4 layer's per-tensor scale beside it, as `<name>.scale`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType

from ..cancel import CancelToken, is_cancelled
from ..errors import Cancelled, ConversionError, InvalidOptionError
from ..fsutil import atomic_path, ensure_free_space
from ..gguf_file import read_gguf
from ..store import ModelManifest, Store, normalize_name
from .arch import Architecture, HParams, TensorSpec, architecture_for
from .embedding import adapt_checkpoint, read_embedding_spec
from .medusa import MEDUSA_ARCH, convert_medusa, is_medusa_config
from .quantized import QuantizedTensor, QuantScheme, scheme_for
from .quantized.fp4 import scale_applied
from .safetensors import FLOAT_DTYPES, Checkpoint, SafetensorsFile, TensorEntry, open_checkpoint
from .tokenizer import load_vocab

log = logging.getLogger(__name__)

__all__ = [
    "convert_model",
    "ConvertProgress",
    "ConvertResult",
    "DirectTensor",
    "NonFiniteWeightWarning",
    "OUTTYPES",
    "OUTTYPE_CHOICES",
]

OUTTYPES: dict[str, tuple[QT, LlamaFileType]] = {
    "f32": (QT.F32, LlamaFileType.ALL_F32),
    "f16": (QT.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (QT.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (QT.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
# "auto": quantized layers straight into the GGUF block type that holds them (see module doc), every
# other matrix Q8_0, vectors F32.
OUTTYPE_CHOICES: tuple[str, ...] = (*OUTTYPES, "auto")
_FILE_TYPES = {QT.F32: LlamaFileType.ALL_F32, QT.F16: LlamaFileType.MOSTLY_F16, QT.BF16: LlamaFileType.MOSTLY_BF16,
               QT.Q8_0: LlamaFileType.MOSTLY_Q8_0, QT.Q4_0: LlamaFileType.MOSTLY_Q4_0, QT.Q4_1: LlamaFileType.MOSTLY_Q4_1,
               QT.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE, QT.NVFP4: LlamaFileType.MOSTLY_NVFP4}
_CHUNK_BYTES = 16 << 20  # float32 bytes per row block
_IN_FLIGHT = 3  # row blocks converted ahead of the writer


class NonFiniteWeightWarning(UserWarning):
    """A weight tensor holds NaN or Inf values (or values a 16-bit output type cannot hold)."""


@dataclass(frozen=True)
class ConvertProgress:
    """One tensor written. `bytes_done`/`bytes_total` count source (safetensors) bytes."""

    tensor: str  # GGUF tensor name
    index: int  # 1-based
    count: int
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class DirectTensor:
    """A layer written from the checkpoint's integers straight into a GGUF block type."""

    name: str  # GGUF tensor name
    qtype: str  # "Q4_1", "Q4_0", "Q8_0", "MXFP4" or "NVFP4"
    max_error: float  # max |GGUF value - dequantized checkpoint value| (f16 rounding of d and m; FP4: see fp4.py)


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    manifest: ModelManifest | None
    architecture: str  # GGUF architecture, e.g. "llama"
    outtype: str
    n_tensors: int
    source_bytes: int
    output_bytes: int
    seconds: float
    warnings: tuple[str, ...] = field(default=())
    quantization: str | None = None  # the checkpoint's quant_method (awq, gptq, fp8, ...), None for float
    direct: tuple[DirectTensor, ...] = field(default=())  # outtype "auto": layers written without requantizing


@dataclass
class _Plan:
    """One output tensor: where its data comes from and how it is encoded."""

    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order (rows, row length)
    qtype: QT
    nbytes: int
    source: SafetensorsFile | None = None
    entry: TensorEntry | None = None
    data: np.ndarray | None = None  # computed tensors (rope_freqs)
    permute_heads: int = 0
    quant: QuantizedTensor | None = None  # a quantized checkpoint's layer (instead of source/entry)
    direct: bool = False  # qtype's blocks are packed from quant's integers as they are
    spec: TensorSpec | None = None  # its row/column/elementwise transforms (qwen35)

    @property
    def source_bytes(self) -> int:
        if self.quant is not None:
            return self.quant.source_bytes
        return self.entry.n_bytes if self.entry is not None else 0


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ConversionError(f"missing {path.name} in {path.parent} ({what})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path.name} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path.name} is not a JSON object")
    return data


def _out_type(shape: tuple[int, ...], outtype: QT) -> QT:
    if len(shape) < 2 or outtype == QT.F32:
        return QT.F32  # norms, biases and other vectors stay F32, as llama.cpp expects
    if outtype == QT.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[QT.Q8_0][0]:
        return QT.F16
    return outtype


def _nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    return math.prod(gguf.quant_shape_to_byte_shape(shape, qtype)) if qtype not in (QT.F32, QT.F16) else (
        math.prod(shape) * (4 if qtype == QT.F32 else 2)
    )


def _to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)  # a copy: the map's pages can then be dropped


def _encode(x: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return x
    if qtype == QT.F16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    return gguf.quants.quantize(x, qtype)


def _permute_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate_half layout -> llama.cpp NORM layout, for a block of whole heads."""
    rows = x.shape[0]
    return x.reshape(n_heads, 2, rows // n_heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


class _TensorStream:
    """Duck-types the ndarray GGUFWriter.write_tensor_data expects (`nbytes`, `tofile`) and
    produces the tensor in row blocks, so no whole-tensor copy ever exists.

    Blocks are converted on a small thread pool (numpy releases the GIL in casts and
    quantization) with at most `_IN_FLIGHT` blocks pending, and written in order."""

    def __init__(self, plan: _Plan, pool: ThreadPoolExecutor, on_nonfinite: Callable[[str], None]):
        self.plan = plan
        self.nbytes = plan.nbytes
        self._pool = pool
        self._on_nonfinite = on_nonfinite
        self.max_error = 0.0  # direct blocks: max |GGUF value - dequantized value| so far

    def _convert(self, src: np.ndarray | None, r0: int, r1: int, align: int) -> tuple[np.ndarray, float, float]:
        p = self.plan
        if p.quant is not None and p.direct:
            blocks = p.quant.direct_rows(p.qtype, r0, r1)
            out = _permute_rows(blocks.data, (r1 - r0) // align) if p.permute_heads else blocks.data
            return out, -blocks.max_error, blocks.max_error  # NaN scales show up as a NaN error
        spec = p.spec if p.spec is not None and p.spec.transformed else None
        if spec is not None and spec.rows is not None:
            # A row permutation: read the rows' covering span (kept resident: later blocks may need it)
            idx = spec.rows[r0:r1]
            lo, hi = int(idx.min()), int(idx.max()) + 1
            if p.quant is not None:
                x = p.quant.rows(lo, hi)[idx - lo]
            else:
                assert p.entry is not None and src is not None
                x = _to_f32(src[lo:hi], p.entry.dtype)[idx - lo]
        elif p.quant is not None:
            x = p.quant.rows(r0, r1)
        else:
            assert p.source is not None and p.entry is not None and src is not None
            x = _to_f32(src[r0:r1], p.entry.dtype)
            stored_row = src.shape[1] * src.itemsize
            p.source.release(p.entry.begin + r0 * stored_row, p.entry.begin + r1 * stored_row)
        if spec is not None:
            if spec.cols is not None:
                x = x[:, spec.cols]
            if spec.fn is not None:
                x = np.ascontiguousarray(spec.fn(x), dtype=np.float32)
        if p.permute_heads:
            x = _permute_rows(x, (r1 - r0) // align)
        # Two SIMD reductions instead of isfinite's temporary: min/max propagate NaN and Inf.
        lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
        return _encode(x, p.qtype), lo, hi

    def _check(self, lo: float, hi: float) -> None:
        p = self.plan
        if p.direct:
            self.max_error = max(self.max_error, hi)  # direct blocks report (-error, error)
        name = p.quant.name if p.quant is not None else p.entry.name if p.entry is not None else p.name
        if not (math.isfinite(lo) and math.isfinite(hi)):
            self._on_nonfinite(f"tensor {name} has NaN or Inf values")
        elif self.plan.qtype == QT.F16 and max(-lo, hi) > 65504.0:
            self._on_nonfinite(f"tensor {name} has values too large for f16")

    def _blocks(self) -> Iterator[np.ndarray]:
        p = self.plan
        if p.data is not None:
            yield p.data
            return
        src: np.ndarray | None = None
        if p.quant is not None:
            rows, cols = p.quant.shape
            align = math.lcm(rows // p.permute_heads if p.permute_heads else 1, p.quant.row_align)
        else:
            assert p.source is not None and p.entry is not None
            src = p.source.array(p.entry.name)
            rows = src.shape[0] if src.ndim else 1
            src = src.reshape(rows, -1)
            cols = src.shape[1]
            align = rows // p.permute_heads if p.permute_heads else 1  # whole heads per block
        step = max(align, (_CHUNK_BYTES // max(cols * 4, 1)) // align * align)
        pending: deque[Future[tuple[np.ndarray, float, float]]] = deque()
        try:
            for r0 in range(0, rows, step):
                pending.append(self._pool.submit(self._convert, src, r0, min(rows, r0 + step), align))
                if len(pending) >= _IN_FLIGHT:
                    out, lo, hi = pending.popleft().result()
                    self._check(lo, hi)
                    yield out
            while pending:
                out, lo, hi = pending.popleft().result()
                self._check(lo, hi)
                yield out
        finally:
            for f in pending:
                f.cancel()
            wait(pending)  # no worker may still read the map when it is closed
            del src
            if p.quant is not None:
                p.quant.release()

    def tofile(self, fp: Any) -> None:
        written = 0
        for block in self._blocks():
            block = np.ascontiguousarray(block)
            fp.write(memoryview(block).cast("B"))
            written += block.nbytes
        if written != self.nbytes:  # would misalign every later tensor
            raise ConversionError(f"internal error: {self.plan.name} produced {written} bytes, expected {self.nbytes}")


class _Writer(gguf.GGUFWriter):
    """GGUFWriter with a fast path for the long arrays of a vocabulary: the generic packer
    handles them one item at a time (about a second per conversion for a 50k vocabulary).
    Produces the same bytes; anything unusual goes to the generic packer."""

    def _pack_val(self, val: Any, vtype: gguf.GGUFValueType, add_vtype: bool,
                  sub_type: gguf.GGUFValueType | None = None) -> bytes:
        VT = gguf.GGUFValueType
        if vtype == VT.ARRAY and self.endianess == gguf.GGUFEndian.LITTLE and isinstance(val, list) and len(val) > 256:
            head = struct.pack("<I", vtype) if add_vtype else b""
            if sub_type in (None, VT.STRING) and all(isinstance(v, (str, bytes)) for v in val):
                enc = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
                body = b"".join(struct.pack("<Q", len(b)) + b for b in enc)
                return head + struct.pack("<IQ", VT.STRING, len(enc)) + body
            if sub_type in (None, VT.INT32) and all(type(v) is int for v in val):
                arr = np.asarray(val, dtype=np.int64)
                if arr.min() >= -(2**31) and arr.max() < 2**31:
                    return head + struct.pack("<IQ", VT.INT32, len(val)) + arr.astype("<i4").tobytes()
            if sub_type in (None, VT.FLOAT32) and all(type(v) is float for v in val):
                return head + struct.pack("<IQ", VT.FLOAT32, len(val)) + np.asarray(val, dtype="<f4").tobytes()
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _model_name(folder: Path, config: dict[str, Any]) -> str:
    """A display name: the folder, or the repo name of a Hugging Face cache snapshot."""
    if re.fullmatch(r"[0-9a-f]{40}", folder.name) and folder.parent.name == "snapshots":
        return folder.parent.parent.name.split("--")[-1]
    if folder.name:
        return folder.name
    return str(config.get("_name_or_path") or "model").rstrip("/").split("/")[-1]


def _readme_license(folder: Path) -> str | None:
    readme = folder / "README.md"
    try:
        text = readme.read_text(encoding="utf-8", errors="replace")[:20000]
    except OSError:
        return None
    m = re.match(r"---\s*\n(.*?)\n---", text, re.S)
    if not m:
        return None
    lic = re.search(r"^license:\s*['\"]?([^'\"\n]+)", m.group(1), re.M)
    return lic.group(1).strip() if lic else None


def _auto_type(shape: tuple[int, ...], quant: QuantizedTensor | None) -> tuple[QT, bool]:
    """outtype "auto": (type, written directly from the checkpoint's integers)."""
    if quant is not None and (direct := quant.direct_type()) is not None:
        return direct, True
    if len(shape) < 2:
        return QT.F32, False
    return (QT.Q8_0, False) if shape[-1] % gguf.GGML_QUANT_SIZES[QT.Q8_0][0] == 0 else (QT.F16, False)


def _plan_tensors(ckpt: Checkpoint, arch: Architecture, hp: HParams, outtype: QT | None,
                  scheme: QuantScheme | None = None) -> list[_Plan]:
    """One plan per GGUF tensor; `outtype` None means "auto"."""
    specs: dict[str, TensorSpec] = arch.tensor_specs(hp)
    name_map: gguf.TensorNameMap | None = None  # made when a spec names no GGUF tensor itself
    quantized, consumed = scheme.tensors(ckpt) if scheme is not None else ({}, set())
    quantized, regrouped = arch.regroup(ckpt, hp, quantized)  # gpt-oss: fused expert stacks split
    consumed |= regrouped
    present = {n for n in ckpt.names if n not in consumed} | set(quantized)
    unexpected = sorted(n for n in present if n not in specs and not arch.skip_tensor(n, hp))
    if unexpected:
        more = f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise ConversionError(f"unexpected tensor {', '.join(unexpected[:3])}{more} for {arch.name} with config.json's layout")
    missing = [n for n, s in specs.items() if s.required and n not in present]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConversionError(f"missing tensor {', '.join(missing[:3])}{more}")
    plans: list[_Plan] = []
    for hf_name, spec in specs.items():
        if hf_name not in present or arch.skip_tensor(hf_name, hp):
            continue
        quant = quantized.get(hf_name)
        entry = ckpt.entry(hf_name) if quant is None else None
        if entry is not None and entry.dtype not in FLOAT_DTYPES:
            how = f"; {scheme.method} does not quantize this tensor" if scheme is not None else \
                " (and config.json has no quantization_config)"
            raise ConversionError(f"tensor {hf_name} has dtype {entry.dtype}; only F32, F16 and BF16 weights are supported{how}")
        shape = quant.shape if quant is not None else entry.shape  # type: ignore[union-attr]
        if shape != spec.shape:
            raise ConversionError(
                f"tensor {hf_name} has shape {list(shape)} but config.json implies {list(spec.shape)}"
            )
        gguf_name = spec.gguf_name
        if gguf_name is None:
            if name_map is None:
                name_map = gguf.get_tensor_name_map(arch.gguf_arch, hp.layers)
            gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ConversionError(f"internal error: no GGUF name for {hf_name}")
        out_shape = spec.gguf_shape or spec.shape
        if spec.f32:
            qtype, direct = QT.F32, False
        elif outtype is None:  # a transformed layer is dequantized: its blocks cannot be copied
            qtype, direct = _auto_type(out_shape, None if spec.transformed else quant)
            if direct and (scale := quant.tensor_scale()) is not None:  # type: ignore[union-attr]
                if not scale_applied(arch.name, gguf_name):  # llama.cpp would ignore `.scale` here
                    qtype, direct = _auto_type(out_shape, None)
                else:
                    plans.append(_Plan(gguf_name.removesuffix(".weight") + ".scale", (1,), QT.F32, 4,
                                       data=np.array([scale], np.float32)))
        else:
            qtype, direct = _out_type(out_shape, outtype), False
        source = ckpt.where[hf_name] if quant is None else None
        plans.append(
            _Plan(gguf_name, out_shape, qtype, _nbytes(out_shape, qtype), source, entry,
                  permute_heads=spec.permute_heads, quant=quant, direct=direct, spec=spec)
        )
    computed = {**arch.extra_tensors(hp), **arch.checkpoint_tensors(ckpt, hp)}
    for gguf_name, data in computed.items():
        if data.dtype == np.int64:  # an id table (eagle3's d2t), kept as integers
            plans.append(_Plan(gguf_name, data.shape, QT.I64, data.nbytes, data=data.astype("<i8")))
        else:
            plans.append(_Plan(gguf_name, data.shape, QT.F32, data.nbytes, data=data.astype(np.float32)))
    return plans


def _source_dtype(ckpt: Checkpoint) -> str:
    """The float dtype holding most bytes (a quantized checkpoint's unquantized tensors decide)."""
    sizes: dict[str, int] = {}
    for f in ckpt.files:
        for e in f.tensors.values():
            if e.dtype in FLOAT_DTYPES:
                sizes[e.dtype] = sizes.get(e.dtype, 0) + e.n_bytes
    return max(sizes, key=sizes.__getitem__) if sizes else "F32"


def convert_model(
    source_dir: str | Path,
    outtype: str | None = None,
    output: str | Path | None = None,
    *,
    store: Store | None = None,
    on_progress: Callable[[ConvertProgress], None] | None = None,
    name: str | None = None,
    repo_id: str | None = None,
    register: bool = True,
    cancel: CancelToken = None,
    target: str | Path | None = None,
) -> ConvertResult:
    """Convert a Hugging Face model folder to GGUF and register it in the store.

    `outtype` is f32, f16, bf16, q8_0 or auto; None picks bf16 for a bf16 checkpoint, else f16.
    Quantized checkpoints (config.json's quantization_config: fp8, awq, gptq, compressed-tensors,
    modelopt) are dequantized exactly; "auto" writes their 4-bit layers straight into Q4_1/Q4_0
    blocks (8-bit symmetric ones into Q8_0, NVFP4/MXFP4 into NVFP4/MXFP4) where the groups allow it
    and everything else as Q8_0, and the
    result's `direct` lists each such layer with its max error against the dequantized checkpoint.
    Without `output` the file goes into the store as `<name>:<outtype>`; with it, the file is
    written there and registered as an external (not store-owned) model. `repo_id` records the
    Hub repository the folder came from; `register=False` only writes the file (the result's
    manifest is then None). `cancel` (a callable or an object with `is_set()`, e.g. a
    threading.Event) is polled between tensors and raises Cancelled. `target` is the HF folder of
    the model a drafter (EAGLE-3) drafts for: its config supplies what the drafter's does not say
    (which layers it reads, their width) and its tokenizer the vocabulary when the drafter ships
    none. A folder of Medusa heads (config.json's medusa_num_heads: FasterDecoding/Medusa) becomes
    a file of heads at `output` (required: it is not a model the store runs; convert/medusa.py).
    Raises ConversionError (one line) on bad input; on any exception, Ctrl-C included, no
    file or manifest is left behind.
    """
    t0 = time.monotonic()
    folder = Path(source_dir).expanduser()
    if not folder.is_dir():
        raise ConversionError(f"no such model folder: {folder}")
    if outtype is not None and outtype not in OUTTYPE_CHOICES:
        raise InvalidOptionError(f"unknown outtype {outtype!r}; choose one of {', '.join(OUTTYPE_CHOICES)}")
    config = _read_json(folder / "config.json", "the model's configuration")
    if is_medusa_config(config):  # heads, not a model: a file of ours, not registered (convert/medusa.py)
        if output is None:
            raise ConversionError(f"{folder.name} holds Medusa heads, which llama.cpp cannot load as a model (the "
                                  "store keeps models only): give an output file (-o HEADS.gguf)")
        out = Path(output).expanduser()
        n, n_src, outtype = convert_medusa(folder, config, outtype, out)
        return ConvertResult(out, None, MEDUSA_ARCH, outtype, n, n_src, out.stat().st_size, time.monotonic() - t0)
    arch = architecture_for(config)
    target_dir = Path(target).expanduser() if target is not None else None
    if target_dir is not None and not target_dir.is_dir():
        raise ConversionError(f"no such target model folder: {target_dir}")
    target_config = _read_json(target_dir / "config.json", "the target model's configuration") if target_dir else None
    hp = arch.hparams(config, target_config) if target_config is not None else arch.hparams(config)
    scheme = scheme_for(config, folder)
    embedding = read_embedding_spec(folder, hp.hidden)  # sentence-transformers: pooling, normalization, prompts
    has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()
    vocab = load_vocab(folder if has_tokenizer or target_dir is None else target_dir, hp.vocab_size)
    store = store or Store()
    warned: list[str] = []
    direct: list[DirectTensor] = []

    def nonfinite(msg: str) -> None:
        if msg not in warned:
            warned.append(msg)
            warnings.warn(msg, NonFiniteWeightWarning, stacklevel=2)

    with open_checkpoint(folder) as ckpt:
        ckpt, hp = adapt_checkpoint(ckpt, hp, embedding)  # a bare decoder's names; no lm_head
        if outtype is None:
            outtype = "bf16" if _source_dtype(ckpt) == "BF16" else "f16"
        if outtype == "auto":
            plans = _plan_tensors(ckpt, arch, hp, None, scheme)
            by_type: dict[QT, int] = {}
            for p in plans:
                by_type[p.qtype] = by_type.get(p.qtype, 0) + p.nbytes
            qtype = max(by_type, key=by_type.__getitem__)
            ftype = _FILE_TYPES.get(qtype, LlamaFileType.MOSTLY_Q8_0)
            tag = qtype.name.lower()  # what the file mostly is, e.g. q4_1
        else:
            qtype, ftype = OUTTYPES[outtype]
            plans = _plan_tensors(ckpt, arch, hp, qtype, scheme)
            tag = outtype
        display = _model_name(folder, config)
        store_name = normalize_name(name or display)
        target = Path(output).expanduser() if output else store.model_path(store_name, tag)
        if register and output:
            # An external file must not take over the manifest of another file (which it would orphan).
            existing = store.find(f"{store_name}:{tag}")
            if existing is not None and Path(existing.file).resolve() != target.resolve():
                raise ConversionError(
                    f"{existing.ref} is already in the store ({existing.file}); pass another --name, or remove it first"
                )
        total_out = sum(p.nbytes for p in plans)
        total_src = sum(p.source_bytes for p in plans)
        ensure_free_space(target.parent, total_out + (64 << 20), "the converted model")

        with atomic_path(target) as tmp:
            w = _Writer(tmp, arch.name)
            try:
                w.add_name(display)
                w.add_type(gguf.GGUFType.MODEL)
                if lic := _readme_license(folder):
                    w.add_license(lic)
                if repo_id:
                    w.add_source_repo_url(f"https://huggingface.co/{repo_id}")
                arch.write_metadata(w, hp)
                if embedding is not None:
                    embedding.write(w)
                w.add_file_type(ftype)
                if any(p.qtype not in (QT.F32, QT.F16, QT.BF16, QT.I64) for p in plans):
                    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
                vocab.add_to_gguf(w)
                for p in plans:
                    w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
                w.write_header_to_file()
                w.write_kv_data_to_file()
                w.write_ti_data_to_file()
                done = 0
                with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
                    for i, p in enumerate(plans, 1):
                        stream = _TensorStream(p, pool, nonfinite)
                        w.write_tensor_data(stream)  # type: ignore[arg-type]
                        if p.direct:
                            direct.append(DirectTensor(p.name, p.qtype.name, stream.max_error))
                            log.info("%s: %s straight from the %s checkpoint, max |error| %.3g vs its dequantized "
                                     "values", p.name, p.qtype.name, scheme.method if scheme else "?", stream.max_error)
                        done += p.source_bytes
                        if on_progress is not None:
                            on_progress(ConvertProgress(p.name, i, len(plans), done, total_src))
                        if is_cancelled(cancel):
                            raise Cancelled("conversion cancelled")
                w.flush()
            finally:
                w.close()
            info = read_gguf(tmp)  # validated before it gets its final name
    method = scheme.method if scheme is not None else None
    if not register:
        return ConvertResult(target, None, arch.name, outtype, len(plans), total_src, target.stat().st_size,
                             time.monotonic() - t0, tuple(warned), method, tuple(direct))
    derived = repo_id or str(folder.resolve())
    source = {"kind": "convert", "from": derived, "outtype": outtype, "architecture": arch.name}
    if embedding is not None:
        source["embedding"] = embedding.pooling
    if method is not None:
        source["quantization"] = method
    if repo_id:
        source["repo"] = repo_id
    manifest = store.register(
        target, store_name, tag, source=source, derived_from=derived, owned=output is None, info=info
    )
    return ConvertResult(
        path=target,
        manifest=manifest,
        architecture=arch.name,
        outtype=outtype,
        n_tensors=len(plans),
        source_bytes=total_src,
        output_bytes=target.stat().st_size,
        seconds=time.monotonic() - t0,
        warnings=tuple(warned),
        quantization=method,
        direct=tuple(direct),
    )
