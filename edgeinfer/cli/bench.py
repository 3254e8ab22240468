"""`edgeinfer bench MODEL...`: prefill and decode tok/s next to this machine's memory-bandwidth roofline."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ._common import INT32_MAX, common_options, format_bytes, int_range, print_table, threads_type

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
    p.add_argument("--threads", type=threads_type, help="threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from edgeinfer.bench import bench_many

    models = args.models or [None]
    results = bench_many(models, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                         repeats=args.repeats, n_threads=args.threads,
                         on_progress=None if args.json else
                         (lambda e: print(f"… {e.phase} {e.model}".rstrip(), file=sys.stderr, flush=True)))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return 0
    bw = results[0].bandwidth_bytes_s if results else 0.0
    rows = [[r.model, f"{r.prefill_tok_s:.1f}", f"{r.decode_tok_s:.1f}", format_bytes(r.bytes_per_token),
             f"{r.roofline_tok_s:.1f}", f"{r.roofline_fraction * 100:.0f}%"] for r in results]
    print_table(rows, ["model", "prefill tok/s", "decode tok/s", "bytes/token", "roofline tok/s", "of roofline"])
    print(f"\nmemory read bandwidth {bw / 1e9:.1f} GB/s (numpy, best of 5); {results[0].n_threads} threads")
    return 0
