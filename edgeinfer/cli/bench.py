"""`edgeinfer bench MODEL...`: prefill and decode tok/s next to this machine's memory-bandwidth roofline."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from edgeinfer.bench import FLASH_DEPTH

from ._common import INT32_MAX, add_placement_options, common_options, format_bytes, int_range, placement_options, print_table, threads_type, THREADS_HELP

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        parents=[common_options()],
        help="prefill and decode speed at batch 1, next to the memory-bandwidth roofline",
        description="Measure prefill and decode tokens/s (batch 1, greedy) for each model, the machine's memory "
        "read bandwidth (numpy), and the roofline = bandwidth ÷ weight bytes read per token. Results are saved "
        "in each store model's manifest.",
    )
    p.add_argument("models", nargs="*", help="store names or .gguf paths (default: the default model)")
    p.add_argument("--prompt-tokens", type=int_range(1, INT32_MAX), default=256, help="prompt length for prefill (default 256)")
    p.add_argument("--decode-tokens", type=int_range(1, INT32_MAX), default=64, help="tokens to decode (default 64)")
    p.add_argument("--repeats", type=int_range(1, 1000), default=2, help="runs per model, best kept (default 2)")
    p.add_argument("--threads", type=threads_type, help=THREADS_HELP)
    add_placement_options(p)
    p.add_argument("--speculation", action="store_true",
                   help="also measure the batch cost curve speculative decoding plans with (two context depths), "
                   "the speed-up ceiling it allows and what a draft model's token may cost; kept in the store")
    p.add_argument("--draft", metavar="MODEL", help="model what this draft model's drafts would buy (implies "
                   "--speculation): its token cost in target steps (measured alternating), the expected speed-up "
                   "of k-token drafts, the acceptance above which it pays")
    p.add_argument("--flash-depth", type=int_range(0, INT32_MAX), default=FLASH_DEPTH, metavar="TOKENS",
                   help=f"time flash attention on and off after this many tokens of context and keep the faster for "
                   f"later loads that leave it unset (default {FLASH_DEPTH}; 0: do not measure)")
    p.add_argument("--save-busy", action="store_true",
                   help="save figures even when the machine was busy (they are marked busy)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgeinfer.bench import bench_many

    models = args.models or [None]
    progress = None if args.json else (lambda e: print(f"… {e.phase} {e.model}".rstrip(), file=sys.stderr, flush=True))
    common = dict(prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, repeats=args.repeats,
                  n_threads=args.threads, save_busy=args.save_busy, placement=placement_options(args),
                  flash_depth=args.flash_depth)
    results = bench_many(models, speculation=args.speculation, draft=args.draft, on_progress=progress, **common)
    if args.json:
        out = [asdict(r) | {"busy": bool(r.load and r.load.busy)} for r in results]
        print(json.dumps(out, indent=2))
        return 0
    bw = results[0].bandwidth_bytes_s if results else 0.0
    rows = [[r.model, f"{r.prefill_tok_s:.1f}", f"{r.decode_tok_s:.1f}", format_bytes(r.bytes_per_token),
             f"{r.roofline_tok_s:.1f}", f"{r.roofline_fraction * 100:.0f}%"] for r in results]
    print_table(rows, ["model", "prefill tok/s", "decode tok/s", "bytes/token", "roofline tok/s", "of roofline"])
    print(f"\nmemory read bandwidth {bw / 1e9:.1f} GB/s (numpy, best of 5); {results[0].n_threads} threads")
    for r in results:
        print(f"{r.model}: layers on {r.backend}")
        if r.flash_attn is not None:
            print(f"{r.model}: {r.flash_attn.summary()}")
    for r in results:
        _print_speculation(r)
        _print_draft(r)
        if r.load is not None:
            note = "" if not r.load.busy else (" — BUSY: other work held the cores; figures not saved"
                                               if not args.save_busy else " — BUSY: saved, marked busy")
            print(f"load average {r.load.before:.2f} before, {r.load.after:.2f} after ({r.load.cpus} CPUs){note}")
    return 0


def _print_speculation(r) -> None:
    s = r.speculation
    if s is None:
        return
    print(f"\n{r.model}: a b-token decode in one-token steps (verifying b − 1 drafted tokens)")
    sizes = list(next(iter(s.cost.values())))
    print_table([[f"depth {d}"] + [f"{c[b]:.2f}" for b in sizes] for d, c in s.cost.items()],
                ["b"] + [str(b) for b in sizes])
    deep = max(s.cost)
    print(f"ceiling at depth {deep}: " + ", ".join(f"{g:.2f}× at acceptance {a:g} (k={k})"
                                                  for a, (g, k) in s.ceiling.items()))
    print("a draft model pays when its token costs less than: "
          + ", ".join(f"{c:.2f} steps above acceptance {a:g}" for a, c in s.draft_break_even.items()))


def _print_draft(r) -> None:
    d = r.draft
    if d is None:
        return
    ks = list(next(iter(d.speedup.values())))
    print(f"\ndraft {d.model}: a drafted token costs {d.cost:.2f} target steps (measured alternating); expected "
          "speed-up of k-token drafts (target's batch curve at the deeper depth)")
    print_table([[f"acceptance {a:g}"] + [f"{x:.2f}×" for x in row.values()] for a, row in d.speedup.items()],
                ["k"] + [str(k) for k in ks])
    print(d.summary())
