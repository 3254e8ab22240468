"""What the dialogs share: a centred box, Esc closes, numbers parsed with a one-line error."""

from __future__ import annotations

from typing import Any

from textual import on
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Button, Input

__all__ = ["Dialog", "FormDialog", "parse_number"]


class Dialog(ModalScreen[Any]):
    """A modal dialog: its content in a `.dialog` container; Esc dismisses it with None."""

    DEFAULT_CSS = """
    Dialog { align: center middle; }
    Dialog .dialog {
        width: 90; max-width: 95%; height: auto; max-height: 90%;
        border: thick $primary; background: $surface; padding: 1 2;
    }
    Dialog .dialog > .title { text-style: bold; margin-bottom: 1; }
    Dialog .dialog .buttons { height: auto; margin-top: 1; align-horizontal: right; }
    Dialog .dialog .buttons Button { margin-left: 2; }
    Dialog .dialog .field { height: auto; }
    Dialog .dialog .field > Label { width: 22; padding: 1 1 0 0; }
    Dialog .dialog .field Input { width: 1fr; }
    Dialog .dialog .error { color: $error; height: auto; }
    """
    BINDINGS = [Binding("escape", "dismiss_none", "Close")]

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


class FormDialog(Dialog):
    """A dialog of fields: Ctrl+S, Enter in a field or the #save button applies it (`action_save`
    validates and dismisses with the result); the #cancel button or Esc closes it unchanged."""

    BINDINGS = [Binding("ctrl+s", "save", "Save", priority=True)]

    def action_save(self) -> None:
        raise NotImplementedError

    @on(Input.Submitted)
    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


def parse_number(text: str, kind: type[int] | type[float], name: str, optional: bool = False) -> Any:
    """`text` as an int or float; empty is None when `optional`; else ValueError naming the field."""
    text = text.strip()
    if optional and text == "":
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not {'an integer' if kind is int else 'a number'}") from None
