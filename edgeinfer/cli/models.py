"""`edgeinfer list`, `show MODEL`, `rm MODEL`: the model store."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ._common import common_options, format_bytes, print_table

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", aliases=["ls"], parents=[common_options()], help="list the models in the store")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=list_models)

    p = sub.add_parser("show", parents=[common_options()], help="show a model's manifest and file facts")
    p.add_argument("model", nargs="?", help="store name or .gguf path (default: the default model)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=show_model)

    p = sub.add_parser("rm", parents=[common_options()], help="remove a model from the store")
    p.add_argument("models", nargs="+", metavar="MODEL")
    p.add_argument("--purge", "--purge-cache", dest="purge", action="store_true",
                   help="also delete the Hugging Face cache files it came from and leftovers of interrupted runs in "
                   "its folder; for the default model (which cannot be removed): forget its manifest and metrics")
    p.set_defaults(func=remove_models)


def _source(m) -> str:
    src = m.source or {}
    kind = src.get("kind", "")
    if kind == "hub":
        return f"hf:{src.get('repo', '?')}"
    if kind == "package":
        return f"pkg:{src.get('package', '?')}"
    if kind == "import":
        return f"import:{os.path.basename(str(src.get('path', '?')))}"
    if m.derived_from:
        return f"{kind or 'from'}:{m.derived_from}"
    return kind or "-"


def list_models(args: argparse.Namespace) -> int:
    import edgeinfer

    models, damaged = edgeinfer.Store().scan()
    for problem in damaged:  # one line each, never a traceback, never silently hidden
        print(f"edgeinfer: warning: skipped {problem}", file=sys.stderr)
    if args.json:
        print(json.dumps([json.loads(m.to_json()) for m in models], indent=2))
        return 0
    if not models:
        print("no models yet: pip install 'edgeinfer[default-model]', or `edgeinfer pull REPO`", file=sys.stderr)
        return 0
    rows = []
    for m in models:
        ev = m.metrics.get("eval", {}) if m.metrics else {}
        bench = m.metrics.get("bench", {}) if m.metrics else {}
        kld = ev.get("kld")
        tps = bench.get("decode_tok_s")
        rows.append([
            m.ref,
            m.quant or "-",
            format_bytes(m.size),
            f"{m.bits_per_weight:.2f}",
            f"{m.parameters / 1e6:.0f}M",
            str(m.context_length or "-"),
            f"{kld:.4f}" if isinstance(kld, (int, float)) else "-",
            f"{tps:.1f}" if isinstance(tps, (int, float)) else "-",
            _source(m),
        ])
    print_table(rows, ["NAME", "QUANT", "SIZE", "BPW", "PARAMS", "CTX", "KLD", "TOK/S", "SOURCE"])
    return 0


def show_model(args: argparse.Namespace) -> int:
    import edgeinfer

    store = edgeinfer.Store()
    path, manifest = store.resolve(args.model)
    info = edgeinfer.read_gguf(path)
    data = json.loads(manifest.to_json()) if manifest else {"file": str(path)}
    data["gguf"] = {
        "architecture": info.architecture,
        "name": info.model_name,
        "file_type": info.file_type,
        "bits_per_weight": round(info.bits_per_weight, 4),
        "parameters": info.parameter_count,
        "context_length": info.context_length,
        "tensor_types": info.type_counts(),
        "size": info.file_size,
    }
    status = edgeinfer.tuned_status(store, manifest)
    if status.profile is not None or status.reason is not None:
        data["tuned"] = _tuned_fields(status)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    _print_fields(data)
    if status.profile is not None and status.profile.rows:
        from edgeinfer.tune.pareto import TABLE_HEADER, table_rows

        print("tuned frontier (* the choice; `edgeinfer tune` measured them):")
        print_table(table_rows(status.profile.rows, frontier_only=True), TABLE_HEADER)
    return 0


def _tuned_fields(status) -> dict:  # noqa: ANN001 - an edgeinfer.tune.ProfileStatus
    """The tuned profile as `show` prints it: what runs, what it was measured at, whether it is used."""
    p = status.profile
    if p is None:
        return {"status": f"not used: {status.reason}"}
    used = "used by run, chat and serve (--untuned ignores it)" if status.usable else f"not used: {status.reason}"
    return {"status": used, "setup": p.setup.label(short_model=False), "tok_s": round(p.predicted.get("tok_s", 0.0), 2),
            "speedup": round(p.predicted.get("speedup", 0.0), 3) or None, "kld": round(p.predicted.get("kld", 0.0), 5),
            "max_kld": p.max_kld, "reference": p.reference, "workload": p.workload.get("name"),
            "memory": format_bytes(p.predicted.get("memory", 0)), "created": p.created}


def _print_fields(data: dict, indent: str = "") -> None:
    """`key: value` lines; empty values (None, "", {}, []) are left out rather than printed as such."""
    for key, value in data.items():
        if value is None or value == "" or value == {} or value == []:
            continue
        if isinstance(value, dict):
            print(f"{indent}{key}:")
            _print_fields(value, indent + "  ")
        else:
            print(f"{indent}{key}: {value}")


def remove_models(args: argparse.Namespace) -> int:
    import edgeinfer
    from edgeinfer.store import DEFAULT_MODEL, ManifestError

    store = edgeinfer.Store()
    for ref in args.models:
        try:
            manifest = store.get(ref)
        except ManifestError as e:  # nothing in it can be trusted: only the manifest goes
            store.remove(ref)
            print(f"removed the damaged manifest {e.path}")
            continue
        if manifest.ref == DEFAULT_MODEL:
            store.remove(ref, purge=args.purge)  # refuses without --purge
            print(f"forgot the manifest and metrics of {manifest.ref} (the default model stays available)")
            continue
        if args.purge:
            edgeinfer.purge_cache(manifest)
        store.remove(ref)
        if not manifest.owned:
            kept = " (file kept: the store does not own it)"
        elif manifest.path.exists():
            kept = " (file kept: see the warning above)"
        else:
            kept = ""
        print(f"removed {manifest.ref}{kept}")
        if args.purge:
            for g in store.collect_garbage(names=[manifest.name]):
                print(f"removed {g.kind} file {g.path} ({format_bytes(g.size)})")
    return 0
