"""Modal screens: model picker, chat settings, speculation panel, prompts, help."""

from __future__ import annotations

from dataclasses import replace

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Label, Markdown, Select, Static, Switch, TextArea

from .backend import Backend, ModelEntry
from .config import ACTIONS, INPUT_KEYS, TuiConfig
from .settings import SPECULATION_CHOICES, ChatSettings, SpeculationSettings

__all__ = [
    "ModelPickerScreen",
    "SettingsScreen",
    "SpeculationScreen",
    "PromptScreen",
    "ConfirmScreen",
    "HelpScreen",
    "format_size",
    "model_rows",
]


def format_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


MODEL_COLUMNS = ("Model", "Quant", "Size", "Bits/w", "KLD", "Same-top", "tok/s", "Fits RAM")


def model_rows(entries: list[ModelEntry]) -> list[tuple[str, ...]]:
    return [
        (
            e.ref,
            e.quant or "—",
            format_size(e.size),
            _f(e.bits_per_weight, ".2f"),
            _f(e.kld, ".4f"),
            "—" if e.same_top is None else f"{e.same_top:.1f} %",
            _f(e.tok_s, ".1f"),
            {True: "yes", False: "no", None: "?"}[e.fits],
        )
        for e in entries
    ]


class _Modal(ModalScreen):
    DEFAULT_CSS = """
    _Modal, ModelPickerScreen, SettingsScreen, SpeculationScreen, PromptScreen, ConfirmScreen, HelpScreen {
        align: center middle;
    }
    .dialog {
        width: 90; max-width: 95%; height: auto; max-height: 90%;
        border: thick $primary; background: $surface; padding: 1 2;
    }
    .dialog > .title { text-style: bold; margin-bottom: 1; }
    .dialog .buttons { height: auto; margin-top: 1; align-horizontal: right; }
    .dialog .buttons Button { margin-left: 2; }
    .dialog .field { height: auto; }
    .dialog .field Label { width: 18; padding-top: 1; }
    .dialog .field Input { width: 1fr; }
    .dialog .error { color: $error; height: auto; }
    """
    BINDINGS = [Binding("escape", "dismiss_none", "Close")]

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


class ModelPickerScreen(_Modal):
    """The store's models with what is known about them; Enter picks one."""

    DEFAULT_CSS = """
    ModelPickerScreen .dialog { width: 110; }
    ModelPickerScreen DataTable { height: auto; max-height: 20; }
    """

    def __init__(self, backend: Backend, current: str | None):
        super().__init__()
        self.backend = backend
        self.current = current
        self.entries: list[ModelEntry] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Pick a model  (Enter: use it, Esc: close)", classes="title")
            yield DataTable(cursor_type="row", zebra_stripes=True, id="models")
            yield Static("", classes="error", id="picker-error")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns(*MODEL_COLUMNS)
        table.loading = True
        self.load_models()

    @work(thread=True, exclusive=True, exit_on_error=False)
    def load_models(self) -> None:
        try:
            entries = self.backend.list_models()
        except Exception as e:  # noqa: BLE001 - shown as one line, never a crash
            self.app.call_from_thread(self._show_error, str(e) or type(e).__name__)
            return
        self.app.call_from_thread(self._fill, entries)

    def _show_error(self, msg: str) -> None:
        self.query_one(DataTable).loading = False
        self.query_one("#picker-error", Static).update(msg)

    def _fill(self, entries: list[ModelEntry]) -> None:
        self.entries = entries
        table = self.query_one(DataTable)
        table.loading = False
        for e, row in zip(entries, model_rows(entries)):
            table.add_row(*row, key=e.ref)
        for i, e in enumerate(entries):
            if e.ref == self.current:
                table.move_cursor(row=i)
        if not entries:
            self.query_one("#picker-error", Static).update("No models in the store.")
        table.focus()

    @on(DataTable.RowSelected)
    def _picked(self, event: DataTable.RowSelected) -> None:
        self.dismiss(str(event.row_key.value))


def _num(text: str, kind: type, name: str, optional: bool = False):
    text = text.strip()
    if optional and text == "":
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not {'an integer' if kind is int else 'a number'}") from None


class SettingsScreen(_Modal):
    """System prompt and sampling settings of one chat. Save validates through edgeinfer."""

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
    BINDINGS = [Binding("ctrl+s", "save", "Save", priority=True)]

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
            values[key] = _num(self.query_one(f"#set-{key}", Input).value, kind, label, opt)
        return replace(self.settings, system_prompt=self.query_one("#system", TextArea).text, **values)

    def action_save(self) -> None:
        try:
            new = self._collect()
            new.to_options()  # the library's own validation, its one-line message
        except Exception as e:  # noqa: BLE001
            self.query_one("#settings-error", Static).update(str(e))
            return
        self.dismiss(new)

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class SpeculationScreen(_Modal):
    """Speculative decoding for this chat, and whether drafted tokens are coloured."""

    BINDINGS = [Binding("ctrl+s", "save", "Apply", priority=True)]

    def __init__(self, settings: SpeculationSettings, show_drafted: bool, models: list[str]):
        super().__init__()
        self.settings = settings
        self.show_drafted = show_drafted
        self.models = models

    def compose(self) -> ComposeResult:
        s = self.settings
        draft_options = [(m, m) for m in self.models]
        if s.draft_model and s.draft_model not in self.models:
            draft_options.insert(0, (s.draft_model, s.draft_model))
        with Vertical(classes="dialog"):
            yield Label("Speculative decoding  (Ctrl+S: apply, Esc: cancel)", classes="title")
            with Horizontal(classes="field"):
                yield Label("Method")
                yield Select([(label, m) for m, label in SPECULATION_CHOICES], value=s.method, allow_blank=False, id="spec-method")
            with Horizontal(classes="field"):
                yield Label("Draft model")
                yield Select(draft_options, value=s.draft_model if s.draft_model else Select.NULL, id="spec-draft")
            with Horizontal(classes="field"):
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

    def action_save(self) -> None:
        try:
            draft = self.query_one("#spec-draft", Select).value
            new = SpeculationSettings(
                method=str(self.query_one("#spec-method", Select).value),
                draft_model=None if draft is Select.NULL else str(draft),
                self_quant=self.query_one("#spec-self", Input).value.strip().upper() or "Q3_K_M",
                draft_max=_num(self.query_one("#spec-k", Input).value, int, "Draft length"),
            )
            new.to_options().validate()
        except Exception as e:  # noqa: BLE001
            self.query_one("#spec-error", Static).update(str(e))
            return
        self.dismiss((new, self.query_one("#spec-show", Switch).value))

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class PromptScreen(_Modal):
    """Ask for one line of text (rename a chat)."""

    def __init__(self, title: str, value: str = ""):
        super().__init__()
        self.title_text = title
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="title")
            yield Input(self.value, id="prompt-input")

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)


class ConfirmScreen(_Modal):
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


def help_markdown(config: TuiConfig) -> str:
    def keys(action_id: str) -> str:
        return ", ".join(f"`{k}`" for k in config.key_list(action_id))

    lines = [
        "# edgeinfer chat",
        "",
        "| Keys | Action |",
        "|---|---|",
    ]
    for aid, (_default, text) in INPUT_KEYS.items():
        lines.append(f"| {keys(aid)} | {text} |")
    for a in ACTIONS:
        lines.append(f"| {keys(a.id)} | {a.help} |")
    lines += [
        "| `ctrl+p` | Command palette: every action, themes |",
        "| `ctrl+q` | Quit |",
        "",
        "Keys are remappable in `tui.toml` in the store directory (`[keys]` table, action = \"key,key\").",
    ]
    return "\n".join(lines)


class HelpScreen(_Modal):
    BINDINGS = [Binding("f1", "dismiss_none", "Close")]

    def __init__(self, config: TuiConfig):
        super().__init__()
        self.config = config

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog"):
            yield Markdown(help_markdown(self.config))

