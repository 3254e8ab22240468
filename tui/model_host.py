"""The app's one loaded model: loaded on demand from worker threads, replaced when another model or
other KV-cache types are asked for, closed when the app ends. No UI here: the chat view and the
app share one host."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import edgeinfer

from .backend import Backend, LoadedModel
from .settings import kv_load_options

__all__ = ["ModelHost", "ModelKey"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelKey:
    """What a loaded model was asked for: the ref, and the (K, V) cache types it was loaded with."""

    ref: str
    kv_types: tuple[str, str]


class ModelHost:
    """Holds at most one LoadedModel. `ensure_loaded` blocks (call it from a worker thread).

    A load that fails brings the previous model back (same ref and cache types), so a cache type
    the machine cannot afford, or a model that does not load, costs one error line and nothing
    else. The previous model is closed before the new one loads, not after: the new one is most
    likely to fail for want of memory, and two at once would need both."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.loaded: LoadedModel | None = None
        self.key: ModelKey | None = None  # what `loaded` was asked for (the engine may name the ref differently)
        self._lock = threading.Lock()

    def options_for(self, kv_types: tuple[str, str]) -> edgeinfer.LoadOptions:
        """The backend's load options (context, threads) with these cache types, validated."""
        return kv_load_options(kv_types, self.backend.load_options)

    def ensure_loaded(self, ref: str, kv_types: tuple[str, str] = edgeinfer.DEFAULT_LOAD.kv_types) -> LoadedModel:
        """The model `ref` with a (K, V) = `kv_types` cache, loading it (and closing the previous
        one) unless it is the loaded one. Raises the load's error with the previous model back."""
        with self._lock:
            options = self.options_for(kv_types)  # a refused combination fails here, the model still loaded
            key = ModelKey(ref, options.kv_types)
            if self.loaded is not None and self.key == key:
                return self.loaded
            previous = self.key
            self._close_loaded()
            try:
                self.loaded = self.backend.load(ref, options)
            except Exception:
                if previous is not None:
                    self._reload(previous)
                raise
            self.key = key
            return self.loaded

    def _reload(self, key: ModelKey) -> None:
        """Bring back the model a failed load replaced (it loaded before; if it no longer does,
        nothing is loaded and the next request tries again)."""
        try:
            self.loaded = self.backend.load(key.ref, self.options_for(key.kv_types))
            self.key = key
        except Exception:  # noqa: BLE001 - the caller reports the load that failed first
            log.warning("reloading %s after a failed load failed too", key.ref, exc_info=True)

    def close(self) -> None:
        """Close the loaded model (at exit; without the lock, so a load in progress cannot hold it up)."""
        self._close_loaded()

    def _close_loaded(self) -> None:
        old, self.loaded, self.key = self.loaded, None, None
        if old is None:
            return
        try:
            old.engine.close()
        except Exception:  # noqa: BLE001 - closing a model we are done with must not stop the app
            log.warning("closing %s failed", old.ref, exc_info=True)
