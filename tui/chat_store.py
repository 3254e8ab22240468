"""Chats and their messages in SQLite, in the store directory (`chats.sqlite3`).

The schema is versioned the way simonw/llm does it: a `_migrations` table records which named
migration functions have run, and `MIGRATIONS` is an ordered list that only ever grows. Opening a
database applies the missing ones, each in its own transaction, so an old file is upgraded in place
and a new one is built by the same path.
"""

from __future__ import annotations

import datetime as _dt
import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ChatStore", "Chat", "Message", "MIGRATIONS", "default_db_path", "export_markdown"]


def default_db_path() -> Path:
    import edgeinfer.paths

    return edgeinfer.paths.home() / "chats.sqlite3"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


# -- migrations (append only; never edit one that has shipped) ----------------------------------
def m001_initial(db: sqlite3.Connection) -> None:
    db.execute(
        """CREATE TABLE chats (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            title TEXT NOT NULL,
            model TEXT,
            created TEXT NOT NULL,
            updated TEXT NOT NULL
        )"""
    )
    db.execute(
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            created TEXT NOT NULL
        )"""
    )
    db.execute("CREATE INDEX messages_chat ON messages(chat_id, id)")


def m002_settings_and_stats(db: sqlite3.Connection) -> None:
    # Per-chat system prompt, sampling and speculation settings; per-reply model, statistics and
    # the character spans of drafted-and-accepted tokens (for the coloured view).
    db.execute("ALTER TABLE chats ADD COLUMN settings TEXT NOT NULL DEFAULT '{}'")
    db.execute("ALTER TABLE messages ADD COLUMN model TEXT")
    db.execute("ALTER TABLE messages ADD COLUMN stats TEXT")
    db.execute("ALTER TABLE messages ADD COLUMN drafted TEXT NOT NULL DEFAULT '[]'")


def m003_tool_calls(db: sqlite3.Connection) -> None:
    # An assistant message's tool calls (JSON [{"id", "name", "arguments"}]) and, on a `tool`
    # message, the id of the call it answers.
    db.execute("ALTER TABLE messages ADD COLUMN tool_calls TEXT NOT NULL DEFAULT '[]'")
    db.execute("ALTER TABLE messages ADD COLUMN tool_call_id TEXT")


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [m001_initial, m002_settings_and_stats, m003_tool_calls]


def migrate(db: sqlite3.Connection, migrations: list[Callable[[sqlite3.Connection], None]] | None = None) -> list[str]:
    """Apply the migrations not yet recorded; return the names applied now."""
    db.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied TEXT NOT NULL)")
    done = {row[0] for row in db.execute("SELECT name FROM _migrations")}
    applied = []
    for fn in migrations if migrations is not None else MIGRATIONS:
        if fn.__name__ in done:
            continue
        with db:  # one transaction per migration: all of it or none of it
            fn(db)
            db.execute("INSERT INTO _migrations (name, applied) VALUES (?, ?)", (fn.__name__, _now()))
        applied.append(fn.__name__)
    return applied


@dataclass
class Chat:
    id: int
    title: str
    model: str | None
    settings: dict[str, Any]
    created: str
    updated: str


@dataclass
class Message:
    id: int
    chat_id: int
    role: str  # system | user | assistant | tool (a tool result the user pasted)
    content: str
    created: str
    model: str | None = None
    stats: dict[str, Any] | None = None
    drafted: list[tuple[int, int]] = field(default_factory=list)  # [start, end) character spans
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # an assistant's calls: {"id", "name", "arguments"}
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatStore:
    """All chat persistence. Used from the UI thread only (one connection)."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path))
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.execute("PRAGMA journal_mode = WAL")
        migrate(self.db)

    def close(self) -> None:
        self.db.close()

    # -- chats -----------------------------------------------------------------------------------
    def _chat(self, row: sqlite3.Row) -> Chat:
        return Chat(
            id=row["id"],
            title=row["title"],
            model=row["model"],
            settings=json.loads(row["settings"] or "{}"),
            created=row["created"],
            updated=row["updated"],
        )

    def create_chat(self, title: str = "New chat", model: str | None = None, settings: dict[str, Any] | None = None) -> Chat:
        now = _now()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO chats (title, model, settings, created, updated) VALUES (?, ?, ?, ?, ?)",
                (title, model, json.dumps(settings or {}), now, now),
            )
        return self.get_chat(int(cur.lastrowid))

    def get_chat(self, chat_id: int) -> Chat:
        row = self.db.execute("SELECT * FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise KeyError(f"no chat {chat_id}")
        return self._chat(row)

    def list_chats(self) -> list[Chat]:
        """Most recently updated first."""
        return [self._chat(r) for r in self.db.execute("SELECT * FROM chats ORDER BY updated DESC, id DESC")]

    def update_chat(self, chat_id: int, **changes: Any) -> Chat:
        allowed = {"title", "model", "settings"}
        bad = set(changes) - allowed
        if bad:
            raise ValueError(f"cannot update {', '.join(sorted(bad))}")
        if "settings" in changes:
            changes["settings"] = json.dumps(changes["settings"])
        if changes:
            cols = ", ".join(f"{k} = ?" for k in changes)
            with self.db:
                self.db.execute(f"UPDATE chats SET {cols}, updated = ? WHERE id = ?", (*changes.values(), _now(), chat_id))
        return self.get_chat(chat_id)

    def delete_chat(self, chat_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    # -- messages --------------------------------------------------------------------------------
    def _message(self, row: sqlite3.Row) -> Message:
        return Message(
            id=row["id"],
            chat_id=row["chat_id"],
            role=row["role"],
            content=row["content"],
            created=row["created"],
            model=row["model"],
            stats=json.loads(row["stats"]) if row["stats"] else None,
            drafted=[(int(a), int(b)) for a, b in json.loads(row["drafted"] or "[]")],
            tool_calls=_calls(row["tool_calls"]),
            tool_call_id=row["tool_call_id"],
        )

    def add_message(
        self,
        chat_id: int,
        role: str,
        content: str,
        *,
        model: str | None = None,
        stats: dict[str, Any] | None = None,
        drafted: list[tuple[int, int]] | None = None,
        tool_calls: list[dict[str, str]] | None = None,
        tool_call_id: str | None = None,
    ) -> Message:
        now = _now()
        calls = [{"id": c["id"], "name": c["name"], "arguments": c["arguments"]} for c in tool_calls or ()]
        with self.db:
            cur = self.db.execute(
                "INSERT INTO messages (chat_id, role, content, created, model, stats, drafted, tool_calls, tool_call_id)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, now, model, json.dumps(stats) if stats else None, json.dumps(drafted or []),
                 json.dumps(calls), tool_call_id),
            )
            self.db.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
        row = self.db.execute("SELECT * FROM messages WHERE id = ?", (cur.lastrowid,)).fetchone()
        return self._message(row)

    def messages(self, chat_id: int) -> list[Message]:
        return [self._message(r) for r in self.db.execute("SELECT * FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,))]

    def delete_message(self, message_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))


def _calls(text: str | None) -> list[dict[str, str]]:
    """Stored tool calls; entries a damaged database garbled are left out, not a crash."""
    try:
        data = json.loads(text or "[]")
    except ValueError:
        return []
    if not isinstance(data, list):
        return []
    keys = ("id", "name", "arguments")
    return [{k: c[k] for k in keys} for c in data if isinstance(c, dict) and all(isinstance(c.get(k), str) for k in keys)]


def export_markdown(chat: Chat, messages: list[Message]) -> str:
    """A chat as a Markdown document: title, model, system prompt, then each turn."""
    lines = [f"# {chat.title}", ""]
    if chat.model:
        lines += [f"Model: `{chat.model}`", ""]
    system = (chat.settings or {}).get("system_prompt")
    if system:
        lines += ["## System", "", system, ""]
    for m in messages:
        if m.role == "system":
            continue
        if m.role == "tool":
            lines += [f"## Tool result ({m.tool_call_id})", "", "```", m.content.rstrip(), "```", ""]
            continue
        lines += [f"## {'User' if m.role == 'user' else 'Assistant'}", ""]
        if m.content.strip():
            lines += [m.content.rstrip(), ""]
        for c in m.tool_calls:
            lines += [f"Tool call `{c['name']}` ({c['id']}):", "", "```json", c["arguments"], "```", ""]
    return "\n".join(lines).rstrip() + "\n"
