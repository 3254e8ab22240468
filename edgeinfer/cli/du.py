"""`edgeinfer du`: disk used by each model — its files in the store and the HF cache files it references."""

from __future__ import annotations

import argparse

from ._common import common_options, format_bytes, print_table

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "du",
        parents=[common_options()],
        help="show disk use of the store and of the Hugging Face cache files models came from",
        description="Per model: bytes of files the store owns, and bytes of Hugging Face cache files it "
        "references (pulled GGUFs live only there; converted models keep their safetensors there). "
        "Cache files shared by several models are counted once in the total.",
    )
    p.set_defaults(func=run_du)


def run_du(args: argparse.Namespace) -> int:
    import edgeinfer

    du = edgeinfer.disk_usage()
    rows = [
        [r.ref, format_bytes(r.store_bytes) if r.store_bytes else "-", format_bytes(r.cache_bytes) if r.cache_files else "-", str(r.cache_files)]
        for r in du.rows
    ]
    print_table(rows, ["MODEL", "STORE", "HF CACHE", "CACHE FILES"])
    print()
    print(f"store:    {format_bytes(du.store_bytes)} in {du.store_dir}")
    print(f"HF cache: {format_bytes(du.cache_bytes)} referenced, in {du.cache_dir}")
    unused = edgeinfer.Store().garbage()  # leftovers of killed runs: counted, shown, `gc` deletes them
    if unused:
        print(f"unused:   {format_bytes(sum(g.size for g in unused))} in {len(unused)} file(s) no model uses "
              "(`edgeinfer gc` deletes them)")
        for g in unused:
            print(f"  {g.kind:<7} {format_bytes(g.size):>9}  {g.path}")
    return 0
