"""The app's one loaded model: loaded on demand from worker threads, replaced when another model is
asked for, closed when the app ends. No UI here: the chat view and the app share one host."""

from __future__ import annotations

import logging
import threading

from .backend import Backend, LoadedModel

__all__ = ["ModelHost"]

log = logging.getLogger(__name__)


class ModelHost:
    """Holds at most one LoadedModel. `ensure_loaded` blocks (call it from a worker thread)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.loaded: LoadedModel | None = None
        self._request: str | None = None  # the ref `loaded` was asked for (the engine may name it differently)
        self._lock = threading.Lock()

    def ensure_loaded(self, ref: str) -> LoadedModel:
        """The model `ref`, loading it (and closing the previous one) unless it is the loaded one."""
        with self._lock:
            if self.loaded is not None and self._request == ref:
                return self.loaded
            self._close_loaded()
            self.loaded = self.backend.load(ref)
            self._request = ref
            return self.loaded

    def close(self) -> None:
        """Close the loaded model (at exit; without the lock, so a load in progress cannot hold it up)."""
        self._close_loaded()

    def _close_loaded(self) -> None:
        old, self.loaded, self._request = self.loaded, None, None
        if old is None:
            return
        try:
            old.engine.close()
        except Exception:  # noqa: BLE001 - closing a model we are done with must not stop the app
            log.warning("closing %s failed", old.ref, exc_info=True)
