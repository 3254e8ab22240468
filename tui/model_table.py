"""How a list of models reads in a table: the model picker and the manage screen show the same rows."""

from __future__ import annotations

from .backend import ModelEntry
from .settings import kv_label

__all__ = ["MODEL_COLUMNS", "model_rows", "format_size", "format_optional", "format_mib", "kv_cost_line"]

MODEL_COLUMNS = ("Model", "Quant", "Size", "Bits/w", "KLD", "Same-top", "tok/s", "Fits RAM")


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
