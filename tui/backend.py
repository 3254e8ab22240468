"""The small interface the UI talks to: list models, load one, chat, run a manage task.

`LibraryBackend` is the real one, on edgeinfer's public API. Tests pass a backend whose engine is
scripted (deterministic tokens at an adjustable speed) so the UI's flows can be checked exactly;
the UI never knows the difference.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import edgeinfer
from edgeinfer import DownloadProgress, PullPlan, PullStage, pull
from edgeinfer.convert import ConvertProgress, convert_model
from edgeinfer.evaluate import EvalProgress, evaluate
from edgeinfer.fit import FitReport, available_memory, fit
from edgeinfer.hub import DEFAULT_QUANT
from edgeinfer.imatrix_compute import ImatrixProgress, compute_imatrix
from edgeinfer.quantize import QuantizeProgress, quantize_model
from edgeinfer.tune import ProfileStatus, text_plot

__all__ = [
    "ModelEntry",
    "LoadedModel",
    "GenerationLike",
    "EngineLike",
    "Backend",
    "LibraryBackend",
    "TASK_KINDS",
    "CANCELLABLE_TASKS",
    "entry_from_manifest",
    "TaskProgress",
    "progress_from_event",
    "one_line",
]

TASK_KINDS: tuple[str, ...] = ("pull", "import", "convert", "quantize", "imatrix", "evaluate")
# Tasks whose library call takes a cancel token (the others run to the end once started).
CANCELLABLE_TASKS: frozenset[str] = frozenset({"pull", "import", "convert", "quantize", "imatrix"})


def one_line(e: BaseException) -> str:
    """An error as the UI shows it: the first line of its message (the library's errors are one
    line already), or its type when it has none."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@dataclass(frozen=True)
class ModelEntry:
    """One row of the model picker."""

    ref: str
    quant: str | None = None
    size: int = 0
    bits_per_weight: float | None = None
    kld: float | None = None
    same_top: float | None = None  # percent
    ppl: float | None = None
    tok_s: float | None = None
    fits: bool | None = None  # at the chat's context and KV-cache types
    name: str = ""
    derived_from: str | None = None
    # edgeinfer.fit's KV-cache bytes at n_ctx tokens: for the chat's (K, V) types, and for every
    # type (K = V) so the picker shows what quantizing the cache saves. Empty: the file is unreadable.
    n_ctx: int | None = None
    kv_types: tuple[str, str] | None = None
    kv_cache: int | None = None
    kv_by_type: dict[str, int] = field(default_factory=dict)
    # its tuned profile (`edgeinfer tune`) in text: the choice, and the frontier as a character plot
    tuned: str | None = None


def _number(section: object, key: str) -> float | None:
    """metrics[kind][key] when it is a number (manifests are JSON written by older versions too)."""
    if not isinstance(section, dict):
        return None
    v = section.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def entry_from_manifest(
    m: edgeinfer.ModelManifest,
    *,
    store: edgeinfer.Store | None = None,
    available: int | None = None,
    n_ctx: int | None = None,
    kv_types: tuple[str, str] | None = None,
) -> ModelEntry:
    """A picker row: the manifest's facts, the metrics `evaluate` and `bench` saved in it
    (metrics["eval"]: EvalResult.to_metrics(), metrics["bench"]: BenchResult.to_metrics()), and
    edgeinfer.fit's estimate at `n_ctx` tokens (None: the engine's default context) with the
    `kv_types` (K, V) cache: whether it fits in `available` bytes of RAM, and the KV-cache bytes."""
    ev = m.metrics.get("eval")
    same_top = _number(ev, "same_top")  # a fraction
    k, v = kv_types or edgeinfer.DEFAULT_LOAD.kv_types
    try:
        report: FitReport | None = fit(m.ref, n_ctx, store=store, available=available, kv_type_k=k, kv_type_v=v)
    except (edgeinfer.EdgeInferError, OSError):  # an estimate is a hint: an unreadable file leaves it unknown
        report = None
    status = edgeinfer.tuned_status(store or edgeinfer.Store(), m)
    return ModelEntry(
        ref=m.ref,
        name=m.name,
        quant=m.quant,
        size=m.size,
        bits_per_weight=m.bits_per_weight,
        kld=_number(ev, "kld"),
        same_top=None if same_top is None else same_top * 100.0,
        ppl=_number(ev, "ppl"),
        tok_s=_number(m.metrics.get("bench"), "decode_tok_s"),
        fits=None if report is None else report.fits,
        derived_from=m.derived_from,
        n_ctx=None if report is None else report.estimate.n_ctx,
        kv_types=(k, v),
        kv_cache=None if report is None else report.estimate.kv_cache,
        kv_by_type={} if report is None else dict(report.kv_by_type),
        tuned=tuned_text(status),
    )


def tuned_text(status: ProfileStatus) -> str | None:
    """A tuned profile as the model screen shows it: what runs, then the frontier in characters
    (a terminal cannot show the SVG `tune` writes)."""
    p = status.profile
    if p is None:
        return None
    used = "" if status.usable else f"\nnot used: {status.reason}"
    return f"tuned: {p.summary()}{used}\n{text_plot(p.rows, max_kld=p.max_kld)}"


@dataclass(frozen=True)
class TaskProgress:
    """Progress of a manage task, whatever library event it came from. `key` names one bar
    (a file being downloaded, or the whole job); `message` is a line of status with no bar."""

    key: str
    label: str
    done: float
    total: float | None
    message: str | None = None


def _rate(bytes_per_s: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if bytes_per_s < 1000 or unit == "GB":
            return f"{bytes_per_s:.0f} {unit}/s" if unit == "B" else f"{bytes_per_s:.1f} {unit}/s"
        bytes_per_s /= 1000
    return ""


def progress_from_event(ev: object, default_key: str = "task") -> TaskProgress:
    """The library's progress events as bars: one per file of a pull, one per task for convert and
    quantize (per tensor), one for an importance matrix (per chunk), one per model for evaluate (per
    chunk); the pull's plan and stages are
    status lines. A download's rate shows once it is known."""
    match ev:
        case DownloadProgress(file=name, done=done, total=total, status=status, rate=rate):
            label = f"{name} {status}"
            if status == "downloading" and rate > 0:
                label += f" {_rate(rate)}"
            return TaskProgress(key=name, label=label, done=float(done), total=float(total) or None)
        case QuantizeProgress():
            return TaskProgress(
                key=default_key, label=f"{ev.tensor_name} → {ev.type_name}", done=ev.tensor_index, total=ev.n_tensors
            )
        case ConvertProgress():
            return TaskProgress(key=default_key, label=ev.tensor, done=ev.index, total=ev.count)
        case ImatrixProgress():
            return TaskProgress(key=default_key, label=f"chunk {ev.chunk}/{ev.n_chunks}", done=ev.chunk, total=ev.n_chunks)
        case EvalProgress():
            label = f"{ev.model} chunk {ev.chunk}/{ev.n_chunks}"
            return TaskProgress(key=f"{default_key}-{ev.model}", label=label, done=ev.chunk, total=ev.n_chunks)
        case edgeinfer.ImportProgress(done=done, total=total):
            return TaskProgress(key=default_key, label="copying", done=float(done), total=float(total) or None)
        case PullPlan():
            msg = f"{ev.repo} @ {ev.commit[:10]}: {ev.kind} {ev.quant}, {ev.total_bytes / 1e6:.1f} MB to fetch"
            return TaskProgress(key=default_key, label="", done=0, total=None, message=msg)
        case PullStage():
            return TaskProgress(key=default_key, label="", done=0, total=None, message=ev.message)
    return TaskProgress(key=default_key, label="", done=0, total=None, message=str(ev)[:200])


class GenerationLike(Protocol):
    stats: edgeinfer.GenerationStats

    def __iter__(self) -> Iterator[edgeinfer.Event]: ...

    def cancel(self) -> None: ...


class EngineLike(Protocol):
    def chat(self, messages: list[dict[str, Any]], options: edgeinfer.GenerateOptions | None = None, *,
             tools: Sequence[Mapping[str, Any]] | None = None) -> GenerationLike:
        """With `tools` the model may call them: ToolCallEvents, and DoneEvent.tool_calls."""
        ...

    def prepare_speculation(
        self,
        speculation: edgeinfer.SpeculationOptions,
        *,
        progress: Callable[[edgeinfer.SpeculationProgress], None] | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> None: ...

    def close(self) -> None: ...


@dataclass
class LoadedModel:
    ref: str
    engine: EngineLike


class Backend(Protocol):
    # What `edgeinfer chat` asked for (context, threads); the model host sets the chat's KV-cache
    # types on it for every load. None: the library's defaults.
    load_options: edgeinfer.LoadOptions | None

    def default_ref(self) -> str: ...

    def list_models(self, kv_types: tuple[str, str] | None = None) -> list[ModelEntry]: ...

    def load(self, ref: str | None, options: edgeinfer.LoadOptions | None = None) -> LoadedModel: ...

    def remove_model(self, ref: str) -> None: ...

    def run_task(
        self, kind: str, args: dict[str, str], on_progress: Callable[[TaskProgress], None], cancel: threading.Event
    ) -> str: ...


class LibraryBackend:
    """The real backend: the store's models, loaded by edgeinfer's engine."""

    def __init__(self, load_options: edgeinfer.LoadOptions | None = None):
        self.load_options = load_options

    def default_ref(self) -> str:
        return edgeinfer.DEFAULT_MODEL

    def list_models(self, kv_types: tuple[str, str] | None = None) -> list[ModelEntry]:
        """The store's models, estimated at the context this app loads with and `kv_types` (K, V)."""
        store = edgeinfer.Store()
        available = available_memory()
        n_ctx = self.load_options.n_ctx if self.load_options is not None else None
        return [entry_from_manifest(m, store=store, available=available, n_ctx=n_ctx, kv_types=kv_types)
                for m in store.list()]

    def load(self, ref: str | None, options: edgeinfer.LoadOptions | None = None) -> LoadedModel:
        """Load `ref` with `options` (None: this backend's load_options)."""
        engine = edgeinfer.load(ref or None, options=options or self.load_options)
        name = engine.manifest.ref if engine.manifest is not None else (ref or Path(engine.path).name)
        return LoadedModel(ref=name, engine=engine)

    def remove_model(self, ref: str) -> None:
        edgeinfer.Store().remove(ref)

    def run_task(
        self, kind: str, args: dict[str, str], on_progress: Callable[[TaskProgress], None], cancel: threading.Event
    ) -> str:
        """Run one manage task (blocking, from a worker thread); returns a one-line result.
        `cancel` stops a pull between chunks (the partial file is kept for a resume), a
        conversion between tensors, an importance matrix between chunks and a quantization at
        once (nothing is left behind)."""

        def progress(ev: object) -> None:
            on_progress(progress_from_event(ev, kind))

        source = args["source"]
        if kind == "pull":
            ref = pull(source, on_progress=progress, cancel=cancel).manifest.ref
        elif kind == "import":  # a GGUF file on this machine, copied into the store
            ref = edgeinfer.import_gguf(source, args.get("name") or None, on_progress=progress, cancel=cancel).manifest.ref
        elif kind == "convert":
            manifest = convert_model(source, args.get("outtype") or None, on_progress=progress, cancel=cancel).manifest
            ref = manifest.ref if manifest is not None else None
        elif kind == "quantize":
            ref = quantize_model(source, args.get("qtype") or DEFAULT_QUANT, on_progress=progress, cancel=cancel).ref
        elif kind == "imatrix":  # kept with the model, where quantize finds it
            result = compute_imatrix(source, on_progress=progress, cancel=cancel)
            return f"imatrix: {result.entries} tensors, {result.chunks} chunks → {result.path.name}"
        elif kind == "evaluate":  # against the full-precision model it was derived from; saved in the manifest
            result = evaluate(source, on_progress=progress)
            if result.kld is not None and result.same_top is not None:
                return f"evaluate: PPL {result.ppl:.3f}, KLD {result.kld:.4f}, same-top {result.same_top * 100:.1f} %"
            return f"evaluate: PPL {result.ppl:.3f} (no reference to compare with)"
        else:
            raise edgeinfer.InvalidOptionError(f"unknown task {kind!r}: choose one of {', '.join(TASK_KINDS)}")
        return f"{kind}: done{f' → {ref}' if ref else ''}"
