"""Ctrl+O: the store's models with what is known about them, and what the highlighted one's KV
cache takes with each cache type at the context in use; Enter picks one."""

from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Label, Static

from ..backend import Backend, ModelEntry
from ..model_table import fill_model_table, kv_cost_line
from .base import Dialog

__all__ = ["ModelPickerScreen"]

_TABLE_ROWS = 20  # the table's max-height (header included)


class ModelPickerScreen(Dialog):
    """Dismisses with the picked model's ref, or None."""

    DEFAULT_CSS = """
    ModelPickerScreen .dialog { width: 110; }
    ModelPickerScreen DataTable { height: auto; max-height: 20; }  /* _TABLE_ROWS */
    ModelPickerScreen #picker-kv { height: auto; margin-top: 1; }
    """

    def __init__(self, backend: Backend, current: str | None, kv_types: tuple[str, str] | None = None):
        """`kv_types`: the chat's (K, V) cache types, for the 'Fits RAM' column and the KV line."""
        super().__init__()
        self.backend = backend
        self.current = current
        self.kv_types = kv_types
        self.entries: list[ModelEntry] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Pick a model  (Enter: use it, Esc: close)", classes="title")
            yield DataTable(cursor_type="row", zebra_stripes=True, id="models")
            yield Static("", id="picker-kv")
            yield Static("", classes="error", id="picker-error")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.loading = True
        self.load_models()

    @work(thread=True, exclusive=True, exit_on_error=False)
    def load_models(self) -> None:
        try:
            entries = self.backend.list_models(self.kv_types)
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
        fill_model_table(table, entries, _TABLE_ROWS)
        for i, e in enumerate(entries):
            if e.ref == self.current:
                table.move_cursor(row=i)
        self._show_kv(table.cursor_row)
        if not entries:
            self.query_one("#picker-error", Static).update("No models in the store.")
        table.focus()

    def _show_kv(self, row: int) -> None:
        """The KV line of the highlighted model."""
        line = kv_cost_line(self.entries[row]) if 0 <= row < len(self.entries) else ""
        self.query_one("#picker-kv", Static).update(line)

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_kv(event.cursor_row)

    @on(DataTable.RowSelected)
    def _picked(self, event: DataTable.RowSelected) -> None:
        self.dismiss(str(event.row_key.value))
