"""The manage screen: the store's models (delete), the quality ladder of a model (table + bars),
and pull / convert / quantize / imatrix / evaluate with progress bars.

A task's tab opens with its first field focused; Enter in a field starts the task."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from rich.text import Text
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message as TMessage
from textual.screen import Screen
from textual.widgets import (
    Button,
    DataTable,
    Footer,
    Header,
    Input,
    Label,
    ProgressBar,
    Select,
    Static,
    TabbedContent,
    TabPane,
    Tabs,
)

from edgeinfer import Cancelled
from edgeinfer.fit import member_label
from edgeinfer.hub import DEFAULT_QUANT

from .backend import CANCELLABLE_TASKS, Backend, ModelEntry, TaskProgress, one_line
from .modals.confirm import ConfirmScreen
from .model_table import fill_model_table, format_optional, format_size

__all__ = ["ManageScreen", "ladder_chart", "TASKS"]

_TABLE_ROWS = 16  # the models table's max-height (header included)

# kind -> (tab title, [(arg, label, placeholder)], hint)
TASKS: dict[str, tuple[str, list[tuple[str, str, str]], str]] = {
    "pull": ("Pull", [("source", "Repository", "bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M")], "Download from the Hugging Face Hub (resumable, verified)."),
    "import": (
        "Import",
        [("source", "GGUF file", "~/Downloads/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"),
         ("name", "Name (optional)", "qwen2.5-coder-1.5b-instruct (default: from the file name)")],
        "A .gguf file on this machine: validated, copied into the store, listed under a name.",
    ),
    "convert": (
        "Convert",
        [("source", "HF model folder", "./SmolLM2-360M-Instruct"), ("outtype", "Out type", "f16 (or f32, bf16, q8_0)")],
        "Safetensors → GGUF, into the store.",
    ),
    "quantize": (
        "Quantize",
        [("source", "Model", "smollm2-135m-instruct:f16"), ("qtype", "Quant type", DEFAULT_QUANT)],
        "k-quants (Q2_K..Q8_0), i-quants (IQ1_S..IQ4_XS: with the model's importance matrix, computed first where "
        "needed) and FP4 (NVFP4, MXFP4) through llama.cpp's quantizer; progress per tensor.",
    ),
    "imatrix": (
        "Imatrix",
        [("source", "Model", "smollm2-135m-instruct:f16")],
        "The importance matrix the i-quants use, from the calibration text shipped with edgeinfer; kept with "
        "the model, where Quantize finds it.",
    ),
    "evaluate": (
        "Evaluate",
        [("source", "Model", "smollm2-135m-instruct:q4_k_m")],
        "Perplexity, KLD and same-top % against the full-precision model it was derived from; "
        "saved in the model's manifest and shown in the quality ladder.",
    ),
}


def _bar(value: float, vmax: float, width: int) -> str:
    if vmax <= 0:
        return ""
    cells = value / vmax * width
    full = int(cells)
    frac = cells - full
    eighths = " ▏▎▍▌▋▊▉"
    return "█" * full + (eighths[int(frac * 8)] if full < width and frac > 0 else "")


def _label(e: ModelEntry) -> str:
    """A ladder member's name: its quant, or its tag where that says more (`IQ3_S-NOIMAT`)."""
    return member_label(e.quant, e.ref.partition(":")[2]) if ":" in e.ref else (e.quant or e.ref)


def ladder_chart(entries: list[ModelEntry], width: int = 40) -> Text:
    """Horizontal bars of KLD and size per quant (text, so it works in any terminal)."""
    out = Text()
    label_w = max((len(_label(e)) for e in entries), default=4) + 2
    with_kld = [e for e in entries if e.kld is not None]
    out.append("KLD vs reference (lower is better)\n", style="bold")
    if not with_kld:
        out.append("  not measured yet: run `edgeinfer eval` on these models\n", style="dim")
    kmax = max((e.kld or 0 for e in with_kld), default=0)
    for e in with_kld:
        out.append(f"  {_label(e):<{label_w}}")
        out.append(_bar(e.kld or 0, kmax, width), style="magenta")
        out.append(f" {e.kld:.4f}\n")
    out.append("Size\n", style="bold")
    smax = max((e.size for e in entries), default=0)
    for e in entries:
        out.append(f"  {_label(e):<{label_w}}")
        out.append(_bar(e.size, smax, width), style="cyan")
        bpw = f", {e.bits_per_weight:.2f} bits/w" if e.bits_per_weight else ""
        out.append(f" {format_size(e.size)}{bpw}\n")
    return out


class TaskUpdate(TMessage):
    def __init__(self, kind: str, progress: TaskProgress | None = None, result: str | None = None, error: str | None = None):
        super().__init__()
        self.kind, self.progress, self.result, self.error = kind, progress, result, error


class ManageScreen(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back"), Binding("ctrl+l", "app.pop_screen", "Back", show=False)]
    DEFAULT_CSS = """
    ManageScreen TabbedContent { height: 1fr; }
    ManageScreen DataTable { height: auto; max-height: 16; }  /* _TABLE_ROWS */
    ManageScreen .row { height: auto; margin: 1 0 0 0; }
    ManageScreen .row Label { width: 18; padding-top: 1; }
    ManageScreen .row Input { width: 1fr; }
    ManageScreen .hint { color: $text-muted; }
    ManageScreen .result { margin-top: 1; height: auto; }
    ManageScreen .bars { height: auto; }
    ManageScreen #ladder-chart { margin-top: 1; height: auto; }
    ManageScreen #tuned-plot { margin-top: 1; height: auto; }
    """

    def __init__(self, backend: Backend):
        super().__init__(id="manage-screen")
        self.backend = backend
        self.entries: list[ModelEntry] = []
        self._bars: dict[str, dict[str, ProgressBar]] = defaultdict(dict)
        self._bar_labels: dict[str, dict[str, Label]] = defaultdict(dict)
        self._last_post: dict[str, float] = {}
        self._cancel: dict[str, threading.Event] = {}

    def compose(self) -> ComposeResult:
        yield Header()
        with TabbedContent(id="manage-tabs"):
            with TabPane("Models", id="tab-models"):
                yield DataTable(cursor_type="row", zebra_stripes=True, id="manage-models")
                with Horizontal(classes="row"):
                    yield Button("Delete selected model", variant="error", id="delete-model")
                    yield Button("Refresh", id="refresh-models")
                yield Static("", classes="result", id="models-result")
            with TabPane("Quality ladder", id="tab-ladder"):
                yield Select([], prompt="Model name", id="ladder-name")
                yield DataTable(zebra_stripes=True, id="ladder-table")
                yield Static("", id="ladder-chart")
                yield Static("", id="tuned-plot")
            for kind, (title, fields, hint) in TASKS.items():
                with TabPane(title, id=f"tab-{kind}"):
                    with VerticalScroll():
                        yield Static(hint, classes="hint")
                        for arg, label, placeholder in fields:
                            with Horizontal(classes="row"):
                                yield Label(label)
                                yield Input(placeholder=placeholder, id=f"{kind}-{arg}")
                        with Horizontal(classes="row"):
                            yield Button(f"Start {title.lower()}", variant="primary", id=f"start-{kind}")
                            yield Button("Cancel", id=f"cancel-{kind}", disabled=True)
                        yield Vertical(classes="bars", id=f"{kind}-bars")
                        yield Static("", classes="result", id=f"{kind}-result")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#ladder-table", DataTable).add_columns("Quant", "Bits/w", "Size", "PPL", "KLD", "Same-top", "tok/s")
        self.refresh_models()

    # -- models ----------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, exit_on_error=False, group="models")
    def refresh_models(self) -> None:
        try:
            entries = self.backend.list_models()
        except Exception as e:  # noqa: BLE001
            self.app.call_from_thread(self.app.notify, str(e), severity="error")
            return
        self.app.call_from_thread(self._fill_models, entries)

    def _fill_models(self, entries: list[ModelEntry]) -> None:
        self.entries = entries
        self._fill_table()
        names = sorted({e.name or e.ref.split(":")[0] for e in entries})
        select = self.query_one("#ladder-name", Select)
        current = select.value
        select.set_options([(n, n) for n in names])
        if current in names:
            select.value = current
        elif names:
            select.value = names[0]

    def _fill_table(self) -> None:
        """The models table, as wide as the screen (the names give way, not the columns after them)."""
        fill_model_table(self.query_one("#manage-models", DataTable), self.entries, _TABLE_ROWS)

    def on_resize(self, event: events.Resize) -> None:
        if self.entries:
            self._fill_table()

    @on(Button.Pressed, "#refresh-models")
    def _refresh(self) -> None:
        self.refresh_models()

    @on(Button.Pressed, "#delete-model")
    def _delete(self) -> None:
        table = self.query_one("#manage-models", DataTable)
        if not self.entries or table.cursor_row is None or table.cursor_row >= len(self.entries):
            return
        ref = self.entries[table.cursor_row].ref

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.delete_model(ref)

        self.app.push_screen(ConfirmScreen(f"Delete the model {ref}? Its file is removed when the store owns it. (y/n)"), confirmed)

    @work(thread=True, exclusive=True, exit_on_error=False, group="delete")
    def delete_model(self, ref: str) -> None:
        try:
            self.backend.remove_model(ref)
        except Exception as e:  # noqa: BLE001
            self.app.call_from_thread(self.app.notify, str(e), severity="error")
            return
        self.app.call_from_thread(self.query_one("#models-result", Static).update, f"Deleted {ref}.")
        self.app.call_from_thread(self.refresh_models)

    # -- ladder ----------------------------------------------------------------------------------
    @on(Select.Changed, "#ladder-name")
    def _ladder(self, event: Select.Changed) -> None:
        name = event.value
        table = self.query_one("#ladder-table", DataTable)
        table.clear()
        if name is Select.NULL:
            self.query_one("#ladder-chart", Static).update("")
            self.query_one("#tuned-plot", Static).update("")
            return
        rungs = [e for e in self.entries if (e.name or e.ref.split(":")[0]) == name]
        rungs.sort(key=lambda e: (e.bits_per_weight or 0.0), reverse=True)

        for e in rungs:
            table.add_row(
                _label(e),
                format_optional(e.bits_per_weight, ".2f"),
                format_size(e.size),
                format_optional(e.ppl, ".3f"),
                format_optional(e.kld, ".4f"),
                "—" if e.same_top is None else f"{e.same_top:.1f} %",
                format_optional(e.tok_s, ".1f"),
            )
        self.query_one("#ladder-chart", Static).update(ladder_chart(rungs))
        tuned = next((e.tuned for e in rungs if e.tuned), None)
        self.query_one("#tuned-plot", Static).update(
            Text(tuned) if tuned else Text(f"not tuned yet: `edgeinfer tune {name}` finds its fastest setup here", style="dim"))

    # -- pull / convert / quantize / evaluate ----------------------------------------------------
    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        kind = (event.pane.id or "").removeprefix("tab-")
        if kind in TASKS:  # type what the task needs at once, no Tab presses
            self.query_one(f"#{kind}-{TASKS[kind][1][0][0]}", Input).focus()

    def on_key(self, event: events.Key) -> None:
        """Text typed right after the arrow that opens a task's tab goes into its first field, in
        the order typed. The tab bar moves on its arrow binding only once the key has passed this
        screen, so the letters that came with the arrow (a terminal delivers a fast typist's keys
        together) reached the old tab and were dropped: the arrows move the tabs here instead."""
        tabbed = self.query_one("#manage-tabs", TabbedContent)
        if self.focused is not tabbed.query_one(Tabs):
            return
        if event.key in ("left", "right"):
            panes = [pane.id for pane in tabbed.query(TabPane)]
            step = 1 if event.key == "right" else -1
            tabbed.active = panes[(panes.index(tabbed.active) + step) % len(panes)]
            event.stop()
            event.prevent_default()
            return
        kind = tabbed.active.removeprefix("tab-")
        if kind in TASKS and event.is_printable and event.character:
            field = self.query_one(f"#{kind}-{TASKS[kind][1][0][0]}", Input)
            field.insert_text_at_cursor(event.character)
            field.focus()
            event.stop()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        kind = (event.input.id or "").partition("-")[0]
        if kind in TASKS:
            self.start_task(kind)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        bid = event.button.id or ""
        if bid.startswith("cancel-"):
            kind = bid.removeprefix("cancel-")
            if kind in self._cancel:
                self._cancel[kind].set()
                self.query_one(f"#{kind}-result", Static).update("cancelling…")
        elif bid.startswith("start-"):
            self.start_task(bid.removeprefix("start-"))

    def start_task(self, kind: str) -> None:
        """Start the task of a tab with what its fields hold (one task of a kind at a time)."""
        start = self.query_one(f"#start-{kind}", Button)
        if start.disabled:
            return
        args = {arg: self.query_one(f"#{kind}-{arg}", Input).value.strip() for arg, _l, _p in TASKS[kind][1]}
        if not args.get("source"):
            self.query_one(f"#{kind}-result", Static).update("Fill in the first field.")
            return
        start.disabled = True
        self.query_one(f"#{kind}-bars", Vertical).remove_children()
        self._bars[kind].clear()
        self._bar_labels[kind].clear()
        self.query_one(f"#{kind}-result", Static).update("running…")
        self._cancel[kind] = threading.Event()
        self.query_one(f"#cancel-{kind}", Button).disabled = kind not in CANCELLABLE_TASKS
        self.run_task(kind, args, self._cancel[kind])

    @work(thread=True, exclusive=True, exit_on_error=False, group="task")
    def run_task(self, kind: str, args: dict[str, str], cancel: threading.Event) -> None:
        def on_progress(p: TaskProgress) -> None:
            # at most ~20 updates a second per bar, plus the last one
            now = time.monotonic()
            last = self._last_post.get(p.key, 0.0)
            if p.message or now - last >= 0.05 or (p.total is not None and p.done >= p.total):
                self._last_post[p.key] = now
                self.post_message(TaskUpdate(kind, progress=p))

        try:
            result = self.backend.run_task(kind, args, on_progress, cancel)
        except Cancelled:  # asked for: not an error (a pull keeps its partial file for a resume)
            self.post_message(TaskUpdate(kind, result=f"{kind}: cancelled"))
            return
        except Exception as e:  # noqa: BLE001 - the library's one-line message
            self.post_message(TaskUpdate(kind, error=one_line(e)))
            return
        self.post_message(TaskUpdate(kind, result=result))

    async def on_task_update(self, message: TaskUpdate) -> None:
        kind = message.kind
        if message.progress is not None:
            p = message.progress
            if p.message:
                self.query_one(f"#{kind}-result", Static).update(p.message)
                return
            bars = self._bars[kind]
            if p.key not in bars:
                bar = ProgressBar(total=p.total, show_eta=kind == "pull")
                bars[p.key] = bar
                self._bar_labels[kind][p.key] = label = Label(p.label or p.key, classes="bar-label")
                await self.query_one(f"#{kind}-bars", Vertical).mount(label, bar)
            bars[p.key].update(total=p.total, progress=p.done)
            if p.label:
                self._bar_labels[kind][p.key].update(p.label)
            return
        self.query_one(f"#start-{kind}", Button).disabled = False
        self.query_one(f"#cancel-{kind}", Button).disabled = True
        self._cancel.pop(kind, None)
        result = self.query_one(f"#{kind}-result", Static)
        if message.error:
            result.update(Text(f"error: {message.error}", style="bold red"))
            self.app.notify(message.error, title=kind.capitalize(), severity="error", timeout=10)
        else:
            result.update(message.result or "done")
            self.refresh_models()

