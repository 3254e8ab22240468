"""`edgeinfer import PATH [--name NAME[:TAG]]`: a GGUF file you already have, into the store."""

from __future__ import annotations

import argparse
import sys

from ._common import ProgressBar, common_options, format_bytes

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import",
        parents=[common_options()],
        help="copy a GGUF file you already have into the store, under a name",
        description="Validate a .gguf file as every store model is validated, copy it into the store (a "
        "copy-on-write clone where the file system has one, else a copy: the store never depends on the "
        "original) and register it, so that list, show, fit, recommend, eval, the chat's model picker and "
        "the server's /v1/models see it. The name defaults to the file name without its quant, the tag to "
        "the quant (Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf → qwen2.5-coder-1.5b-instruct:q4_k_m).",
    )
    p.add_argument("path", metavar="PATH", help="the .gguf file")
    p.add_argument("--name", metavar="NAME[:TAG]", help="store name (lowercase letters, digits, '.', '_', '-'), "
                   "optionally with a tag (default tag: the file's quant)")
    p.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    import edgeinfer

    bar: ProgressBar | None = None

    def on_progress(ev) -> None:  # noqa: ANN001 - an ImportProgress
        nonlocal bar
        if bar is None:
            bar = ProgressBar("copying", ev.total, unit="B")
        bar.update(ev.done, ev.total)

    try:
        try:
            result = edgeinfer.import_gguf(args.path, args.name, on_progress=on_progress)
        finally:
            if bar is not None:
                bar.close()
    except (KeyboardInterrupt, edgeinfer.Cancelled):
        print("edgeinfer: import interrupted; nothing was registered", file=sys.stderr)
        return 130
    m = result.manifest
    how = "cloned (copy-on-write)" if result.method == "clone" else "copied"
    print(f"imported {args.path} as {m.ref}: {format_bytes(m.size)}, {m.quant or '?'}, {m.bits_per_weight:.2f} "
          f"bits/weight; {how} into the store in {result.seconds:.1f}s", file=sys.stderr)
    print(m.ref)
    return 0
