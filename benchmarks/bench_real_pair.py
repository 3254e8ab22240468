"""Plain vs speculative decoding on the real Qwen2.5-Coder-1.5B target: the issue's table in one run.

Per workload (the code edit and two free-form prompts) a fresh engine with an empty store, so its
first speculative request is what a user's first request pays (no calibration: a size prior learned
online). Rows alternate within each round (their order rotates between rounds) and the table gives
medians: decode tok/s and × plain, end-to-end (TTFT + decode) × plain, acceptance, drafting and
plain steps, and the bound: the best fixed-length speed-up that this machine's own batch curve
(measured by the same engine at the workload's depth, just before the rows) allows at the row's
measured acceptance, with the fraction of it reached. Outputs are compared with plain token for
token; where one parts, the top-2 margin there is printed.

    .venv/bin/python -m benchmarks.bench_real_pair
        [--workloads "code edit,coding question,story"] [--rows off,auto,lookup,draft] [--rounds 3]
        [--tokens 256] [--threads 2]        # 'draft': the 0.5B as draft model
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from dataclasses import dataclass, field

from benchmarks.bench_batch_curve import ceiling, engine_curve
from benchmarks.replay_speculation import pair_workloads

CURVE_SIZES = [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17]


@dataclass
class Runs:
    """Every run of one row of one workload."""

    decode_tok_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    steps: list[tuple[int, int]] = field(default_factory=list)  # (drafting, plain)
    first_e2e_s: float | None = None  # the engine's first request with this row (after a warm-up)
    tokens: list[int] = field(default_factory=list)
    note: str = ""


def speculation(method: str, draft: str):
    import edgeinfer

    if method == "draft":
        return edgeinfer.SpeculationOptions(method="draft", draft_model=draft)
    if method == "auto+draft":
        return edgeinfer.SpeculationOptions(method="auto", draft_model=draft)
    return edgeinfer.SpeculationOptions(method=method)


def divergence(engine, prompt: list[int], plain: list[int], other: list[int]) -> str:
    import numpy as np

    for i, (a, b) in enumerate(zip(plain, other)):
        if a != b:
            row = engine.logits(prompt + plain[:i], start=len(prompt) + i - 1)[0]
            top2 = np.sort(row)[-2:]
            return f"parts from plain at token {i} (top-2 margin {float(top2[1] - top2[0]):.3f})"
    return "identical to plain" if len(plain) == len(other) else f"same first {min(len(plain), len(other))} tokens"


def run_workload(name: str, rows: list[str], rounds: int, tokens: int, threads: int, target: str, draft: str) -> None:
    import edgeinfer

    os.environ["EDGEINFER_HOME"] = tempfile.mkdtemp(prefix="edgeinfer-pair-")  # nothing calibrated
    engine = edgeinfer.load(target, n_ctx=4096, n_threads=threads, flash_attn=False)
    messages, start = pair_workloads()[name]
    prompt = engine.tokenize(engine.render_chat(messages) + start, add_special=False, parse_special=True)
    greedy = edgeinfer.SamplingOptions(temperature=0.0)
    # warm up (weights paged in, threads started) so that no row's first request pays for it
    engine.generate(prompt[:64], edgeinfer.GenerateOptions(max_tokens=4, sampling=greedy, speculation=speculation("off", draft))).result()
    load_before = os.getloadavg()[0]
    runs = {r: Runs() for r in rows}
    for rnd in range(rounds):
        order = rows[rnd % len(rows):] + rows[: rnd % len(rows)]
        for method in order:
            engine.reset()
            done = engine.generate(prompt, edgeinfer.GenerateOptions(
                max_tokens=tokens, sampling=greedy, speculation=speculation(method, draft))).result()
            st, r = done.stats, runs[method]
            e2e = st.ttft_s + st.decode_s
            r.decode_tok_s.append(st.decode_tok_s)
            r.e2e_s.append(e2e)
            r.ttft_s.append(st.ttft_s)
            if r.first_e2e_s is None:
                r.first_e2e_s = e2e
                r.tokens = done.tokens
            if st.speculation is not None and st.speculation.drafted:
                r.acceptance.append(st.speculation.acceptance_rate)
            if st.speculation is not None:
                r.steps.append((st.speculation.steps, st.speculation.plain_steps))
                r.note = st.speculation.note or r.note
    # the curve at the depth where the rows decode (prompt + half the output), after them: same engine
    depth = len(prompt) + tokens // 2
    curve: dict[int, list[float]] = {}
    for _ in range(3):
        for b, s in engine_curve(engine, CURVE_SIZES, depth).items():
            curve.setdefault(b, []).append(s)
    seconds = {b: statistics.median(v) for b, v in curve.items()}
    load_after = os.getloadavg()[0]

    plain = runs.get("off")
    print(f"\n### {name}: prompt depth {len(prompt)}, {tokens} tokens, {threads} threads, median of {rounds} "
          f"rounds; load average {load_before:.1f} → {load_after:.1f}")
    print("curve at depth %d (cost in one-token steps): %s" % (
        depth, ", ".join(f"{b}: {seconds[b] / seconds[1]:.2f}" for b in CURVE_SIZES)))
    print("\n| row | decode tok/s | × plain | e2e × plain | first request e2e × plain | TTFT s | acceptance "
          "| bound (k) | of bound | drafting / plain steps | output | decode tok/s per run |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for method, r in runs.items():
        tok_s = statistics.median(r.decode_tok_s)
        ratio = tok_s / statistics.median(plain.decode_tok_s) if plain else float("nan")
        e2e = statistics.median(plain.e2e_s) / statistics.median(r.e2e_s) if plain else float("nan")
        first = statistics.median(plain.e2e_s) / r.first_e2e_s if plain else float("nan")
        acc = statistics.median(r.acceptance) if r.acceptance else None
        bound, k = ceiling(seconds, acc) if acc else (1.0, 0)
        steps = (f"{statistics.median(s for s, _ in r.steps):.0f} / {statistics.median(p for _, p in r.steps):.0f}"
                 if r.steps else "–")
        same = divergence(engine, prompt, plain.tokens, r.tokens) if plain and method != "off" else "–"
        print(f"| {method} | {tok_s:.2f} | {ratio:.2f} | {e2e:.2f} | {first:.2f} | {statistics.median(r.ttft_s):.2f} "
              f"| {'–' if acc is None else f'{acc:.3f}'} | {bound:.2f} ({k}) | "
              f"{'–' if acc is None else f'{ratio / bound:.2f}'} | {steps} | {same}{'; ' + r.note if r.note else ''} | "
              f"{', '.join(f'{x:.1f}' for x in r.decode_tok_s)} |",
              flush=True)
    engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(pair_workloads()))
    ap.add_argument("--rows", default="off,auto,lookup")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from tests.real_models import qwen_pair

    target, draft = qwen_pair()
    rows = args.rows.split(",")
    if "off" not in rows:
        ap.error("--rows needs 'off': every row is compared with plain decoding")
    for name in args.workloads.split(","):
        if name not in pair_workloads():
            ap.error(f"unknown workload {name!r}: choose from {', '.join(pair_workloads())}")
        run_workload(name, rows, args.rounds, args.tokens, args.threads, str(target), str(draft))


if __name__ == "__main__":
    main()
