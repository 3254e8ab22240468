"""`edgeinfer chat [MODEL]`: the full-screen terminal chat UI (needs the `tui` extra)."""

from __future__ import annotations

import argparse
import importlib.util

from ._common import INT32_MAX, ctx_type, common_options, int_range, threads_type, THREADS_HELP, add_kv_options, kv_options, add_placement_options, placement_options
from ._common import add_suffix_memory_option
from ._tuned import add_untuned_option, tuned_for

__all__ = ["register"]

MISSING_TEXTUAL = "the chat UI needs textual: pip install 'edgeinfer[tui]'"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        parents=[common_options()],
        help="chat with a model in a full-screen terminal UI",
        description="Open the terminal chat UI: chats saved in the store, model picker, speculation panel, "
        "model management. Without MODEL the last chat opens with its model (a first chat: the default "
        "model); with MODEL a new chat with that model opens, and Ctrl+B goes back to the last chat.",
    )
    p.add_argument("model", nargs="?", help="model of a new chat (store name or .gguf path)")
    p.add_argument("--ctx", type=ctx_type, help="context size in tokens (default: min(model's, 4096))")
    p.add_argument("--threads", type=threads_type, help=THREADS_HELP)
    add_kv_options(p)
    add_placement_options(p, drafts=True)
    add_suffix_memory_option(p, "chat")
    add_untuned_option(p)
    # Not given: the open chat keeps the cache types saved with it (a new chat: f16), or the tuned profile's.
    p.set_defaults(func=chat, kv_type=None)


def _textual_available() -> bool:
    try:
        return importlib.util.find_spec("textual") is not None
    except (ImportError, ValueError):  # ValueError: a blocked or half-imported module
        return False


def chat(args: argparse.Namespace) -> int:
    import edgeinfer

    # The library and the other commands never import textual; this command imports it here only.
    if not _textual_available():
        raise edgeinfer.EdgeInferError(MISSING_TEXTUAL)
    import edgeinfer_tui

    kv = {name: value for name, value in kv_options(args).items() if value is not None}
    if args.model:
        edgeinfer.Store().resolve(args.model)
    tuned = tuned_for(args.model, args.untuned)
    fields = tuned.load_fields({"n_ctx": args.ctx, "n_threads": args.threads, **kv})
    # a wrong type or name is a one-line error before the screen opens
    options = edgeinfer.LoadOptions(**fields, **placement_options(args), suffix_memory=args.suffix_memory).validate()
    tuned_kv = tuned.setup is not None and not kv
    return edgeinfer_tui.run(tuned.model, load_options=options, kv_types=options.kv_types if kv or tuned_kv else None,
                             speculation=tuned.setup.speculate if tuned.setup is not None else None)
