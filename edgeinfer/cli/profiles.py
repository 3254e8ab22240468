"""`edgeinfer profiles`: the quant profiles (shipped and the user's) with what each is for."""

from __future__ import annotations

import argparse

from ._common import common_options, print_table

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profiles",
        parents=[common_options()],
        help="list the quant profiles (named quantization recipes)",
        description="List the quant profiles: the shipped ones and your own TOML files in the profiles "
        "folder of the store (same name replaces a shipped one). Use one with `edgeinfer quantize --profile NAME`.",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgeinfer.paths import profiles_dir
    from edgeinfer.profiles import load_profiles

    rows = []
    for p in load_profiles().values():
        extras = []
        if p.output_type:
            extras.append(f"output {p.output_type}")
        if p.embedding_type:
            extras.append(f"embedding {p.embedding_type}")
        if p.overrides:
            extras.append(f"{len(p.overrides)} overrides")
        rows.append([p.name, p.weights, ", ".join(extras) or "-", p.kv_type, "" if p.builtin else "user", p.use_when])
    print_table(rows, ["profile", "weights", "extras", "kv", "from", "use it when"])
    print(f"\nyour own profiles: {profiles_dir()}/*.toml")
    return 0
