"""What a Medusa head costs on this CPU beside the target it drafts for, and whether a token tree
or a chain is the shape that pays here.

Measured, alternating within each round (medians): the target's decode of B rows with logits for
every row after DEPTH tokens of context (verification's shape; benchmarks/bench_batch_curve.py's
`engine_curve`), and one Medusa head of the target's width and vocabulary evaluated in numpy as
engine/speculation/medusa.py does (a residual block and the vocabulary projection in float32, on
one hidden state and on four). No trained Medusa head for this target is reachable here, so the
head's weights are random: its cost does not depend on their values.

From those: a drafted token's cost in target steps (c); the break-even per-position acceptance of
a chain (the least a at which some draft length k beats plain: (1 + a + ... + a^k) / (cost(k + 1) +
k c) > 1); the speed-up bound of a chain whose acceptance matches published Medusa results; and
each extra verification row's marginal cost, which a tree's extra branch must beat with its own
probability (a node adds its path's probability in expected tokens, and costs a row).

    .venv/bin/python -m benchmarks.bench_medusa [--model PATH] [--depth 400] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_batch_curve import engine_curve

SIZES = [1, 2, 3, 4, 5, 6, 8]


def head_seconds(block: np.ndarray, bias: np.ndarray, proj: np.ndarray, rows: int, reps: int = 3) -> float:
    """The fastest of `reps` evaluations of one head on `rows` hidden states (a drafted token each)."""
    x = np.random.default_rng(rows).standard_normal((rows, block.shape[0]), dtype=np.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        h = x + (lambda z: z / (1 + np.exp(-z)))(x @ block.T + bias)
        (h @ proj.T).argmax(-1)
        best = min(best, time.perf_counter() - t0)
    return best


def chain_rate(cost: dict[int, float], c: float, a: float, max_k: int) -> tuple[float, int]:
    """(speed-up, k) of the best fixed chain length at per-position acceptance a, head cost c."""
    best, best_k = 1.0, 0
    for k in range(1, max_k + 1):
        if k + 1 not in cost:
            continue
        e = sum(a**i for i in range(k + 1))
        rate = e / (cost[k + 1] + k * c)
        if rate > best:
            best, best_k = rate, k
    return best, best_k


def break_even(cost: dict[int, float], c: float, max_k: int) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if chain_rate(cost, c, mid, max_k)[0] > 1.0 else (mid, hi)
    return hi


def per_position(tokens_per_step: float, heads: int) -> float:
    """The geometric per-position acceptance a with 1 + a + ... + a^heads = tokens_per_step."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(heads + 1)) < tokens_per_step else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="GGUF path (default: the real Qwen2.5-Coder-1.5B target)")
    ap.add_argument("--depth", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4, help="Medusa heads (the published models have 4-5)")
    args = ap.parse_args()

    import edgeinfer

    if args.model:
        model = args.model
    else:
        from tests.real_models import qwen_pair

        model = str(qwen_pair()[0])
    engine = edgeinfer.load(model, n_ctx=args.depth + max(SIZES) + 64, n_threads=args.threads, flash_attn=False)
    meta = engine.info.metadata
    hidden, vocab = int(meta[f"{engine.info.architecture}.embedding_length"]), int(meta["tokenizer.ggml.tokens"].length)
    rng = np.random.default_rng(0)
    block = rng.standard_normal((hidden, hidden), dtype=np.float32) / np.float32(hidden**0.5)
    bias = np.zeros(hidden, np.float32)
    proj = rng.standard_normal((vocab, hidden), dtype=np.float32)
    load_before = os.getloadavg()
    verify: dict[int, list[float]] = {}
    heads: dict[int, list[float]] = {1: [], 4: []}
    for _ in range(args.rounds):  # target and head alternate within each round
        for b, s in engine_curve(engine, SIZES, args.depth).items():
            verify.setdefault(b, []).append(s)
        for rows in heads:
            heads[rows].append(head_seconds(block, bias, proj, rows))
    load_after = os.getloadavg()
    engine.close()
    t = {b: statistics.median(v) for b, v in verify.items()}
    cost = {b: t[b] / t[1] for b in t}
    h1, h4 = statistics.median(heads[1]), statistics.median(heads[4])
    c = h1 / t[1]
    print(f"{Path(model).name}: hidden {hidden}, vocab {vocab}; {args.threads} threads, depth {args.depth}, "
          f"median of {args.rounds} alternating rounds; load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after")
    print(f"target step {t[1] * 1e3:.1f} ms; verification of B rows (x one step): "
          + ", ".join(f"{b}: {cost[b]:.2f}" for b in SIZES))
    print("marginal cost of each extra row (x one step): "
          + ", ".join(f"{b}->{b + 1}: {cost[b + 1] - cost[b]:.2f}" for b in SIZES[:-1] if b + 1 in cost))
    print(f"one Medusa head in numpy (float32, {proj.nbytes / 2**20:.0f} MiB): {h1 * 1e3:.1f} ms on 1 state, "
          f"{h4 * 1e3:.1f} ms on 4 -> a drafted token costs c = {c:.2f} target steps ({h4 / 4 / t[1]:.2f} batched by 4)")
    # The same head read at fewer bits (a ggml evaluation, not numpy's float32), by bytes: Q8_0 and Q4_K.
    at = {f"c = {c:.2f} (numpy f32, measured)": c, f"c = {c * 8.5 / 32:.2f} (its bytes at Q8_0)": c * 8.5 / 32,
          f"c = {c * 4.5 / 32:.2f} (at Q4_K)": c * 4.5 / 32, "c = 0 (a free head)": 0.0}
    print("chain break-even per-position acceptance: "
          + "; ".join(f"{label}: {break_even(cost, x, args.heads):.2f}" for label, x in at.items()))
    for label, speedup in (("Medusa-1, Vicuna-7B: 2.2x", 2.2), ("Medusa-2, Vicuna-7B: 2.83x", 2.83)):
        a = per_position(speedup, args.heads)
        r, k = chain_rate(cost, c, a, args.heads)
        r0, k0 = chain_rate(cost, 0.0, a, args.heads)
        print(f"{label} as tokens per step of a {args.heads}-head chain (a = {a:.2f} per position): bound {r:.2f}x "
              f"(k={k}); with a free head {r0:.2f}x (k={k0})")


if __name__ == "__main__":
    main()
