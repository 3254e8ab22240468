"""Key bindings, remappable in `tui.toml` in the store directory.

    # $EDGEINFER_HOME/tui.toml
    theme = "nord"          # any Textual theme name
    [keys]
    regenerate = "ctrl+r,f5"   # comma-separated keys, as Textual names them
    send = "enter"
    newline = "shift+enter,ctrl+j"

Every action has a stable id; unknown ids or a malformed file are a one-line error shown in the
UI (the defaults are used), never a crash.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Action", "ACTIONS", "APP_ACTIONS", "TuiConfig", "load_config", "config_path"]


@dataclass(frozen=True)
class Action:
    id: str  # the key in [keys] and the Textual binding id "edgeinfer.<id>"
    keys: str  # default, comma-separated
    description: str  # short: the footer and the palette
    help: str  # one line for the help screen and the palette
    show: bool = True  # in the footer
    title: str = ""  # in the command palette (default: description)

    @property
    def palette_title(self) -> str:
        return self.title or self.description


# In footer order: what a footer 80 columns wide shows first (the rest in F1 and the palette).
ACTIONS: tuple[Action, ...] = (
    Action("cancel", "escape", "Cancel", "Stop the reply being generated (keeps what came so far)"),  # while one is
    Action("new_chat", "ctrl+n", "New", "Start a new chat (with the default settings)", title="New chat"),
    Action("pick_model", "ctrl+o", "Model", "Pick the model (also mid-chat)", title="Pick model"),
    Action("settings", "ctrl+s", "Settings", "System prompt and sampling settings of this chat"),
    Action("speculation", "ctrl+t", "Speculate", "Speculative decoding: method and draft length",
           title="Speculation"),
    Action("manage", "ctrl+l", "Manage", "Models: pull, import, convert, quantize, quality ladder, delete"),
    Action("help", "f1", "Help", "Show the key bindings"),
    Action("quit", "ctrl+q", "Quit", "Quit (asks first while a reply is being generated)"),
    Action("regenerate", "ctrl+r", "Regenerate", "Generate the last reply again"),
    Action("toggle_drafted", "ctrl+g", "Drafted", "Colour drafted-and-accepted tokens in replies", show=False),
    Action("copy_reply", "f4", "Copy reply", "Copy the last reply to the clipboard", show=False),
    Action("copy_code", "f9", "Copy code", "Copy the last code block of the last reply", show=False),
    Action("last_chat", "ctrl+b", "Last chat", "Back to the chat open before this one (after `edgeinfer chat MODEL`: "
           "your last chat)", show=False),
    Action("rename_chat", "f2", "Rename", "Rename this chat", show=False),
    Action("delete_chat", "f8", "Delete", "Delete this chat", show=False),
    Action("export_chat", "f3", "Export", "Export this chat to Markdown", show=False),
    Action("tool_result", "ctrl+f", "Tool result", "Paste the result of the model's tool call (tools: tools.json)",
           show=False),
)
# The app's own actions (they work on every screen); the others are the chat screen's.
APP_ACTIONS: frozenset[str] = frozenset({"help", "quit"})

INPUT_KEYS: dict[str, tuple[str, str]] = {
    # handled by the message input itself (a TextArea consumes these keys before bindings)
    "send": ("enter", "Send the message"),
    "newline": ("shift+enter,ctrl+j", "Insert a new line in the message"),
}


def config_path() -> Path:
    import edgeinfer.paths

    return edgeinfer.paths.home() / "tui.toml"


@dataclass
class TuiConfig:
    keys: dict[str, str] = field(default_factory=dict)  # action id -> comma-separated keys
    theme: str | None = None
    error: str | None = None  # a one-line problem with the file; defaults are used

    def key_for(self, action_id: str) -> str:
        if action_id in self.keys:
            return self.keys[action_id]
        for a in ACTIONS:
            if a.id == action_id:
                return a.keys
        return INPUT_KEYS[action_id][0]

    def key_list(self, action_id: str) -> list[str]:
        return [k.strip() for k in self.key_for(action_id).split(",") if k.strip()]

    @property
    def keymap(self) -> dict[str, str]:
        """Textual keymap: binding id -> keys, for the actions the user remapped."""
        return {f"edgeinfer.{k}": v for k, v in self.keys.items() if k not in INPUT_KEYS}


def load_config(path: Path | None = None) -> TuiConfig:
    path = path or config_path()
    if not path.exists():
        return TuiConfig()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return TuiConfig(error=f"{path}: {e}; using default keys")
    known = {a.id for a in ACTIONS} | set(INPUT_KEYS)
    keys = data.get("keys", {})
    if not isinstance(keys, dict):
        return TuiConfig(error=f"{path}: [keys] must be a table; using default keys")
    bad = [k for k, v in keys.items() if k not in known or not isinstance(v, str) or not v.strip()]
    theme = data.get("theme") if isinstance(data.get("theme"), str) else None
    good = {k: v for k, v in keys.items() if k not in bad}
    error = None
    if bad:
        error = f"{path}: unknown or empty key binding(s) {', '.join(sorted(bad))}; known: {', '.join(sorted(known))}"
    return TuiConfig(keys=good, theme=theme, error=error)
