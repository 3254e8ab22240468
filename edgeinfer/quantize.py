"""Quantization through llama.cpp's own quantizer (`llama_model_quantize`, via llama-cpp-python's ctypes).

    result = quantize_model("smollm2-135m-instruct:f16", "Q4_K_M")
    result.manifest.ref, result.bits_per_weight, result.fallbacks

The output is written under a temporary name inside the store, validated with `read_gguf`, renamed,
then registered with `derived_from` = the source. The C call cannot be interrupted, so it runs in a
child process (`quantize_child.py`): a cancel, a Ctrl-C or a failing progress callback kills it at
once and the partial file is deleted, so an interrupted or failed run leaves neither a store entry
nor a stray file (and a run killed from outside leaves a partial file that `gc` removes).

There is no progress callback in llama.cpp; it logs one line per tensor, which the child writes to
its stdout and the parent parses into QuantizeProgress events (and the `edgeinfer.llama_cpp` logger).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .cancel import CancelToken, raise_if_cancelled
from .errors import InvalidOptionError, QuantizationError, StoreError
from .fsutil import atomic_path, ensure_free_space, no_space_error
from .gguf_file import GGUFInfo, read_gguf
from .llama_backend import LOGGER_NAME, backend, check_threads
from .quant_types import QUANT_TYPES, TENSOR_TYPES, TYPE_RECIPES
from .validate import validate_file

if TYPE_CHECKING:
    from .profiles import QuantProfile
    from .store import ModelManifest, Store

__all__ = [
    "QUANT_TYPES",
    "TENSOR_TYPES",
    "QuantizeProgress",
    "Fallback",
    "QuantizeResult",
    "quantize_model",
    "available_quant_types",
    "find_fallbacks",
    "default_tag",
    "PARAMS_SIZE",
]

# sizeof(llama_model_quantize_params) in llama-cpp-python 0.3.36 on 64-bit: 4 ints, 6 bools + pad,
# 4 pointers, one size_t. The struct is passed by pointer but built from the by-value default.
PARAMS_SIZE = 64
_PINNED_BINDING = "0.3.36"

_QUANTIZE_LOCK = threading.Lock()
_FULL_DISK_SLACK = 8 << 20  # a failed write with less free than this was a full disk
_TENSOR_RE = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)\s+-\s+\[[^\]]*\],\s*type\s*=\s*(\w+)")
_CONVERT_RE = re.compile(r"converting to (\w+)")


@dataclass(frozen=True)
class QuantizeProgress:
    """One tensor finished: `tensor_index` counts from 1 to `n_tensors`."""

    tensor_index: int
    n_tensors: int
    tensor_name: str
    type_name: str  # the type it was written in


@dataclass(frozen=True)
class Fallback:
    """A tensor that could not take the requested type because of its shape."""

    tensor: str
    shape: tuple[int, ...]
    requested: str  # ggml type the recipe asked for
    got: str  # ggml type actually in the file
    reason: str


@dataclass(frozen=True)
class QuantizeResult:
    manifest: ModelManifest
    path: Path
    qtype: str
    bits_per_weight: float  # effective, over every tensor of the output file
    size: int
    fallbacks: tuple[Fallback, ...]
    type_counts: dict[str, int]  # tensors per ggml type in the output
    type_bytes: dict[str, int]
    seconds: float
    requantized: bool  # the source held quantized weights (quality is lost twice)
    source: str  # store ref or path of the source
    log_tail: tuple[str, ...] = field(default=(), repr=False)

    @property
    def ref(self) -> str:
        return self.manifest.ref


def _binding() -> Any:
    llama_cpp = backend()

    version = getattr(llama_cpp, "__version__", "?")
    size = ctypes.sizeof(llama_cpp.llama_model_quantize_params)
    if size != PARAMS_SIZE or version != _PINNED_BINDING:
        raise QuantizationError(
            f"llama-cpp-python {version} has a llama_model_quantize_params of {size} bytes; edgeinfer "
            f"was built against {_PINNED_BINDING} ({PARAMS_SIZE} bytes) — reinstall llama-cpp-python=={_PINNED_BINDING}"
        )
    return llama_cpp


def available_quant_types() -> tuple[str, ...]:
    """The quant types the installed llama.cpp has (an LLAMA_FTYPE_MOSTLY_* constant for each)."""
    llama_cpp = _binding()
    out = []
    for name, (ftype, _) in QUANT_TYPES.items():
        # (the file type implies its ggml types; the binding does not name them all: GGML_TYPE_BF16)
        const = {"F32": "LLAMA_FTYPE_ALL_F32", "MXFP4": "LLAMA_FTYPE_MOSTLY_MXFP4_MOE"}.get(name, f"LLAMA_FTYPE_MOSTLY_{name}")
        if getattr(llama_cpp, const, None) == ftype:
            out.append(name)
    return tuple(out)


def _ggml_type_id(name: str) -> int:
    from gguf.constants import GGMLQuantizationType

    return int(GGMLQuantizationType[name])


def _block_size(type_name: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]


def _check_tensor_type(what: str, value: str | None) -> str | None:
    if value is None:
        return None
    up = value.upper()
    if up not in TENSOR_TYPES:
        raise InvalidOptionError(f"unknown {what} type {value!r}: choose one of {', '.join(TENSOR_TYPES)}")
    return up


def _requested_type(name: str, base: str, output_type: str | None, embedding_type: str | None,
                    overrides: Sequence[tuple[str, str]]) -> str:
    for pattern, t in overrides:
        if re.search(pattern, name):
            return t
    if name == "output.weight" and output_type:
        return output_type
    if name == "token_embd.weight" and embedding_type:
        return embedding_type
    return base


def find_fallbacks(
    info: GGUFInfo,
    qtype: str,
    *,
    output_type: str | None = None,
    embedding_type: str | None = None,
    overrides: Sequence[tuple[str, str]] = (),
) -> tuple[Fallback, ...]:
    """Tensors of a quantized file that did not get the requested type because their rows do not fit.

    Computed from the file: a weight matrix whose row length is not a multiple of the requested
    type's block (256 for k-quants) and whose type differs from it. 1-D tensors (norms) are kept
    in F32 by design and are not fallbacks.
    """
    base = QUANT_TYPES[qtype.upper()][1]
    out = []
    for t in info.tensors:
        if len(t.shape) < 2:
            continue
        want = _requested_type(t.name, base, output_type, embedding_type, overrides)
        block = _block_size(want)
        if t.type_name != want and t.shape[0] % block:
            out.append(Fallback(t.name, t.shape, want, t.type_name,
                                f"row length {t.shape[0]} is not a multiple of {want}'s block of {block}"))
    return tuple(out)


def default_tag(qtype: str, profile: QuantProfile | None = None, *, custom: bool = False,
                imatrix: bool | str = False) -> str:
    """`q4_k_m`; a profile that changes more than the weights type adds its name (`q2_k-tiny`); an
    importance matrix given as a file adds `-imat` (`imatrix` True or "file"), none where the type
    would use the store's adds `-noimat` ("none"); the store's own (the default) adds nothing."""
    tag = qtype.lower()
    if profile is not None and (profile.output_type or profile.embedding_type or profile.overrides):
        tag += f"-{profile.name}"
    elif custom:
        tag += "-custom"
    if imatrix is True or imatrix == "file":
        tag += "-imat"
    elif imatrix == "none":
        tag += "-noimat"
    return tag


_QUANT_SUFFIX = re.compile(r"[-_.](f32|f16|bf16|q\d(_k)?(_[0-9a-z]+)?|iq\d_[a-z]+)$", re.IGNORECASE)


def _source_name(path: Path, manifest: ModelManifest | None) -> str:
    from .store import normalize_name

    if manifest is not None:
        return manifest.name
    return normalize_name(_QUANT_SUFFIX.sub("", path.stem))


_llama_log = logging.getLogger(LOGGER_NAME)


class _LogCapture:
    """Parse llama.cpp's per-tensor log lines into QuantizeProgress events while a block runs."""

    def __init__(self, on_progress: Callable[[QuantizeProgress], None] | None):
        self.on_progress = on_progress
        self.lines: list[str] = []
        self._buf = ""
        self._current: tuple[int, int, str, str] | None = None
        self.converted: dict[str, str] = {}
        self.callback_error: BaseException | None = None
        self._lock = threading.Lock()

    def feed(self, level: int, text: str) -> None:
        if self.callback_error is not None:
            return
        try:
            with self._lock:
                self._buf += text
                # a tensor's record arrives in fragments ("[ 3/30] name - [..], type = f16, ",
                # "converting to q4_K .. ", "size = ... MiB\n"): parse complete lines only
                while "\n" in self._buf:
                    line, self._buf = self._buf.split("\n", 1)
                    self._line(line)
        except BaseException as e:  # never let an exception reach C
            self.callback_error = e

    def _line(self, line: str) -> None:
        if not line.strip():
            return
        _llama_log.debug(line)
        self.lines.append(line)
        del self.lines[:-200]
        m = _TENSOR_RE.search(line)
        if m is not None:
            self._current = (int(m.group(1)), int(m.group(2)), m.group(3), m.group(4).upper())
        c = _CONVERT_RE.search(line)
        if c and self._current is not None:
            self.converted[self._current[2]] = c.group(1).upper()
        if "size =" in line and self._current is not None:
            i, n, name, old = self._current
            self._current = None
            if self.on_progress is not None:
                self.on_progress(QuantizeProgress(i, n, name, self.converted.get(name, old)))

    def error_message(self) -> str:
        for line in reversed(self.lines):
            if "failed to quantize" in line:
                return line.split("failed to quantize:", 1)[-1].strip()
        for line in reversed(self.lines):
            if "error" in line.lower():
                return line.strip()
        return "llama_model_quantize returned an error"


def _disk_full(path: Path) -> bool:
    """Whether the file system of `path` is (nearly) full: the cause of a write that failed."""
    try:
        return shutil.disk_usage(path.parent).free < _FULL_DISK_SLACK
    except OSError:
        return False


def _run_child(request: dict[str, Any], capture: _LogCapture, cancel: CancelToken) -> int:
    """Run llama_model_quantize in a child process (quantize_child.py), feeding its log to `capture`.

    A cancel, a Ctrl-C or a progress callback that raised kills the child at once (the caller's
    atomic_path then deletes the partial output); otherwise returns the C call's return code.
    """
    script = Path(__file__).with_name("quantize_child.py")
    proc = subprocess.Popen([sys.executable, "-I", str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reader = threading.Thread(target=_pump, args=(proc, capture), name="edgeinfer-quantize-log", daemon=True)
    reader.start()
    try:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(json.dumps(request).encode())
            proc.stdin.close()
        while True:
            try:
                rc = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                if capture.callback_error is not None:
                    raise capture.callback_error from None
                raise_if_cancelled(cancel, "quantization cancelled")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join()
    return rc


def _pump(proc: subprocess.Popen[bytes], capture: _LogCapture) -> None:
    assert proc.stdout is not None
    with proc.stdout:
        while chunk := proc.stdout.read1(65536):
            capture.feed(0, chunk.decode("utf-8", errors="replace"))


def _read_imatrix(path: Path, src_info: GGUFInfo, src_ref: str) -> Any:
    from .imatrix import read_imatrix

    imat = read_imatrix(path)
    weight_names = {t.name.removesuffix(".weight") for t in src_info.tensors} | {t.name for t in src_info.tensors}
    if not any(k in weight_names or k.removesuffix(".weight") in weight_names for k in imat.entries):
        raise QuantizationError(f"{Path(path).name} has no entry for any tensor of {src_ref} (another model's imatrix?)")
    return imat


def quantize_model(
    source: str | Path,
    qtype: str | None = None,
    *,
    store: Store | None = None,
    profile: QuantProfile | str | None = None,
    output_type: str | None = None,
    embedding_type: str | None = None,
    overrides: Iterable[tuple[str, str]] = (),
    imatrix: str | Path | None = "auto",
    allow_requantize: bool = False,
    name: str | None = None,
    tag: str | None = None,
    overwrite: bool = False,
    on_progress: Callable[[QuantizeProgress], None] | None = None,
    n_threads: int | None = None,
    cancel: CancelToken = None,
) -> QuantizeResult:
    """Quantize `source` (store ref or GGUF path) to `qtype` (or the profile's weights type).

    Explicit `output_type` / `embedding_type` / `overrides` add to (and win over) the profile's.
    `imatrix`: an importance matrix file, None for none, or "auto": the one kept with the source in
    the store (`edgeinfer imatrix`) for the types that use one, computed first on the shipped
    calibration text for the types that need one (IQ1/IQ2/IQ3_XXS/IQ3_XS; imatrix_compute).
    A source that already holds quantized weights needs `allow_requantize=True` (warned about).
    `cancel` (a threading.Event or a callable, see edgeinfer.cancel) stops the quantizer at once
    with `Cancelled`, as Ctrl-C does; nothing is left behind either way.
    """
    from .store import DEFAULT_MODEL, Store

    store = store or Store()
    if isinstance(profile, str):
        from .profiles import get_profile

        profile = get_profile(profile)
    if qtype is None:
        if profile is None:
            raise InvalidOptionError("give a quant type or a profile")
        qtype = profile.weights
    qtype = qtype.upper()
    if qtype not in QUANT_TYPES:
        raise InvalidOptionError(f"unknown quant type {qtype!r}: choose one of {', '.join(QUANT_TYPES)}")
    nthread = check_threads(n_threads)
    custom = bool(output_type or embedding_type or tuple(overrides))
    out_t = _check_tensor_type("output tensor", output_type or (profile.output_type if profile else None))
    emb_t = _check_tensor_type("token embedding", embedding_type or (profile.embedding_type if profile else None))
    ovr: list[tuple[str, str]] = []
    for pattern, t in list(overrides) + list(profile.overrides if profile else ()):
        try:
            re.compile(pattern)
        except re.error as e:
            raise InvalidOptionError(f"tensor override pattern {pattern!r} is not a valid regex: {e}") from None
        ovr.append((pattern, _check_tensor_type(f"override {pattern!r}", t) or ""))

    llama_cpp = _binding()
    if qtype not in available_quant_types():
        raise QuantizationError(f"the installed llama.cpp cannot quantize to {qtype}")

    src_path, src_manifest = store.resolve(source)
    src_info = validate_file(src_path, store)  # a source read before is not walked again (the store remembers)
    src_ref = src_manifest.ref if src_manifest else str(Path(src_path).resolve())
    quantized_src = sorted({t.type_name for t in src_info.tensors
                            if len(t.shape) >= 2 and t.type_name not in ("F32", "F16", "BF16")})
    # F32/F16/BF16 from a quantized file only dequantizes (F32 exactly, F16 up to its rounding): no flag
    dequantize = qtype in ("F16", "BF16", "F32")
    if quantized_src and not dequantize:
        if not allow_requantize:
            raise QuantizationError(
                f"{src_ref} already holds quantized weights ({', '.join(quantized_src)}), so {qtype} would "
                f"compound the error; next: quantize from an F16 model (`edgeinfer quantize {src_ref} --type F16`, "
                "or convert/pull the original weights), or pass --allow-requantize"
            )
        warnings.warn(
            f"requantizing {src_ref} ({', '.join(quantized_src)} -> {qtype}): the result is worse than "
            "quantizing the full-precision model",
            stacklevel=2,
        )

    from .imatrix_compute import compute_imatrix, imatrix_for_quantize

    imatrix, imatrix_kind = imatrix_for_quantize(imatrix, qtype, src_manifest)
    imat = _read_imatrix(imatrix, src_info, src_ref) if imatrix is not None else None

    out_name = name or _source_name(src_path, src_manifest)
    out_tag = tag or default_tag(qtype, profile, custom=custom, imatrix=imatrix_kind)
    if f"{out_name}:{out_tag}" == DEFAULT_MODEL:
        raise StoreError(f"{DEFAULT_MODEL} is the default model's name; choose another --name or --tag")
    target = store.model_path(out_name, out_tag)
    if store.find(f"{out_name}:{out_tag}") is not None and not overwrite:
        raise StoreError(f"{out_name}:{out_tag} is already in the store (remove it first, or choose another --name)")
    if target.exists() and Path(src_path).resolve() == target.resolve():
        raise InvalidOptionError(f"the output would overwrite the source {src_ref}")
    # generous: no type here takes more than F32's 4 bytes per weight, most far less
    bytes_per_weight = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 1.07}.get(qtype, 0.85)
    ensure_free_space(target.parent, int(src_info.parameter_count * bytes_per_weight) + (64 << 20),
                      f"the {qtype} copy of {src_ref}")

    request: dict[str, Any] = {
        "parent_pid": os.getpid(), "source": str(src_path), "nthread": nthread, "ftype": QUANT_TYPES[qtype][0],
        "allow_requantize": bool(allow_requantize or (quantized_src and dequantize)),
        "output_tensor_type": _ggml_type_id(out_t) if out_t else None,
        "token_embedding_type": _ggml_type_id(emb_t) if emb_t else None,
        "overrides": [[pattern, _ggml_type_id(t)] for pattern, t in ovr],
    }
    if qtype in TYPE_RECIPES:  # a base ftype llama.cpp knows, the type by override, the file type written over
        request["ftype"], pattern = TYPE_RECIPES[qtype]
        request["overrides"].append([pattern, _ggml_type_id(QUANT_TYPES[qtype][1])])
        request["file_type"] = QUANT_TYPES[qtype][0]

    if imatrix_kind == "store" and imatrix is None:  # the type needs one and none is kept yet: make it now
        assert src_manifest is not None
        imatrix = compute_imatrix(src_manifest.ref, store=store, n_threads=n_threads, cancel=cancel).path
        imat = _read_imatrix(imatrix, src_info, src_ref)

    # The whole produce-and-register holds the name's writer lock: a second writer of the same
    # name (another process or thread) fails at once instead of both "succeeding".
    with store.writing(out_name, out_tag):
        if store.find(f"{out_name}:{out_tag}") is not None and not overwrite:
            raise StoreError(f"{out_name}:{out_tag} is already in the store (remove it first, or choose another --name)")
        capture = _LogCapture(on_progress)
        started = time.monotonic()
        # One quantization at a time per process: the log sink is process-wide, and llama.cpp already
        # uses every core for one.
        with _QUANTIZE_LOCK, atomic_path(target) as tmp, tempfile.TemporaryDirectory(prefix="edgeinfer-q-") as scratch:
            if imat is not None:  # the child reads the importance matrix from a plain .npz
                request["imatrix"] = str(Path(scratch) / "imatrix.npz")
                np.savez(request["imatrix"], **imat.entries)
            rc = _run_child({**request, "output": str(tmp)}, capture, cancel)
            if capture.callback_error is not None:  # a front end's progress callback raised: give up cleanly
                raise capture.callback_error
            if rc != 0:
                if _disk_full(tmp):  # llama.cpp says only "basic_ios::clear: iostream error"
                    raise no_space_error(target)
                raise QuantizationError(f"quantizing {src_ref} to {qtype} failed: {capture.error_message()}")
            checked = read_gguf(tmp)  # validate before the file takes its final name
            seconds = time.monotonic() - started
        info = dataclasses.replace(checked, path=Path(target))  # the file just validated, renamed
        try:
            manifest = store.register(
                target, out_name, out_tag,
                source={"kind": "quantize", "qtype": qtype, "profile": profile.name if profile else None,
                        "kv_type": profile.kv_type if profile else None,
                        "output_type": out_t, "embedding_type": emb_t, "overrides": [list(o) for o in ovr],
                        "imatrix": str(imatrix) if imatrix else None, "imatrix_from": imatrix_kind or None,
                        "requantized": bool(quantized_src)},
                derived_from=src_ref, owned=True, info=info,
            )
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            raise
        return QuantizeResult(
            manifest=manifest,
            path=target,
            qtype=qtype,
            bits_per_weight=info.bits_per_weight,
            size=target.stat().st_size,
            fallbacks=find_fallbacks(info, qtype, output_type=out_t, embedding_type=emb_t, overrides=ovr),
            type_counts=info.type_counts(),
            type_bytes=info.type_bytes(),
            seconds=seconds,
            requantized=bool(quantized_src),
            source=src_ref,
            log_tail=tuple(capture.lines[-20:]),
        )
