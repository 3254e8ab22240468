"""Ctrl+F (and when a reply ends with tool calls): paste the result of the model's tool call.

The app does not run tools: this dialog shows the call (name, id, arguments) and takes the text the
user pastes; it goes back to the model as a `role: "tool"` message. Esc leaves the call waiting
(Ctrl+F brings the dialog back)."""

from __future__ import annotations

import json

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Button, Label, Static, TextArea

from .base import FormDialog, key_label

__all__ = ["ToolResultScreen"]


class ToolResultScreen(FormDialog):
    """Dismisses with the pasted result (a string), or None (Esc, Later)."""

    DEFAULT_CSS = """
    ToolResultScreen #tool-call { color: $text-muted; max-height: 10; overflow-y: auto; margin-bottom: 1; }
    ToolResultScreen #tool-result { height: 8; }
    ToolResultScreen #tool-result-error { display: none; }
    ToolResultScreen #tool-result-error.-shown { display: block; }
    """
    AUTO_FOCUS = "#tool-result"

    def __init__(self, call: dict[str, str], *, waiting: int = 1, save_keys: str = "ctrl+s"):
        """`call`: {"id", "name", "arguments"}; `waiting`: how many calls of the reply wait (this one included)."""
        super().__init__(save_keys)
        self.call = call
        self.waiting = waiting

    def compose(self) -> ComposeResult:
        try:
            args = json.dumps(json.loads(self.call["arguments"]), indent=2, ensure_ascii=False)
        except ValueError:
            args = self.call["arguments"]
        more = f" (1 of {self.waiting} calls waiting)" if self.waiting > 1 else ""
        with Vertical(classes="dialog"):
            keys = f"{key_label(self.save_keys)}: send, Esc: later"
            yield Label(Content(f"Result of {self.call['name']}{more}  ({keys})"), classes="title")
            yield Static(Content(f"The model called {self.call['name']} (id {self.call['id']}) with:\n{args}\n\n"
                                 "Run it, then paste what it returned:"), id="tool-call")
            yield TextArea("", id="tool-result", soft_wrap=True)
            yield Static("", id="tool-result-error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("Later", id="cancel")
                yield Button("Send result", id="save", variant="primary")

    def action_save(self) -> None:
        text = self.query_one("#tool-result", TextArea).text
        if not text.strip():
            error = self.query_one("#tool-result-error", Static)
            error.update("The result is empty: paste what the tool returned (Esc: answer later).")
            error.add_class("-shown")
            return
        self.dismiss(text)
