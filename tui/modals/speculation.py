"""Ctrl+T: speculative decoding for this chat, and whether drafted tokens are coloured. Ctrl+T
(the key that opened it) applies it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Label, Select, Static, Switch

from ..settings import SPECULATION_CHOICES, SpeculationSettings
from .base import FormDialog, parse_number

__all__ = ["SpeculationScreen"]

_MTP_CHOICE = ("mtp", "The model's MTP head")  # listed when the loaded model has an MTP layer (Qwen3.5)


class SpeculationScreen(FormDialog):
    """Dismisses with (SpeculationSettings, colour drafted tokens), or None."""

    AUTO_FOCUS = "#spec-method"

    def __init__(self, settings: SpeculationSettings, show_drafted: bool, models: list[str], *,
                 save_keys: str = "ctrl+t", has_mtp: bool | None = None):
        """`save_keys`: the keys that apply it (the chat's Speculation key, which opened it: never
        the Settings key, Ctrl+S). `has_mtp`: whether to offer the model's MTP head (None: when the
        app's loaded model has one)."""
        super().__init__(save_keys)
        self.settings = settings
        self.show_drafted = show_drafted
        self.models = models
        self.has_mtp = has_mtp

    def _choices(self) -> list[tuple[str, str]]:
        has_mtp = self.has_mtp
        if has_mtp is None:
            loaded = getattr(getattr(self.app, "models", None), "loaded", None)
            has_mtp = bool(getattr(getattr(loaded, "engine", None), "has_mtp", False))
        offered = [*SPECULATION_CHOICES, _MTP_CHOICE] if has_mtp or self.settings.method == "mtp" else SPECULATION_CHOICES
        return [(label, m) for m, label in offered]

    def compose(self) -> ComposeResult:
        s = self.settings
        draft_options = [(m, m) for m in self.models]
        if s.draft_model and s.draft_model not in self.models and s.method != "medusa":
            draft_options.insert(0, (s.draft_model, s.draft_model))
        with Vertical(classes="dialog"):
            yield Label(f"Speculative decoding  ({self.keys_hint.replace('save', 'apply')})", classes="title")
            with Horizontal(classes="field"):
                yield Label("Method")
                yield Select(self._choices(), value=s.method, allow_blank=False, id="spec-method")
            with Horizontal(classes="field"):
                yield Label("Draft model")
                yield Select(draft_options, value=s.draft_model if s.draft_model else Select.NULL, id="spec-draft")
            # Medusa heads are a file, not a model of the store: their row takes the self-draft's place.
            with Horizontal(classes="field", id="spec-heads-row") as row:
                row.display = s.method == "medusa"
                yield Label("Heads file")
                yield Input(s.draft_model if s.method == "medusa" and s.draft_model else "",
                            placeholder="medusa heads .gguf", id="spec-heads")
            with Horizontal(classes="field", id="spec-self-row") as row:
                row.display = s.method != "medusa"
                yield Label("Self-draft quant")
                yield Input(s.self_quant, id="spec-self")
            with Horizontal(classes="field"):
                yield Label("Draft length (max)")
                yield Input(str(s.draft_max), id="spec-k")
            with Horizontal(classes="field"):
                yield Label("Colour drafted")
                yield Switch(self.show_drafted, id="spec-show")
            yield Static(
                "Output is identical with and without speculation; only speed changes. "
                "Auto switches it off where it does not pay.",
                classes="hint",
            )
            yield Static("", classes="error", id="spec-error")
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel")
                yield Button("Apply", variant="primary", id="save")

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "spec-method":
            medusa = event.value == "medusa"
            self.query_one("#spec-heads-row").display = medusa
            self.query_one("#spec-self-row").display = not medusa

    def action_save(self) -> None:
        try:
            method = str(self.query_one("#spec-method", Select).value)
            draft = self.query_one("#spec-draft", Select).value
            if method == "medusa":
                draft = self.query_one("#spec-heads", Input).value.strip() or Select.NULL
            new = SpeculationSettings(
                method=method,
                draft_model=None if draft is Select.NULL else str(draft),
                self_quant=self.query_one("#spec-self", Input).value.strip().upper() or SpeculationSettings.self_quant,
                draft_max=parse_number(self.query_one("#spec-k", Input).value, int, "Draft length"),
            )
            new.to_options().validate()
        except Exception as e:  # noqa: BLE001
            self.query_one("#spec-error", Static).update(str(e))
            return
        self.dismiss((new, self.query_one("#spec-show", Switch).value))
