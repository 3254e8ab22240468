"""How a list of models reads in a table: the model picker and the manage screen show the same rows."""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import DataTable

from .backend import ModelEntry
from .settings import kv_label

__all__ = ["MODEL_COLUMNS", "model_rows", "fill_model_table", "format_size", "format_optional", "format_mib",
           "kv_cost_line"]

MODEL_COLUMNS = ("Model", "Quant", "Size", "Bits/w", "KLD", "Same-top", "tok/s", "Fits RAM")
MIN_NAME_WIDTH = 16  # a name shortened to less than this is no use; the table scrolls sideways instead


def format_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def format_mib(n: float) -> str:
    """Bytes in MiB (GiB from 1 GiB on), as llama.cpp reports its KV buffers."""
    mib = n / 2**20
    if mib >= 1024:
        return f"{mib / 1024:.2f} GiB"
    return f"{mib:.1f} MiB" if mib < 10 else f"{mib:.0f} MiB"


def kv_cost_line(e: ModelEntry) -> str:
    """What the KV cache of `e` takes at its context: with the chat's types, and with each type
    (K = V), as edgeinfer.fit estimated them."""
    if e.n_ctx is None or e.kv_cache is None or not e.kv_by_type:
        return f"{e.ref}: KV cache size unknown (the model file could not be read)"
    chat = f"this chat ({kv_label(e.kv_types)}) {format_mib(e.kv_cache)}" if e.kv_types else format_mib(e.kv_cache)
    per_type = " · ".join(f"{name} {format_mib(n)}" for name, n in e.kv_by_type.items())
    return f"KV cache at {e.n_ctx} tokens: {chat}. By type: {per_type}"


def format_optional(v: float | None, fmt: str) -> str:
    """A measured number, or a dash when it was not measured."""
    return "—" if v is None else format(v, fmt)


def model_rows(entries: list[ModelEntry]) -> list[tuple[str, ...]]:
    return [
        (
            e.ref,
            e.quant or "—",
            format_size(e.size),
            format_optional(e.bits_per_weight, ".2f"),
            format_optional(e.kld, ".4f"),
            "—" if e.same_top is None else f"{e.same_top:.1f} %",
            format_optional(e.tok_s, ".1f"),
            {True: "yes", False: "no", None: "?"}[e.fits],
        )
        for e in entries
    ]


def fill_model_table(table: DataTable, entries: list[ModelEntry], max_rows: int) -> None:
    """The rows of `entries` in `table`, no wider than its container: the columns of numbers get
    what they need, the model names the rest (a longer name ends in "…", never the columns after
    it). `max_rows`: the rows the table shows before it scrolls (then its scrollbar takes room too)."""
    rows = model_rows(entries)
    parent = table.parent
    width = (parent.content_region.width if parent is not None else 0) or table.app.size.width
    pad = 2 * table.cell_padding
    others = sum(max(cell_len(h), *(cell_len(r[i]) for r in rows)) + pad for i, h in enumerate(MODEL_COLUMNS) if i)
    if len(rows) + 1 > max_rows:
        width -= table.styles.scrollbar_size_vertical
    longest = max(cell_len(MODEL_COLUMNS[0]), *(cell_len(r[0]) for r in rows))
    table.clear(columns=True)
    table.add_column(MODEL_COLUMNS[0], width=max(MIN_NAME_WIDTH, min(longest, width - others - pad)))
    table.add_columns(*MODEL_COLUMNS[1:])
    for e, row in zip(entries, rows):
        table.add_row(Text(row[0], no_wrap=True, overflow="ellipsis"), *row[1:], key=e.ref)
