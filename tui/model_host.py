"""The app's one loaded model: loaded on demand from worker threads, replaced when another model or
other KV-cache types are asked for, closed when the app ends. With `sessions` (tui/sessions.py) the
cache of the chat it holds is saved before it goes, and a chat's saved cache is restored when the
chat goes back on it (`resume`). No UI here: the chat view and the app share one host."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import edgeinfer

from .backend import Backend, LoadedModel
from .sessions import ChatSessions
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
        self.sessions: ChatSessions | None = None  # set by the app when the chat history has a folder
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

    # -- chats that resume (tui/sessions.py) ------------------------------------------------------
    def resume(self, ref: str, kv_types: tuple[str, str], chat_id: int,
               conversation: list[dict[str, str]]) -> edgeinfer.RestoreResult | None:
        """Chat `chat_id` is about to use the model `ref` with `kv_types`: if that model is the loaded
        one, save the chat it holds and restore this chat's saved cache (blocking: a worker thread).
        None when nothing was restored (not loaded, resident already, no saved state)."""
        if self.sessions is None:
            return None
        with self._lock:
            try:
                key = ModelKey(ref, self.options_for(kv_types).kv_types)
            except edgeinfer.EdgeInferError:
                return None
            if self.loaded is None or self.key != key:
                return None
            return self.sessions.enter(self.loaded.engine, key, chat_id, conversation)

    def note_conversation(self, ref: str, kv_types: tuple[str, str], chat_id: int,
                          conversation: list[dict[str, str]]) -> None:
        """A reply for chat `chat_id` ended on the model `ref`: its cache now holds `conversation`."""
        if self.sessions is None:
            return
        try:
            key = ModelKey(ref, self.options_for(kv_types).kv_types)
        except edgeinfer.EdgeInferError:
            return
        self.sessions.note(chat_id, key, conversation)

    def forget_chat(self, chat_id: int) -> None:
        """Chat `chat_id` is deleted: so is its saved cache."""
        if self.sessions is not None:
            self.sessions.forget(chat_id)

    def close(self) -> None:
        """Close the loaded model (at exit; without the lock, so a load in progress cannot hold it up)."""
        self._close_loaded()

    def _close_loaded(self) -> None:
        old, key, self.loaded, self.key = self.loaded, self.key, None, None
        if old is None:
            return
        if self.sessions is not None:  # the chat it holds keeps its cache, on disk
            self.sessions.leave(old.engine, key, closing=True)
        try:
            old.engine.close()
        except Exception:  # noqa: BLE001 - closing a model we are done with must not stop the app
            log.warning("closing %s failed", old.ref, exc_info=True)
