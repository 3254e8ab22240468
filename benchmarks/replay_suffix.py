"""Replay the suffix drafter on a recorded sequence of similar requests, beside what an oracle
drafter could reach on the same text: the ceiling of "drafts from earlier answers" on this machine.

bench_suffix.py times `suffix` and `auto` against `off` on the real 1.5B; this separates the drafter
from the noise, the way replay_speculation.py does for lookup. Each request of a sequence
(bench_suffix's `tools` or `tests`) is answered once with plain greedy decoding and kept in
`--record`, with the cost curve at the prompts' depth (replay_speculation's recorded_curve). Then,
for requests 2..n, each with the earlier answers in memory as the engine keeps them
(SuffixMemory.remember: the prompt's last 8 tokens and the answer):

- `suffix` / `auto`: the engine's own RequestSpeculation replayed step by step (replay_speculation's
  replay(): every step costs what the curve says), and the same with each draft cut to what will be
  accepted (the length oracle);
- the oracle drafters: at each position, the longest continuation any single place of the corpus
  (this prompt and the output so far, and the earlier answers) gets right, among the places whose
  preceding tokens agree with the text's end for longest (`longest`) or for at least `--min-match`
  tokens (`any`), drafted at the best length for the curve (a dynamic programme over the positions:
  exact, not greedy). No chain drafter reading this corpus can beat `any`, and no tree of drafts
  verified together either: the branch a tree gets accepted is one place's continuation, and the
  tree spends at least that branch's rows on it.

Printed: each row's decode speed-up over plain for requests 2..n together (their tokens over the
time the curve charges), tokens drafted and accepted, and the tokens each oracle could accept.

    .venv/bin/python -m benchmarks.replay_suffix --sequence tests --record FILE [--tokens 96] [--noise-seeds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.replay_speculation import recorded_curve, replay, shared_machine

DRAFT_MAX = 32  # SpeculationOptions.draft_max's default: no draft is longer


def corpus_texts(prompt: list[int], earlier: Sequence[tuple[list[int], list[int]]]) -> list[list[int]]:
    """What a suffix drafter may read besides the request's own text: the earlier answers as the
    memory keeps them (PROMPT_TAIL prompt tokens before each)."""
    from edgeinfer.engine.speculation.suffix import PROMPT_TAIL

    return [list(p[-PROMPT_TAIL:]) + list(o) for p, o in earlier]


def oracle_accepts(prompt: list[int], output: list[int], earlier: list[list[int]], rule: str = "longest",
                   min_match: int = 1, depth: int = 64) -> list[int]:
    """a[i] for i in 1..len(output)-1 (a[0] = 0): how many of output[i:] one place of the corpus
    continues correctly, the text so far being prompt + output[:i]. The places considered: those
    whose preceding tokens agree with the text's end for at least `min_match` tokens, and with
    `rule` "longest" only those agreeing for longest (up to `depth`)."""
    out = [0] * len(output)
    for i in range(1, len(output)):
        own = prompt + output[:i]
        end = len(own)
        best_m, best_c, best_any = 0, 0, 0
        for text, limit in [(own, end)] + [(t, len(t)) for t in earlier]:
            for p in range(1, limit):
                if text[p - 1] != own[-1]:
                    continue
                m = 1
                while m < depth and p - 1 - m >= 0 and text[p - 1 - m] == own[end - 1 - m]:
                    m += 1
                if m < min_match:
                    continue
                c = 0
                while c < DRAFT_MAX and p + c < limit and i + c < len(output) and text[p + c] == output[i + c]:
                    c += 1
                best_any = max(best_any, c)
                if m > best_m:
                    best_m, best_c = m, c
                elif m == best_m:
                    best_c = max(best_c, c)
        out[i] = best_c if rule == "longest" else best_any
    return out


def oracle_seconds(accepts: list[int], curve: dict[int, float]) -> float:
    """The least time the curve charges to produce output[1:] when at position i a draft of up to
    accepts[i] tokens is known right (each step: j drafted and accepted + 1 sampled, at least j + 1
    rows: see padded)."""
    return _oracle_schedule(accepts, curve)[0]


def oracle_plan(accepts: list[int], curve: dict[int, float]) -> list[int]:
    """The right tokens drafted at each position of oracle_seconds' cheapest schedule (0: a plain
    step there; from any position the lengths onwards are the cheapest, so a schedule pushed off its
    path by a plain step goes on optimally)."""
    return _oracle_schedule(accepts, curve)[1]


def padded(curve: dict[int, float]) -> dict[int, int]:
    """The rows a step that needs b rows verifies: the cheapest count of at least b. The curve is
    bumpy (4 rows can cost less than 3), and a drafter may pad a draft with tokens it does not
    expect to be kept (our policy does, pricing rows by the curve), so the ceiling must too."""
    return {b: min((r for r in curve if r >= b), key=lambda r: (curve[r], r)) for b in curve}


def _oracle_schedule(accepts: list[int], curve: dict[int, float]) -> tuple[float, list[int]]:
    n = len(accepts)
    big = max(curve)
    rows = padded(curve)
    cost = [0.0] * (n + 1)
    plan = [0] * n
    for i in range(n - 1, 0, -1):
        cost[i], plan[i] = min((curve[rows[min(j + 1, big)]] + cost[min(i + j + 1, n)], j)
                               for j in range(0, accepts[i] + 1))
    return (cost[1] if n > 1 else 0.0), plan


def record_sequence(name: str, tokens: int, record: Path | None, threads: int = 2):
    """(prompts, outputs, curve) of one of bench_suffix's sequences on the real 1.5B, greedy plain
    outputs generated once (each request from a fresh cache) and kept in `record`."""
    import edgeinfer
    from benchmarks.bench_suffix import sequences
    from tests.real_models import qwen_pair

    known = json.loads(record.read_text()) if record and record.exists() else {}
    key = f"sequence|{name}|{tokens}"
    if key not in known:
        target = str(qwen_pair()[0])
        with tempfile.TemporaryDirectory(prefix="edgeinfer-replay-") as home, \
                edgeinfer.load(target, n_ctx=4096, n_threads=threads, flash_attn=False,
                               store=edgeinfer.Store(Path(home))) as engine:  # never the user's own store
            prompts = [engine.tokenize(engine.render_chat(m), add_special=False, parse_special=True)
                       for m in sequences()[name]]
            outputs = []
            for p in prompts:
                engine.reset()
                opts = edgeinfer.GenerateOptions(max_tokens=tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0),
                                                 speculation=edgeinfer.SpeculationOptions(method="off"))
                outputs.append(engine.generate(p, opts).result().tokens)
            depth = round(statistics.median(len(p) for p in prompts), -2)
            curve = recorded_curve(engine, prompts[0], depth, 33, record)
        known = json.loads(record.read_text()) if record and record.exists() else {}
        known[key] = {"prompts": prompts, "outputs": outputs, "curve": curve}
        if record:
            record.write_text(json.dumps(known))
    entry = known[key]
    return entry["prompts"], entry["outputs"], {int(b): t for b, t in entry["curve"].items()}


def replay_sequence(prompts, outputs, curve, method: str, oracle: str | None = None, noise_seed: int | None = None):
    """The engine's drafter over requests 2..n, each with the earlier answers in one memory:
    (speed-up over plain, drafted, accepted)."""
    from edgeinfer.engine.speculation import CostModel
    from edgeinfer.engine.speculation.suffix import SuffixMemory

    memory = SuffixMemory()
    memory.remember("", prompts[0], outputs[0])
    plain = spent = 0.0
    drafted = accepted = 0
    for prompt, output in zip(prompts[1:], outputs[1:]):
        noise = shared_machine(noise_seed) if noise_seed is not None else None
        r = replay(prompt, output, curve, lambda: CostModel(dict(curve)), oracle, noise=noise, method=method,
                   memory=memory.corpus(""))
        t_plain = (len(output) - 1) * curve[1]
        plain += t_plain
        spent += t_plain / r.speedup
        drafted += r.drafted
        accepted += r.accepted
        memory.remember("", prompt, output)
    return plain / spent, drafted, accepted


def oracle_sequence(prompts, outputs, curve, rule: str, min_match: int = 1):
    """(speed-up over plain, tokens accepted at the best lengths' positions summed) of an oracle
    drafter over requests 2..n (see the module)."""
    plain = spent = 0.0
    right = 0
    for k in range(1, len(prompts)):
        earlier = corpus_texts(prompts[k], list(zip(prompts[:k], outputs[:k])))
        acc = oracle_accepts(prompts[k], outputs[k], earlier, rule, min_match)
        plain += (len(outputs[k]) - 1) * curve[1]
        spent += oracle_seconds(acc, curve)
        right += sum(1 for a in acc if a)
    return plain / spent, right


def candidates_sequence(prompts, outputs, curve, own: bool = True):
    """(speed-up, positions with a right draft) of the engine's suffix candidates (SuffixSource, as
    `suffix` (own text and memory) or `auto` (memory only) drafts them) at the best lengths for the
    curve: what our candidate choice allows, whatever the length policy does."""
    from edgeinfer.engine.speculation.suffix import SuffixMemory, SuffixSource

    memory = SuffixMemory()
    plain = spent = 0.0
    right = 0
    for k, (prompt, output) in enumerate(zip(prompts, outputs)):
        if k:
            source = SuffixSource(memory.corpus(""), own=own)
            acc = [0] * len(output)
            for i in range(1, len(output)):
                found = source.draft(prompt + output[:i], DRAFT_MAX).tokens
                while acc[i] < len(found) and i + acc[i] < len(output) and found[acc[i]] == output[i + acc[i]]:
                    acc[i] += 1
            plain += (len(output) - 1) * curve[1]
            spent += oracle_seconds(acc, curve)
            right += sum(1 for a in acc if a)
        memory.remember("", prompt, output)
    return plain / spent, right


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequence", default="tests", help="bench_suffix's sequence: tests or tools")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--record", type=Path, help="JSON file keeping the outputs and the curve between runs")
    ap.add_argument("--methods", default="suffix,auto")
    ap.add_argument("--min-match", type=int, default=1, help="the `any` oracle's least agreement (tokens)")
    ap.add_argument("--noise-seeds", type=int, default=0)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    for name in args.sequence.split(","):
        prompts, outputs, curve = record_sequence(name, args.tokens, args.record)
        r = {b: round(t / curve[1], 2) for b, t in curve.items()}
        shown = " ".join(f"{b}:{r[b]}" for b in (2, 3, 4, 5, 8, 9, 16, 17, 32))
        print(f"\n{name}: {len(prompts)} requests, prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
              f"answers {[len(o) for o in outputs]} tokens; curve {shown}")
        print("| row | × plain, requests 2..n | drafted | accepted |")
        print("| --- | ---: | ---: | ---: |")
        for method in args.methods.split(","):
            sp, d, a = replay_sequence(prompts, outputs, curve, method)
            lo, _, _ = replay_sequence(prompts, outputs, curve, method, "length")
            print(f"| {method} | {sp:.3f} | {d} | {a} |")
            print(f"| {method}, length oracle | {lo:.3f} | | |")
            if args.noise_seeds:
                noisy = [replay_sequence(prompts, outputs, curve, method, noise_seed=s)
                         for s in range(args.noise_seeds)]
                ds, sp = [d for _, d, _ in noisy], [x for x, _, _ in noisy]
                mid = statistics.median(ds)
                print(f"|   {method}, {args.noise_seeds} noisy runs | {min(sp):.3f}..{max(sp):.3f} | "
                      f"{min(ds)}..{max(ds)} ({(min(ds) / mid - 1) * 100:+.0f}/{(max(ds) / mid - 1) * 100:+.0f} %) | |")
        for own, label in ((True, "suffix"), (False, "auto's suffix (memory only)")):
            sp, right = candidates_sequence(prompts, outputs, curve, own)
            print(f"| {label} candidates at the best lengths | {sp:.3f} | | positions with a right draft: {right} |")
        for rule in ("longest", "any"):
            sp, right = oracle_sequence(prompts, outputs, curve, rule, args.min_match)
            print(f"| oracle ({rule} match) | {sp:.3f} | | positions with a right draft: {right} |")


if __name__ == "__main__":
    main()
