"""The small interface the UI talks to: list models, load one, chat, cancel.

`LibraryBackend` is the real one, on `edgeinfer.load(...).chat(...)` and `edgeinfer.Store`. Tests
pass a backend whose engine is scripted (deterministic tokens at an adjustable speed) so the UI's
flows can be checked exactly; the UI never knows the difference.
"""

from __future__ import annotations

import importlib.util
import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ModelEntry",
    "LoadedModel",
    "GenerationLike",
    "EngineLike",
    "Backend",
    "LibraryBackend",
    "entry_from_manifest",
    "feature_available",
    "mem_available_bytes",
    "TaskProgress",
    "progress_from_event",
    "FEATURES",
]

# Manage features and the edgeinfer module each one needs (built by other parts of the project;
# the UI checks at runtime and says "not available in this version" when one is missing).
FEATURES: dict[str, str] = {
    "pull": "edgeinfer.pull",
    "convert": "edgeinfer.convert",
    "quantize": "edgeinfer.quantize",
    "evaluate": "edgeinfer.evaluate",
}


def feature_available(module: str) -> bool:
    """Whether an optional edgeinfer module (hub, convert, quantize, evaluate, fit) is installed."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _metric(section: Any, *names: str) -> float | None:
    if not isinstance(section, dict):
        return None
    for n in names:
        v = section.get(n)
        if isinstance(v, (int, float)):
            return float(v)
    return None


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
    fits: bool | None = None
    name: str = ""
    derived_from: str | None = None


def _fits(manifest: Any) -> bool | None:
    """Does the model fit in RAM? edgeinfer.fit when present, else weights + 20 % vs MemAvailable."""
    if feature_available("edgeinfer.fit"):
        try:
            import edgeinfer.fit as fit_mod

            for fn_name in ("estimate", "fit"):
                fn = getattr(fit_mod, fn_name, None)
                if callable(fn):
                    est = fn(manifest.ref)
                    fits = getattr(est, "fits", None)
                    if isinstance(fits, bool):
                        return fits
                    break
        except Exception:  # an estimate is a hint; never let it break the picker
            pass
    avail = mem_available_bytes()
    return None if avail is None else manifest.size * 1.2 < avail


def entry_from_manifest(m: Any) -> ModelEntry:
    metrics = m.metrics or {}
    ev = metrics.get("eval")
    bench = metrics.get("bench")
    same_top = _metric(ev, "same_top_pct", "same_top_percent", "same_top")
    if same_top is not None and same_top <= 1.0:
        same_top *= 100.0
    return ModelEntry(
        ref=m.ref,
        name=m.name,
        quant=m.quant,
        size=m.size,
        bits_per_weight=m.bits_per_weight,
        kld=_metric(ev, "kld", "mean_kld", "kld_mean"),
        same_top=same_top,
        ppl=_metric(ev, "ppl", "perplexity"),
        tok_s=_metric(bench, "decode_tok_s", "tok_s", "decode"),
        fits=_fits(m),
        derived_from=m.derived_from,
    )


@dataclass(frozen=True)
class TaskProgress:
    """Progress of a manage task, whatever library event it came from. `key` names one bar
    (a file being downloaded, or the whole job); `message` is a line of status with no bar."""

    key: str
    label: str
    done: float
    total: float | None
    message: str | None = None


def progress_from_event(ev: Any, default_key: str = "task") -> TaskProgress:
    """Map the library's progress dataclasses onto bars: hub.DownloadProgress (one bar per file),
    quantize.QuantizeProgress and convert.ConvertProgress (per tensor), evaluate.EvalProgress
    (per chunk); hub.PullPlan / PullStage and anything else become a status line."""
    if hasattr(ev, "file") and hasattr(ev, "done") and hasattr(ev, "total"):
        status = getattr(ev, "status", "")
        return TaskProgress(key=str(ev.file), label=f"{ev.file} {status}".strip(), done=float(ev.done), total=float(ev.total) or None)
    if hasattr(ev, "tensor_index") and hasattr(ev, "n_tensors"):
        return TaskProgress(key=default_key, label=f"{ev.tensor_name} → {ev.type_name}", done=ev.tensor_index, total=ev.n_tensors)
    if hasattr(ev, "chunk") and hasattr(ev, "n_chunks"):
        label = f"{getattr(ev, 'model', '')} chunk {ev.chunk}/{ev.n_chunks}"
        return TaskProgress(key=f"{default_key}-{getattr(ev, 'model', '')}", label=label, done=ev.chunk, total=ev.n_chunks)
    if hasattr(ev, "index") and hasattr(ev, "count"):
        return TaskProgress(key=default_key, label=str(getattr(ev, "tensor", "")), done=ev.index, total=ev.count)
    if hasattr(ev, "total_bytes") and hasattr(ev, "repo"):  # the pull's plan, before downloading
        size = f"{ev.total_bytes / 1e6:.1f} MB"
        msg = f"{ev.repo} @ {str(getattr(ev, 'commit', ''))[:10]}: {getattr(ev, 'kind', '')} {getattr(ev, 'quant', '')}, {size} to fetch"
        return TaskProgress(key=default_key, label="", done=0, total=None, message=msg)
    message = getattr(ev, "message", None)
    return TaskProgress(key=default_key, label="", done=0, total=None, message=str(message if message else ev)[:200])


class GenerationLike(Protocol):
    stats: Any

    def __iter__(self) -> Iterator[Any]: ...

    def cancel(self) -> None: ...


class EngineLike(Protocol):
    def chat(self, messages: list[dict[str, str]], options: Any = None) -> GenerationLike: ...

    def close(self) -> None: ...


@dataclass
class LoadedModel:
    ref: str
    engine: EngineLike


class Backend(Protocol):
    def default_ref(self) -> str: ...

    def list_models(self) -> list[ModelEntry]: ...

    def load(self, ref: str | None) -> LoadedModel: ...

    def remove_model(self, ref: str) -> None: ...

    def features(self) -> dict[str, bool]: ...

    def run_task(
        self, kind: str, args: dict[str, str], on_progress: Callable[[TaskProgress], None], cancel: threading.Event
    ) -> str: ...


class LibraryBackend:
    """The real backend: the store's models, loaded by edgeinfer's engine."""

    def __init__(self, load_options: Any = None):
        self.load_options = load_options

    def default_ref(self) -> str:
        import edgeinfer

        return edgeinfer.DEFAULT_MODEL

    def list_models(self) -> list[ModelEntry]:
        import edgeinfer

        return [entry_from_manifest(m) for m in edgeinfer.Store().list()]

    def load(self, ref: str | None) -> LoadedModel:
        import edgeinfer

        engine = edgeinfer.load(ref or None, options=self.load_options)
        manifest = getattr(engine, "manifest", None)
        name = manifest.ref if manifest is not None else (ref or Path(str(engine.path)).name)
        return LoadedModel(ref=name, engine=engine)

    def remove_model(self, ref: str) -> None:
        import edgeinfer

        edgeinfer.Store().remove(ref)

    def features(self) -> dict[str, bool]:
        return {k: feature_available(m) and self._task_fn(k) is not None for k, m in FEATURES.items()}

    def _task_fn(self, kind: str) -> Callable[..., Any] | None:
        """The library function behind a manage task, or None when this version lacks it."""
        names = {
            "pull": ("pull", "pull_model"),
            "convert": ("convert_model",),
            "quantize": ("quantize_model",),
            "evaluate": ("evaluate_model", "evaluate"),
        }[kind]
        try:
            module = importlib.import_module(FEATURES[kind])
        except ImportError:
            return None
        for n in names:
            fn = getattr(module, n, None)
            if callable(fn):
                return fn
        return None

    def run_task(
        self, kind: str, args: dict[str, str], on_progress: Callable[[TaskProgress], None], cancel: threading.Event
    ) -> str:
        """Run one manage task (blocking, from a worker thread); returns a one-line result.
        `cancel` stops a pull between chunks (the partial file is kept for a resume)."""
        import edgeinfer

        fn = self._task_fn(kind)
        if fn is None:
            raise edgeinfer.EdgeInferError(f"{kind} is not available in this version of edgeinfer")

        def progress(ev: Any) -> None:
            on_progress(progress_from_event(ev, kind))

        if kind == "pull":
            result = fn(args["source"], on_progress=progress, cancel=cancel)
        elif kind == "convert":
            result = fn(args["source"], args.get("outtype") or None, on_progress=progress)
        elif kind == "quantize":
            result = fn(args["source"], args.get("qtype") or "Q4_K_M", on_progress=progress)
        else:  # evaluate: against the full-precision model it was derived from; saved in the manifest
            result = fn(args["source"], on_progress=progress)
            if getattr(result, "kld", None) is not None:
                return f"evaluate: PPL {result.ppl:.3f}, KLD {result.kld:.4f}, same-top {result.same_top * 100:.1f} %"
            if getattr(result, "ppl", None) is not None:
                return f"evaluate: PPL {result.ppl:.3f} (no reference to compare with)"
        manifest = getattr(result, "manifest", None)
        ref = getattr(result, "ref", None) or (manifest.ref if manifest is not None else None)
        return f"{kind}: done{f' → {ref}' if ref else ''}"
