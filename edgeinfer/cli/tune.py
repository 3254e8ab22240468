"""`edgeinfer tune [MODEL]`: the fastest setup of a model for this machine and a workload, within a
quality bound; the table and picture of the trade-off; the choice kept as the model's profile."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ._common import ProgressBar, common_options, duration_type, format_bytes, int_range, print_table, size_type

__all__ = ["register"]


def _budget(text: str) -> float:
    seconds = duration_type("--budget")(text)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    return seconds


def _kld(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip().lower() for part in text.split(",") if part.strip())


def _kv_pairs(text: str) -> tuple[tuple[str, str], ...]:
    from edgeinfer.kv_types import KV_TYPE_NAMES

    out = []
    for part in _names(text):
        k, _, v = part.partition("/")
        v = v or k
        if k not in KV_TYPE_NAMES or v not in KV_TYPE_NAMES:
            raise argparse.ArgumentTypeError(f"{part!r}: cache types are {', '.join(KV_TYPE_NAMES)} (K/V for two)")
        out.append((k, v))
    if not out:
        raise argparse.ArgumentTypeError("give at least one cache type")
    return tuple(out)


def register(sub: argparse._SubParsersAction) -> None:
    import edgeinfer
    from edgeinfer.tune import DEFAULT_BUDGET_S, KV_PAIRS, QUALITY_CHUNKS
    from edgeinfer.tune.space import method_names

    p = sub.add_parser(
        "tune",
        parents=[common_options()],
        help="find the fastest setup of a model for this machine and a workload, within a quality bound",
        description="Search the model's quants (the ladder in the store; --make quantizes more), K and V cache "
        "types, flash attention, threads and speculation, measuring each on a workload (the built-in mix of chat, "
        "code edit, extraction and long context, or --workload FILE), within --max-kld (KLD against the model's "
        "highest-precision rung) and --memory, by successive halving within --budget. Prints the table with the "
        "Pareto frontier (F) and the choice (*), writes the picture (SVG: speed against KLD, memory as marker "
        "size) and keeps the choice as the model's tuned profile: run, chat and serve use it unless a flag "
        "sets a field (--untuned ignores it); show shows it. Ctrl-C keeps what was measured: the next tune "
        "goes on from it.",
    )
    p.add_argument("model", nargs="?", help="store model to tune (default: the default model)")
    p.add_argument("--max-kld", type=_kld, default=edgeinfer.DEFAULT_MAX_KLD,
                   help="quality bound: mean KLD plus two standard errors against the reference (default "
                   f"{edgeinfer.DEFAULT_MAX_KLD}: between Q6_K and Q4_K_M on the ladders measured here, see the README)")
    p.add_argument("--memory", type=size_type("--memory"), metavar="SIZE",
                   help="memory a setup may take, by edgeinfer fit's estimate: e.g. 4G (default: what this machine "
                   "has available now)")
    p.add_argument("--workload", metavar="FILE", help="JSONL prompts, one request a line (default: the built-in mix)")
    p.add_argument("--budget", type=_budget, default=DEFAULT_BUDGET_S, metavar="DURATION",
                   help=f"time for the search: seconds or 30s / 10m / 1h (default {DEFAULT_BUDGET_S / 60:g}m)")
    p.add_argument("--make", nargs="?", const="default", metavar="TYPES",
                   help="quantize missing rungs first (default set, or comma-separated types: Q4_K_S,Q3_K_M); "
                   "it counts against the budget")
    p.add_argument("--methods", type=_names, metavar="M,M",
                   help=f"speculation methods to try (default: all of {', '.join(method_names())})")
    p.add_argument("--kv-types", type=_kv_pairs, metavar="T,K/V",
                   help="cache types to try, K = V or K/V (default: "
                   f"{','.join(k if k == v else f'{k}/{v}' for k, v in KV_PAIRS)})")
    p.add_argument("--exhaustive", action="store_true",
                   help="measure every setup on the whole workload, whatever the budget (slow: for checking the search)")
    p.add_argument("--serve", action="store_true",
                   help="also measure the choice with 2 and 4 parallel slots, for `serve` (as much as the budget "
                   "leaves; a slot count is kept when it serves more tokens a second within twice one request's "
                   "time to first token)")
    p.add_argument("--plot", metavar="FILE.svg", help="also write the picture here (it is kept beside the profile)")
    p.add_argument("--fresh", action="store_true", help="measure again what an earlier tune measured")
    p.add_argument("--quality-chunks", type=int_range(1, 64), default=QUALITY_CHUNKS, metavar="N",
                   help=f"chunks of 512 tokens of the evaluation text each KLD is measured on (default "
                   f"{QUALITY_CHUNKS}; fewer is sooner, with a larger standard error)")
    p.add_argument("--no-save", action="store_true", help="do not keep the choice as the model's profile")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import edgeinfer
    from edgeinfer.tune import DEFAULT_MAKE_TYPES, KV_PAIRS
    from edgeinfer.tune.pareto import TABLE_HEADER
    from edgeinfer.tune.tuner import TuneInterrupted

    if args.plot is not None and not args.plot.lower().endswith(".svg"):
        raise edgeinfer.InvalidOptionError(f"--plot {args.plot}: the picture is written as SVG (give a .svg name)")
    make: bool | tuple[str, ...] = False
    if args.make is not None:
        make = DEFAULT_MAKE_TYPES if args.make == "default" else tuple(t.upper() for t in _names(args.make))
    bar = ProgressBar("tune", None)
    tty = sys.stderr.isatty()
    last_stage = [""]

    def progress(e) -> None:  # noqa: ANN001 - edgeinfer.TuneProgress
        best = f" | best: {e.best}" if e.best else ""
        if tty:
            bar.update(min(e.elapsed_s, e.budget_s), e.budget_s, label=f"tune {e.stage}: {e.message[:60]}{best}")
        elif e.stage != last_stage[0] or e.done < e.total or e.stage in ("quality", "ladder", "measure"):
            print(f"edgeinfer: tune: {e.message}{best}", file=sys.stderr, flush=True)
        last_stage[0] = e.stage

    try:
        result = edgeinfer.tune(args.model, max_kld=args.max_kld, memory=args.memory, workload=args.workload,
                                budget=args.budget, progress=progress, make=make, exhaustive=args.exhaustive,
                                serve=args.serve,
                                methods=args.methods, kv_pairs=args.kv_types or KV_PAIRS, save=not args.no_save,
                                fresh=args.fresh, quality_chunks=args.quality_chunks)
    except TuneInterrupted as e:
        bar.close()
        again = f"edgeinfer tune {args.model}" if args.model else "edgeinfer tune"
        print(f"edgeinfer: interrupted: {e.kept} measurement{'s' if e.kept != 1 else ''} kept in the store; "
              f"`{again}` goes on from them", file=sys.stderr)
        return 130
    finally:
        if tty:
            bar.close()
    if args.plot is not None:
        from edgeinfer.tune import svg

        Path(args.plot).write_text(svg(result.rows, title=f"{result.model}: speed against KLD", max_kld=result.max_kld),
                                   encoding="utf-8")
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    _report(result, TABLE_HEADER, args.plot)
    return 0


def _report(result, header: list[str], plot: str | None) -> None:  # noqa: ANN001 - an edgeinfer.TuneResult
    print_table(result.table(), header)
    c = result.choice
    m = c.measurement
    vs = ""
    if result.speedup is not None:
        vs = f" ({result.speedup:.2f}× the untuned defaults' {result.baseline.measurement.tok_s:.1f})"
    print(f"\nchose  {c.setup.label(short_model=False)}")
    print(f"       {m.tok_s:.1f} tok/s on the {result.workload.name} workload{vs}, time to first token "
          f"{m.ttft_s:.2f} s, KLD {c.kld:.4f} ± {c.kld_err:.4f} (max {result.max_kld:g}, against {result.reference}), "
          f"{format_bytes(c.memory)}")
    for run in result.serve_runs:
        mark = "*" if result.serve == run else " "
        print(f"serve {mark} {run.parallel} slots, context {run.ctx}: {run.tok_s:.1f} tok/s in all, time to first "
              f"token {run.ttft_s:.2f} s")
    if result.serve_runs and result.serve is None:
        print("serve   one slot: more did not serve more within twice its time to first token")
    if result.profile_path is not None:
        print(f"saved  as the tuned profile of {result.model}: run, chat and serve use it (--untuned ignores it)")
    pictures = [str(p) for p in (result.plot_path, plot) if p]
    if pictures:
        print(f"plot   {', '.join(pictures)}")
    minutes, seconds = divmod(int(result.elapsed_s), 60)
    budget = "no budget (exhaustive)" if result.exhaustive else f"a {result.budget_s / 60:g}-minute budget"
    print(f"took   {minutes}m{seconds:02d}s of {budget}; {len(result.rows)} setups measured"
          f"{f', {result.reused} measurements reused' if result.reused else ''}")
    for note in result.notes:
        print(f"note   {note}")
