"""What a request's model name means to a service: a store name (`name:tag`, a name with one tag or a
default tag), an alias, the file name of a model the operator configured; and the settings of each
model file (serve.toml's tables, resolved once)."""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import InvalidOptionError, ModelNotFoundError
from ..store import ModelManifest, Store
from .settings import ModelSettings, ServiceOptions

__all__ = ["ModelNames", "model_key"]

log = logging.getLogger(__name__)


def model_key(path: Path) -> str:
    """The key of a model file: its resolved path (one engine per file)."""
    return str(Path(path).resolve())


def _looks_like_path(name: str) -> bool:
    return "/" in name or "\\" in name or name.startswith((".", "~"))


class ModelNames:
    """The operator's names (aliases, configured files, the default model) over the store's."""

    def __init__(self, store: Store, options: ServiceOptions):
        self.store = store
        self.options = options
        # Settings by file: [models] tables and the default model resolved once (a table naming a
        # model that is not there is a warning: it may be pulled later, and then it applies).
        self.tables: dict[str, ModelSettings] = {}
        self.by_name: dict[str, str | Path] = {}  # aliases and configured file names -> the operator's reference
        for ref, settings in options.models.items():
            target: str | Path = Path(ref).expanduser() if _looks_like_path(ref) else ref
            try:
                key = model_key(self.resolve_ref(target)[0])
            except ModelNotFoundError:
                log.warning("serve settings for %s: no such model (the table is ignored)", ref)
                continue
            self.tables[key] = settings
            for alias in settings.alias:
                self.by_name[alias] = target
        self.default_key: str | None = None
        try:
            self.default_key = model_key(self.resolve_ref(options.default_model)[0])
        except ModelNotFoundError:
            if options.default_model is not None:
                raise

    def resolve_ref(self, ref: str | Path | None) -> tuple[Path, ModelManifest | None]:
        """A reference the operator or the library's caller gives (a path may be one: a store
        model's file is that model, by its store name)."""
        path, manifest = self.store.resolve(ref)
        path = Path(path)
        if manifest is None:  # a file the operator named: its file name (and stem) names it too
            self.by_name.setdefault(path.name, path)
            self.by_name.setdefault(path.stem, path)
            real = path.resolve()
            manifest = next((m for m in self.store.list() if m.path.resolve() == real), None)
        return path, manifest

    def resolve(self, model: str | Path | None) -> tuple[Path, ModelManifest | None]:
        """A model as a request names it (what ModelService.resolve says)."""
        if isinstance(model, Path):
            return self.resolve_ref(model.expanduser())
        if model is None or model == "":
            return self.resolve_ref(self.options.default_model)
        if not isinstance(model, str):
            raise InvalidOptionError(f"a model name must be a string, got {type(model).__name__}")
        configured = self.by_name.get(model)
        if configured is not None:
            return self.resolve_ref(configured)
        if _looks_like_path(model):
            raise ModelNotFoundError(f"model {model[:200]!r} looks like a path: name a model of the store "
                                     "(`edgeinfer list`) or an alias the server configures")
        if model.endswith(".gguf"):
            for m in self.store.list():
                if Path(m.file).name == model and m.path.exists():
                    return m.path, m
            raise ModelNotFoundError(f"no model file named {model[:200]!r} in the store (see `edgeinfer list`)")
        return self.resolve_ref(model)

    def settings(self, key: str) -> ModelSettings:
        """The settings of the model file `key`: its table over [defaults], and for the default
        model the server's flags over both."""
        settings = self.tables.get(key, ModelSettings()).over(self.options.defaults)
        if key == self.default_key:
            settings = self.options.default_settings.over(settings)
        return settings

    def configured_files(self) -> list[Path]:
        """The files the operator named (outside the store or not), once each."""
        return list(dict.fromkeys(t for t in self.by_name.values() if isinstance(t, Path)))
