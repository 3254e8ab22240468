"""Ctrl+S: the chat's system prompt and sampling settings. Save validates through edgeinfer."""

from __future__ import annotations

from dataclasses import replace

from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Button, Input, Label, Static, TextArea

from ..settings import ChatSettings
from .base import FormDialog, parse_number

__all__ = ["SettingsScreen"]


class SettingsScreen(FormDialog):
    """Dismisses with the new ChatSettings, or None. Opens with the system prompt focused."""

    FIELDS = (
        ("temperature", "Temperature", float, False),
        ("top_k", "Top-k", int, False),
        ("top_p", "Top-p", float, False),
        ("min_p", "Min-p", float, False),
        ("repeat_penalty", "Repeat penalty", float, False),
        ("seed", "Seed (empty: random)", int, True),
        ("max_tokens", "Max tokens", int, False),
    )
    DEFAULT_CSS = """
    SettingsScreen #system { height: 6; }
    """
    AUTO_FOCUS = "#system"

    def __init__(self, settings: ChatSettings):
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        with VerticalScroll(classes="dialog"):
            yield Label("Chat settings  (Ctrl+S: save, Esc: cancel)", classes="title")
            yield Label("System prompt")
            yield TextArea(s.system_prompt, id="system", soft_wrap=True)
            for key, label, _kind, _opt in self.FIELDS:
                v = getattr(s, key)
                with Horizontal(classes="field"):
                    yield Label(label)
                    yield Input("" if v is None else str(v), id=f"set-{key}")
            yield Static("", classes="error", id="settings-error")
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel")
                yield Button("Save", variant="primary", id="save")

    def _collect(self) -> ChatSettings:
        values = {}
        for key, label, kind, opt in self.FIELDS:
            values[key] = parse_number(self.query_one(f"#set-{key}", Input).value, kind, label, opt)
        return replace(self.settings, system_prompt=self.query_one("#system", TextArea).text, **values)

    def action_save(self) -> None:
        try:
            new = self._collect()
            new.to_options()  # the library's own validation, its one-line message
        except Exception as e:  # noqa: BLE001
            self.query_one("#settings-error", Static).update(str(e))
            return
        self.dismiss(new)
