"""The one load path of both faces (`edgeinfer.load` -> Engine, `BatchEngine.load`): every argument
type-checked, the model resolved in the store, its file admitted (validated; a never-seen file first
loads in a child process), then the face made with its speculation prepared."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any, TypeVar

from ...errors import InvalidOptionError
from ...store import Store
from ...validate import admit
from ..core.options import LoadOptions, SpeculationOptions
from .speculation_setup import ProgressCallback

__all__ = ["load_face", "speculation_options"]

Face = TypeVar("Face")


def speculation_options(spec: SpeculationOptions | str) -> SpeculationOptions:
    """SpeculationOptions, or the CLI form ("lookup", "self=Q4_K_M", "draft=MODEL", ...), checked."""
    if isinstance(spec, str):
        return SpeculationOptions.parse(spec)
    if not isinstance(spec, SpeculationOptions):
        raise InvalidOptionError(f"speculation must be SpeculationOptions or a string like 'lookup', "
                                 f"got {type(spec).__name__}")
    return spec.validate()


def load_face(face: type[Face], model: str | Path | None, options: LoadOptions | None, *, store: Store | None,
              speculation: SpeculationOptions | str | None, progress: ProgressCallback | None,
              load_options: dict[str, Any], **face_args: Any) -> Face:
    """`face(path, info, options, manifest=, store=, speculation=, progress=, **face_args)` for the
    model `model` names (a store name, a `.gguf` path, or None for the default model); keyword
    `load_options` are LoadOptions fields."""
    unknown = set(load_options) - {f.name for f in fields(LoadOptions)}
    if unknown:
        raise InvalidOptionError(f"unknown load option(s): {', '.join(sorted(unknown))}")
    if options is not None and not isinstance(options, LoadOptions):
        raise InvalidOptionError(f"options must be LoadOptions, got {type(options).__name__}")
    if model is not None and not isinstance(model, (str, Path)):
        raise InvalidOptionError(f"model must be a store name or a path, got {type(model).__name__}")
    if store is not None and not isinstance(store, Store):
        raise InvalidOptionError(f"store must be a Store, got {type(store).__name__}")
    if progress is not None and not callable(progress):
        raise InvalidOptionError(f"progress must be a callable, got {type(progress).__name__}")
    options = replace(options or LoadOptions(), **load_options).validate()
    spec = speculation_options(speculation) if speculation is not None else None
    store = store or Store()
    path, manifest = store.resolve(model)
    info = admit(path, store, manifest)
    return face(path, info, options, manifest=manifest, store=store, speculation=spec,  # type: ignore[call-arg]
                progress=progress, **face_args)
