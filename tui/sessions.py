"""Chats that resume: each chat's KV cache saved next to the chat history, restored when it is reopened.

The engine holds one conversation's cache at a time: the chat whose reply ran last, or whose saved
state was restored last (the *resident* chat). Before the engine gives its cache to another chat,
or is closed (another model, other KV-cache types, the app quitting), the resident chat's state is
saved to `chat-sessions/chat-<id>.kv` beside `chats.sqlite3` (edgeinfer's `save_slot` of the
engine's one slot, 0: a temporary name, renamed when complete, tied to the model file's hash, the
KV-cache types and the tokens). When a chat goes back on the engine — it is opened, or its next
message is sent — its state is restored (`restore_slot`, which refuses a state of another model,
other cache types or other tokens with a log line), so the first new token costs only the new
message, not the whole history again.

No UI here: the model host calls it from worker threads (and at exit); the chat view only says
"resumed (N tokens cached)". An engine without these methods (a test's scripted one) has no
sessions; a state that cannot be written is a log line, never an error in the chat.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import edgeinfer

__all__ = ["ChatSessions", "Resident", "MIN_TOKENS"]

log = logging.getLogger(__name__)

MIN_TOKENS = 64  # a state shorter than this is not worth a file: reading it again takes a blink
SLOT = 0  # the chat's engine (an Engine) has one slot
_FILE = re.compile(r"chat-(\d+)\.kv\Z")


@dataclass(frozen=True)
class Resident:
    """The chat whose conversation the engine's cache holds, with the (model, KV types) key of
    the engine it is on and the conversation as its next request will render it."""

    chat_id: int
    key: Any  # model_host.ModelKey
    conversation: tuple[dict[str, str], ...]


def _supports(engine: Any) -> bool:
    return callable(getattr(engine, "save_slot", None)) and callable(getattr(engine, "restore_slot", None))


class ChatSessions:
    """The saved states of the chats in one folder, and which chat the engine holds (see the module).
    Thread-safe: one lock orders every save and restore."""

    def __init__(self, directory: Path, *, min_tokens: int = MIN_TOKENS):
        self.directory = Path(directory)
        self.min_tokens = min_tokens
        self.resident: Resident | None = None
        self._lock = threading.RLock()
        self._deleted: set[int] = set()

    def path_for(self, chat_id: int) -> Path:
        return self.directory / f"chat-{int(chat_id)}.kv"

    def note(self, chat_id: int, key: Any, conversation: list[dict[str, str]]) -> None:
        """The engine on `key` now holds chat `chat_id`'s conversation (a reply just ended)."""
        with self._lock:
            self.resident = Resident(chat_id, key, tuple(dict(m) for m in conversation))

    def leave(self, engine: Any, key: Any, *, closing: bool = False) -> edgeinfer.SessionInfo | None:
        """Save the resident chat's state if `engine` (loaded as `key`) holds it. It stays resident
        unless `closing` (the engine is about to be closed: its cache goes with it)."""
        with self._lock:
            r = self.resident
            if r is None or r.key != key:
                return None
            if closing:
                self.resident = None
            if r.chat_id in self._deleted or not _supports(engine):
                return None
            path = self.path_for(r.chat_id)
            try:
                info = engine.save_slot(SLOT, path, list(r.conversation))
            except (edgeinfer.EdgeInferError, OSError) as e:
                log.warning("chat %d: its KV state was not saved: %s", r.chat_id, e)
                return None
            if info.tokens < self.min_tokens:
                path.unlink(missing_ok=True)
                return None
            if info.written:
                log.info("chat %d: saved %d tokens of KV state (%.1f MB, %.2f s)", r.chat_id, info.tokens,
                         info.bytes / 1e6, info.seconds)
            return info

    def enter(self, engine: Any, key: Any, chat_id: int,
              conversation: list[dict[str, str]]) -> edgeinfer.RestoreResult | None:
        """Chat `chat_id` goes on `engine` (loaded as `key`): the resident chat's state is saved
        first, then this chat's saved state restored when it has one. None when nothing was
        restored because nothing needed to be (it is resident already, or has no saved state)."""
        with self._lock:
            r = self.resident
            if r is not None and r.chat_id == chat_id and r.key == key:
                return None
            if not _supports(engine):
                return None
            if r is not None and r.key == key:
                self.leave(engine, key)
            self.resident = Resident(chat_id, key, tuple(dict(m) for m in conversation))
            path = self.path_for(chat_id)
            if not path.is_file():
                return None
            try:
                result = engine.restore_slot(SLOT, path, conversation)
            except (edgeinfer.EdgeInferError, OSError) as e:
                log.warning("chat %d: its KV state was not restored: %s", chat_id, e)
                return None
            if result:
                log.info("chat %d: resumed %d tokens of KV state (%.2f s)", chat_id, result.tokens, result.seconds)
            return result

    def forget(self, chat_id: int) -> None:
        """The chat is deleted: its state goes with it (now, and if a save of it was under way)."""
        with self._lock:
            self._deleted.add(chat_id)
            if self.resident is not None and self.resident.chat_id == chat_id:
                self.resident = None
            self.path_for(chat_id).unlink(missing_ok=True)

    def prune(self, chat_ids: Collection[int]) -> int:
        """Remove the states of chats that no longer exist; returns how many went."""
        removed = 0
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return 0
        keep = set(chat_ids)
        for p in entries:
            m = _FILE.match(p.name)
            if m and int(m.group(1)) not in keep:
                try:
                    p.unlink()
                    removed += 1
                except OSError as e:
                    log.debug("could not remove %s: %s", p, e)
        return removed
