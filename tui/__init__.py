"""edgeinfer terminal chat UI (installed as `edgeinfer_tui`): `edgeinfer chat [MODEL]`.

The UI talks to the library only through `edgeinfer`'s public API (see `backend.py`); the library
never imports this package or textual.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EdgeInferApp", "run"]


def __getattr__(name: str):
    if name == "EdgeInferApp":  # lazy: importing the package does not import textual
        from .app import EdgeInferApp

        return EdgeInferApp
    raise AttributeError(name)


def run(
    model: str | None = None,
    *,
    db_path: Path | None = None,
    load_options=None,
    kv_types: tuple[str, str] | None = None,
    speculation: str | None = None,
) -> int:
    """Run the chat app in this terminal; returns an exit code. `load_options`: context and
    threads of every load; `kv_types`: the (K, V) cache types the open chat starts with (None: the
    types saved with it); `speculation` (the CLI form, e.g. "lookup": a tuned profile's) the
    speculation of the open chat and of new chats (None: the chat's own)."""
    from .app import EdgeInferApp
    from .backend import LibraryBackend

    app = EdgeInferApp(LibraryBackend(load_options), model=model, kv_types=kv_types, db_path=db_path,
                       speculation=speculation)
    app.run()
    return int(app.return_code or 0)
