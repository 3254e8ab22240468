"""The draft models and drafting heads of one engine: opened once each, kept between requests.

Preparing one can take long — a self-draft (a quantized copy of the target) is made by the
quantizer on first use and registered in the store — so it is an explicit step that reports
progress and can be cancelled (Engine.prepare_speculation), never hidden in a request's first
step behind the engine's lock.

A head (mtp, eagle3=MODEL, medusa=HEADS; speculation/heads.py, medusa.py) links a context to the target's and switches
on the target's hand-over of hidden states, and a hybrid target (Qwen3.5: Gated DeltaNet layers)
needs its context made again with rollback snapshots before anything can be drafted on it: both
only while nothing else uses the target's context (`exclusive`), so a BatchEngine chooses its
head when it is made.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...cancel import CancelToken, is_cancelled, raise_if_cancelled
from ...errors import Cancelled, EngineClosedError, SpeculationError
from ...gguf_file import GGUFInfo
from ...store import ModelManifest, Store
from ...validate import admit
from ..core.events import SpeculationProgress
from ..llama.runtime import LlamaRuntime
from ..core.options import HEAD_METHODS, LoadOptions, SpeculationOptions
from ..speculation.draft_model import DraftContext, check_draft_compatible
from ..speculation.head_models import auto_head_key, open_eagle3_head, open_mtp_head
from ..speculation.heads import ROLLBACK_DEPTH, HeadContext
from ..speculation.medusa import open_medusa_heads

__all__ = ["DraftModels", "TargetModel", "ProgressCallback", "draft_key", "Exclusive"]

ProgressCallback = Callable[[SpeculationProgress], None]
# Holds the target's context for the caller alone while it is made again or linked to a head.
Exclusive = Callable[[], contextlib.AbstractContextManager[Any]]
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
    """Which draft model or head a request needs, or None (lookup, or auto without a draft model:
    auto then drafts with the engine's head, if it has one)."""
    if spec.method == "self":
        return ("self", spec.self_quant.upper())
    if spec.method in ("draft", "auto") and spec.draft_model:
        return ("draft", str(spec.draft_model))
    if spec.method == "mtp":
        return ("mtp", "")
    if spec.method in ("eagle3", "medusa"):
        return (spec.method, str(spec.draft_model))
    return None


class DraftModels:
    """Draft-model contexts by (kind, model), made ready by `prepare` and served by `context`; each
    has one sequence per slot of the engine (sequence id = slot)."""

    def __init__(self, target: TargetModel, target_runtime: LlamaRuntime, n_slots: int = 1):
        self.target = target
        self._target_rt = target_runtime
        self._n_slots = n_slots
        self._runtimes: dict[tuple[str, str], DraftContext] = {}
        self._heads: dict[tuple[str, str], HeadContext] = {}
        self._no_rollback = False  # a recurrent target whose architecture keeps no snapshots
        self._prepare_lock = threading.Lock()  # one preparation at a time (a quantization uses every core)
        self._lock = threading.Lock()  # guards _runtimes and _closed (close() never waits for a preparation)
        self._closed = False

    def _key(self, spec: SpeculationOptions) -> tuple[str, str] | None:
        """draft_key, and for auto without a draft model the head this model has (mtp), if any."""
        key = draft_key(spec)
        if key is None and spec.method == "auto":
            return next(iter(self._heads), None) or auto_head_key(self.target.info, self._target_rt)
        return key

    def _needs_rollback(self, spec: SpeculationOptions) -> bool:
        rt = self._target_rt
        return spec.method != "off" and rt.facts.recurrent and rt.n_rs_seq == 0 and not self._no_rollback

    def is_ready(self, spec: SpeculationOptions) -> bool:
        key = self._key(spec)
        return (key is None or key in self._runtimes or key in self._heads) and not self._needs_rollback(spec)

    def heads(self) -> list[HeadContext]:
        """The prepared heads (each sees every target decode: the scheduler hands them the rows)."""
        return list(self._heads.values())

    def context(self, spec: SpeculationOptions) -> DraftContext | HeadContext | None:
        """The prepared draft context or head `spec` needs (None: it needs none, e.g. lookup; auto
        without a draft model: the engine's head, or none)."""
        key = draft_key(spec)
        if key is None:
            return self._heads.get(self._key(spec)) if spec.method == "auto" else None  # type: ignore[arg-type]
        if key in self._heads:
            return self._heads[key]
        if key not in self._runtimes:
            what = "drafting head" if key[0] in HEAD_METHODS else "draft model"
            raise SpeculationError(f"the {what} for {spec.method} speculation was not prepared")
        return self._runtimes[key]

    def prepare(self, spec: SpeculationOptions, progress: ProgressCallback | None = None,
                cancel: CancelToken = None, exclusive: Exclusive | None = None) -> None:
        """Find or make the draft model or head `spec` needs and open it, reporting progress.
        `exclusive`: how to hold the target's context alone (None: it is in use; then a head or
        a hybrid target's rollback cannot be prepared any more)."""
        report = progress or (lambda _event: None)
        with self._prepare_lock:
            if self._closed:
                raise EngineClosedError("this engine is closed")
            if self._needs_rollback(spec) or (self._key(spec) or ("",))[0] in HEAD_METHODS:
                self._prepare_head(spec, report, exclusive)
            key = draft_key(spec)
            if key is None or key[0] in HEAD_METHODS or key in self._runtimes:
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

    def _prepare_head(self, spec: SpeculationOptions, report: ProgressCallback, exclusive: Exclusive | None) -> None:
        """Rollback snapshots for a hybrid target, then the head `spec` drafts with (if any)."""
        key = self._key(spec)
        if not self._needs_rollback(spec) and (key is None or key in self._heads):
            return
        if exclusive is None:
            raise SpeculationError(f"speculation {spec.method!r} on {self.target.name} must be chosen when the engine "
                                   "is made (BatchEngine(..., speculation=...), serve --speculate): it changes the "
                                   "model's context")
        rt = self._target_rt
        head: HeadContext | None = None
        with exclusive():
            if self._needs_rollback(spec):
                report(SpeculationProgress("load", f"{self.target.name}: keeping {ROLLBACK_DEPTH} rollback snapshots"))
                if not rt.enable_rollback(ROLLBACK_DEPTH):
                    self._no_rollback = True
                    log.warning("%s: its recurrent memory keeps no rollback snapshots: speculation stays off",
                                self.target.name)
                for h in self._heads.values():  # linked to the context that was replaced
                    h.close()
                self._heads.clear()
            if key is not None and key[0] in HEAD_METHODS and key not in self._heads:
                report(SpeculationProgress("load", f"opening the {key[0]} head"))
                if key[0] == "mtp":
                    head = open_mtp_head(self.target.name, self.target.info, rt, self._n_slots)
                elif key[0] == "medusa":  # not a model llama.cpp loads: read and checked by us
                    path, _ = self.target.store.resolve(key[1])
                    head = open_medusa_heads(self.target.name, self.target.info, rt, Path(path), self._n_slots)
                else:
                    path, _ = self.target.store.resolve(key[1])
                    info = admit(path, self.target.store)  # validated, and loaded once in a child
                    head = open_eagle3_head(self.target.name, self.target.info, rt, Path(path), info, self._n_slots,
                                            self.target.options.draft_options(n_ctx=rt.n_ctx))
                with self._lock:
                    if self._closed:
                        head.close()
                        raise EngineClosedError("this engine is closed")
                    self._heads[key] = head
        if head is not None:
            report(SpeculationProgress("ready", f"{key[0]} head ready"))  # type: ignore[index]

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
        sources = (t.manifest.ref, str(t.path)) if t.manifest is not None else (str(t.path),)
        for m in store.list():  # (a target given by path: its copy made by an earlier engine)
            if m.derived_from in sources and (m.quant or "").upper() == quant and Path(m.file).exists():
                return Path(m.file)
        from ...quantize import QuantizeProgress, quantize_model

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

    def forget_cached(self) -> None:
        """Empty every draft model's sequences (Engine.reset: the next request reads its prompt anew
        in the draft model too). Call with the target's slot held."""
        with self._lock:
            for context in self._runtimes.values():
                for seq in context.seqs:
                    seq.clear()

    def close(self) -> None:
        """Free every draft runtime; a preparation still running frees what it opens."""
        with self._lock:
            self._closed = True
            for head in self._heads.values():  # before the target they are linked to
                head.close()
            self._heads.clear()
            for context in self._runtimes.values():
                context.runtime.close()
            self._runtimes.clear()
