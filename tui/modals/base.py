"""What the dialogs share: a centred box, Esc closes, numbers parsed with a one-line error."""

from __future__ import annotations

from typing import Any

from textual import on
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Button, Input

__all__ = ["Dialog", "FormDialog", "parse_number", "key_label"]


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


def key_label(keys: str) -> str:
    """The first of comma-separated Textual key names as a user reads it: 'ctrl+t' → 'Ctrl+T'."""
    first = keys.split(",")[0].strip()
    return "+".join(part.upper() if len(part) == 1 else part.capitalize() for part in first.split("+"))


class FormDialog(Dialog):
    """A dialog of fields: its save keys (the key that opened it: Ctrl+S for Settings, Ctrl+T for
    Speculation, as remapped), Enter in a field or the #save button applies it (`action_save`
    validates and dismisses with the result); the #cancel button or Esc closes it unchanged."""

    def __init__(self, save_keys: str = "ctrl+s"):
        super().__init__()
        self.save_keys = save_keys
        self._bindings.bind(save_keys, "save", "Save", show=False, priority=True)

    @property
    def keys_hint(self) -> str:
        return f"{key_label(self.save_keys)}: save, Esc: cancel"

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
