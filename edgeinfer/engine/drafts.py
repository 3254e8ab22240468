"""The draft models of one engine: opened once each, kept between requests.

Preparing one can take long — a self-draft (a quantized copy of the target) is made by the
quantizer on first use and registered in the store — so it is an explicit step that reports
progress and can be cancelled (Engine.prepare_speculation), never hidden in a request's first
step behind the engine's lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..cancel import CancelToken, is_cancelled, raise_if_cancelled
from ..errors import Cancelled, EngineClosedError, SpeculationError
from ..gguf_file import GGUFInfo
from ..store import ModelManifest, Store
from ..validate import admit
from .events import SpeculationProgress
from .llama import LlamaRuntime
from .options import LoadOptions, SpeculationOptions
from .speculation.draft_model import DraftContext, check_draft_compatible

__all__ = ["DraftModels", "TargetModel", "ProgressCallback"]

ProgressCallback = Callable[[SpeculationProgress], None]
log = logging.getLogger(__name__)

_FULL_PRECISION = ("F32", "F16", "BF16", "ALL_F32")


@dataclass(frozen=True)
class TargetModel:
    """The facts about the target that finding or making its draft needs."""

    name: str
    path: Path
    info: GGUFInfo
    manifest: ModelManifest | None
    store: Store
    options: LoadOptions


def draft_key(spec: SpeculationOptions) -> tuple[str, str] | None:
    """Which draft model a request needs, or None (lookup, or auto without a draft model)."""
    if spec.method == "self":
        return ("self", spec.self_quant.upper())
    if spec.method in ("draft", "auto") and spec.draft_model:
        return ("draft", str(spec.draft_model))
    return None


class DraftModels:
    """Draft-model contexts by (kind, model), made ready by `prepare` and served by `context`; each
    has one sequence per slot of the engine (sequence id = slot)."""

    def __init__(self, target: TargetModel, target_runtime: LlamaRuntime, n_slots: int = 1):
        self.target = target
        self._target_rt = target_runtime
        self._n_slots = n_slots
        self._runtimes: dict[tuple[str, str], DraftContext] = {}
        self._prepare_lock = threading.Lock()  # one preparation at a time (a quantization uses every core)
        self._lock = threading.Lock()  # guards _runtimes and _closed (close() never waits for a preparation)
        self._closed = False

    def is_ready(self, spec: SpeculationOptions) -> bool:
        key = draft_key(spec)
        return key is None or key in self._runtimes

    def context(self, spec: SpeculationOptions) -> DraftContext | None:
        """The prepared draft context `spec` needs (None: it needs none, e.g. lookup)."""
        key = draft_key(spec)
        if key is None:
            return None
        if key not in self._runtimes:
            raise SpeculationError(f"the draft model for {spec.method} speculation was not prepared")
        return self._runtimes[key]

    def prepare(self, spec: SpeculationOptions, progress: ProgressCallback | None = None,
                cancel: CancelToken = None) -> None:
        """Find or make the draft model `spec` needs and open it, reporting progress."""
        key = draft_key(spec)
        if key is None:
            return
        report = progress or (lambda _event: None)
        with self._prepare_lock:
            if self._closed:
                raise EngineClosedError("this engine is closed")
            if key in self._runtimes:
                return
            raise_if_cancelled(cancel, "preparing speculation")
            if key[0] == "self":
                path, label = self._self_draft(key[1], report, cancel), f"self={key[1]}"
            else:
                path, _ = self.target.store.resolve(key[1])
                label = key[1]
            raise_if_cancelled(cancel, "preparing speculation")
            report(SpeculationProgress("load", f"loading draft model {label}"))
            rt = self._open(Path(path))
            # Under the lock: close() (which the engine calls before freeing the target) cannot
            # free the target while the check reads its vocabulary.
            with self._lock:
                try:
                    if self._closed:  # the engine closed meanwhile
                        raise EngineClosedError("this engine is closed")
                    check_draft_compatible(self._target_rt, rt, label)
                except BaseException:
                    rt.close()
                    raise
                self._runtimes[key] = DraftContext(rt, self._n_slots, "draft" if key[0] == "draft" else label)
            report(SpeculationProgress("ready", f"draft model {label} ready"))

    def _open(self, path: Path) -> LlamaRuntime:
        admit(path, self.target.store)  # validated, and loaded once in a child, like any model
        # The target's threads, batch and placement (GPU layers, RPC workers) unless draft_gpu_layers says otherwise.
        return LlamaRuntime(path, self.target.options.draft_options(n_ctx=self._target_rt.n_ctx), n_seq_max=self._n_slots)

    def _self_draft(self, quant: str, report: ProgressCallback, cancel: CancelToken) -> Path:
        """A quantized copy of the target: from the store, or made by the quantizer on first use."""
        t = self.target
        store = t.store
        if t.manifest is not None:
            for m in store.list():
                if m.name == t.manifest.name and m.tag == quant.lower() and Path(m.file).exists():
                    return Path(m.file)
            for m in store.list():
                if m.derived_from in (t.manifest.ref, str(t.path)) and (m.quant or "").upper() == quant:
                    return Path(m.file)
        from ..quantize import QuantizeProgress, quantize_model

        what = f"making the {quant} self-draft of {t.name}"
        log.info("%s (first use; it is kept in the store)", what)

        def on_tensor(p: QuantizeProgress) -> None:
            if is_cancelled(cancel):
                raise Cancelled("preparing speculation")  # quantize stops after the C call and cleans up
            report(SpeculationProgress("quantize", what, p.tensor_index, p.n_tensors))

        report(SpeculationProgress("quantize", what, 0, len(t.info.tensors)))
        source = t.manifest.ref if t.manifest is not None else str(t.path)
        already_quantized = (t.info.file_type or "F16").upper() not in _FULL_PRECISION
        result = quantize_model(source, quant, store=store, allow_requantize=already_quantized, on_progress=on_tensor)
        return Path(result.manifest.file)

    def close(self) -> None:
        """Free every draft runtime; a preparation still running frees what it opens."""
        with self._lock:
            self._closed = True
            for context in self._runtimes.values():
                context.runtime.close()
            self._runtimes.clear()
