"""Ctrl+S: the chat's system prompt, sampling settings and KV-cache types. Save validates through
edgeinfer.

The title and the buttons stay in view; the fields between them scroll when the terminal is short
(one row each, so that at 40 rows nothing needs to)."""

from __future__ import annotations

from dataclasses import replace

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Input, Label, Select, Static, TextArea

import edgeinfer
from edgeinfer import DEFAULT_LOAD, KV_TYPE_NAMES

from ..settings import ChatSettings, kv_load_options
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
    KV_FIELDS = (("kv_type_k", "K cache type", 0), ("kv_type_v", "V cache type", 1))
    DEFAULT_CSS = """
    SettingsScreen #settings-fields { height: auto; max-height: 50vh; }
    SettingsScreen #system { height: 5; }
    SettingsScreen .dialog .field > Label { padding: 0 1 0 0; }
    SettingsScreen #set-temperature-row { margin-top: 1; }
    SettingsScreen .dialog .field Input, SettingsScreen .dialog .field Select { width: 30; background: $boost; }
    SettingsScreen .hint { margin-top: 1; color: $text-muted; }
    SettingsScreen #settings-error { display: none; }
    SettingsScreen #settings-error.-shown { display: block; }
    """
    AUTO_FOCUS = "#system"

    def __init__(self, settings: ChatSettings, *, model: str | None = None, save_keys: str = "ctrl+s"):
        """`model`: the chat's model, whose default system prompt an empty box stands for."""
        super().__init__(save_keys)
        self.settings = settings
        self.model = model

    def compose(self) -> ComposeResult:
        s = self.settings
        default = edgeinfer.default_system_prompt(self.model)
        with Vertical(classes="dialog"):
            yield Label(f"Chat settings  ({self.keys_hint})", classes="title", id="settings-title")
            yield Label(
                "System prompt (empty: " + ("this model's default, shown grey)" if default else "none)"),
                id="system-label",
            )
            with VerticalScroll(id="settings-fields"):
                yield TextArea(s.system_prompt, id="system", soft_wrap=True, placeholder=default or "")
                for key, label, _kind, _opt in self.FIELDS:
                    v = getattr(s, key)
                    with Horizontal(classes="field", id=f"set-{key}-row"):
                        yield Label(label)
                        yield Input("" if v is None else str(v), id=f"set-{key}", compact=True)
                for key, label, i in self.KV_FIELDS:
                    value = s.kv_types[i]
                    if value not in KV_TYPE_NAMES:  # a hand-edited database: show the default, saving fixes it
                        value = DEFAULT_LOAD.kv_types[i]
                    with Horizontal(classes="field"):
                        yield Label(label)
                        yield Select([(name, name) for name in KV_TYPE_NAMES], value=value, allow_blank=False,
                                     id=f"set-{key}", compact=True)
                yield Static(
                    "A quantized KV cache (q8_0: about half of f16) leaves room for longer contexts at a small cost "
                    "in accuracy; a quantized V cache turns flash attention on. Changing it reloads the model; "
                    "the model picker shows what each type takes.",
                    classes="hint",
                )
            yield Static("", classes="error", id="settings-error")
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Save", variant="primary", id="save", compact=True)

    def _collect(self) -> ChatSettings:
        values = {}
        for key, label, kind, opt in self.FIELDS:
            values[key] = parse_number(self.query_one(f"#set-{key}", Input).value, kind, label, opt)
        for key, _label, _i in self.KV_FIELDS:
            values[key] = str(self.query_one(f"#set-{key}", Select).value)
        return replace(self.settings, system_prompt=self.query_one("#system", TextArea).text, **values)

    def action_save(self) -> None:
        try:
            new = self._collect()
            new.to_options()  # the library's own validation, its one-line message
            kv_load_options(new.kv_types)  # a cache combination the library refuses
        except Exception as e:  # noqa: BLE001
            error = self.query_one("#settings-error", Static)
            error.update(str(e))
            error.add_class("-shown")
            return
        self.dismiss(new)
