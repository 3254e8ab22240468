"""How a list of models reads in a table: the model picker and the manage screen show the same rows."""

from __future__ import annotations

from .backend import ModelEntry

__all__ = ["MODEL_COLUMNS", "model_rows", "format_size", "format_optional"]

MODEL_COLUMNS = ("Model", "Quant", "Size", "Bits/w", "KLD", "Same-top", "tok/s", "Fits RAM")


def format_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


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
