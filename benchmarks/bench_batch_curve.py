"""The batch curve that bounds speculation on this CPU, measured two ways at several context depths.

Speculative decoding verifies k drafted tokens in one decode of k + 1 rows; what that costs in
one-token steps decides whether (and how long) drafts pay. Two measurements, side by side:

- llama.cpp's own `llama-bench -p B -n 0 -d DEPTH` (tokens/s of a B-token prompt batch after
  DEPTH tokens of context; logits for the last row only), built by benchmarks/build_llama_tools.sh;
- edgeinfer's runtime decoding B rows with logits for every row, as verification does (the
  output projection per row makes this curve steeper than llama-bench's on large vocabularies).

Sizes alternate within each round and the table reports medians; the machine's load average is
printed next to it (on a shared machine read ratios, not absolute numbers). From the curve, the
"ceiling" is the best speed-up of drafting a fixed k at a per-token acceptance a:
max_k (1 + a + … + a^k) / cost(k + 1).

    .venv/bin/python -m benchmarks.bench_batch_curve [--model PATH | --pair] [--depths 0,800]
        [--sizes 1,2,3,4,5,8,9,16,17,32,33] [--rounds 3] [--threads 2] [--no-llama-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

TOOLS = Path(os.environ.get("EDGEINFER_LLAMA_TOOLS") or Path.home() / ".cache" / "edgeinfer-llama-tools") / "bin"
SIZES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33)


def llama_bench(model: str, sizes: list[int], depth: int, threads: int) -> dict[int, float]:
    """Seconds per B-token batch from one llama-bench run (one repetition of each size)."""
    cmd = [str(TOOLS / "llama-bench"), "-m", model, "-p", ",".join(map(str, sizes)), "-n", "0", "-d", str(depth),
           "-t", str(threads), "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {int(r["n_prompt"]): int(r["n_prompt"]) / float(r["avg_ts"]) for r in json.loads(out)}


def engine_curve(engine, sizes: list[int], depth: int) -> dict[int, float]:
    """Seconds per B-row decode (logits for every row) after `depth` tokens, one repetition."""
    seq = engine._scheduler.slots[0].seq  # the engine's own sequence, driven by hand
    filler = engine.tokenize("def f(x):\n    return x * 2\n" * 200, add_special=False)
    if len(seq) != depth:
        engine.reset()
        seq.decode_all(filler[:depth] if depth else [])
    out = {}
    for b in sizes:
        t0 = time.perf_counter()
        seq.decode(filler[depth : depth + b], logits_from=0)
        out[b] = time.perf_counter() - t0
        seq.truncate(depth)
    return out


def ceiling(seconds: dict[int, float], acceptance: float) -> tuple[float, int]:
    """(speed-up, k) of the best fixed draft length at per-token `acceptance`."""
    best, best_k = 1.0, 0
    for b, t in seconds.items():
        k = b - 1
        if k >= 1:
            gain = sum(acceptance**i for i in range(b)) * seconds[1] / t
            if gain > best:
                best, best_k = gain, k
    return best, best_k


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="GGUF path (default: the real Qwen2.5-Coder-1.5B target)")
    ap.add_argument("--depths", default="0,800")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-bench", action="store_true")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import edgeinfer

    if args.model:
        model = args.model
    else:
        from tests.real_models import qwen_pair

        model = str(qwen_pair()[0])
    sizes = [int(s) for s in args.sizes.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    use_bench = not args.no_llama_bench and (TOOLS / "llama-bench").exists()
    engine = None if args.no_engine else edgeinfer.load(model, n_ctx=max(depths) + max(sizes) + 64,
                                                         n_threads=args.threads, flash_attn=False)
    load_before = os.getloadavg()
    runs: dict[tuple[str, int], dict[int, list[float]]] = {}
    for _ in range(args.rounds):
        for depth in depths:  # alternate depths and tools within each round
            if use_bench:
                for b, s in llama_bench(model, sizes, depth, args.threads).items():
                    runs.setdefault(("llama-bench", depth), {}).setdefault(b, []).append(s)
            if engine is not None:
                for b, s in engine_curve(engine, sizes, depth).items():
                    runs.setdefault(("edgeinfer", depth), {}).setdefault(b, []).append(s)
    load_after = os.getloadavg()
    if engine is not None:
        engine.close()
    table = []
    for (tool, depth), per_b in runs.items():
        med = {b: statistics.median(v) for b, v in per_b.items()}
        row = {"tool": tool, "depth": depth, "tok_s": {b: round(b / s, 1) for b, s in med.items()},
               "cost": {b: round(s / med[1], 2) for b, s in med.items()}}
        for a in (0.8, 0.9, 0.97):
            row[f"ceiling@{a}"] = [round(x, 2) for x in ceiling(med, a)]
        table.append(row)
    if args.json:
        print(json.dumps({"model": model, "threads": args.threads, "rounds": args.rounds,
                          "loadavg": [load_before, load_after], "rows": table}, indent=1))
        return
    print(f"{Path(model).name}, {args.threads} threads, median of {args.rounds} alternating rounds; "
          f"load average (1/5/15 min) {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f} before, "
          f"{load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} after")
    print(f"{'tool':11} {'depth':>5} " + " ".join(f"{b:>6}" for b in sizes))
    for r in table:
        print(f"{r['tool']:11} {r['depth']:5d} " + " ".join(f"{r['tok_s'][b]:6.1f}" for b in sizes) + "  tok/s")
        print(f"{'':11} {'':5} " + " ".join(f"{r['cost'][b]:6.2f}" for b in sizes) + "  × one-token step")
        print(f"{'':11} {'':5} ceiling (speed-up, k) at acceptance 0.8 {r['ceiling@0.8']}, 0.9 {r['ceiling@0.9']}, "
              f"0.97 {r['ceiling@0.97']}")


if __name__ == "__main__":
    main()
