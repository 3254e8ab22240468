"""`edgeinfer gc`: delete files in the store that nothing uses."""

from __future__ import annotations

import argparse

from ._common import common_options, format_bytes

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gc",
        parents=[common_options()],
        help="delete files in the store nothing uses (partial writes of interrupted runs, unregistered model files)",
        description="Delete the store's leftovers: partial files (*.partial) of a convert or quantize that was "
        "killed, and model files in the store's models folder that no manifest names. Files of a run that is "
        "still writing, and files newer than this command, are never touched. `edgeinfer du` lists them.",
    )
    p.add_argument("-n", "--dry-run", action="store_true", help="only list what would be deleted")
    p.set_defaults(func=run_gc)


def run_gc(args: argparse.Namespace) -> int:
    import edgeinfer

    store = edgeinfer.Store()
    items = store.garbage() if args.dry_run else store.collect_garbage()
    verb = "would remove" if args.dry_run else "removed"
    for g in items:
        print(f"{verb} {g.kind:<7} {format_bytes(g.size):>9}  {g.path}")
    if not items:
        print("nothing to collect")
    else:
        print(f"{verb} {len(items)} file(s), {format_bytes(sum(g.size for g in items))}")
    return 0
