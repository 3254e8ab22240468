"""A yes/no dialog (delete a chat, delete a model)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Label

from .base import Dialog

__all__ = ["ConfirmScreen"]


class ConfirmScreen(Dialog):
    """Dismisses with True (y, Yes) or None (n, No, Esc)."""

    BINDINGS = [Binding("y", "yes", "Yes"), Binding("n", "dismiss_none", "No")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question, classes="title")
            with Horizontal(classes="buttons"):
                yield Button("No", id="no")
                yield Button("Yes", variant="error", id="yes")

    def action_yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#yes")
    def _yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def _no(self) -> None:
        self.dismiss(None)
