"""Acceptance of a sampling draft model: the rejection rule vs sample-and-match, on the real pair.

Qwen2.5-Coder-1.5B-Instruct Q4_K_M as target, the 0.5B as draft, T = 0.7 and 1.0 (default top-k/
top-p/min-p), 128 tokens, code-edit workload and a free-form prompt, a few seeds (medians).

For each run the engine generates with the 0.5B drafting k tokens per step (fixed length: the cost
gate would switch the 0.5B off on this CPU), verified by the rejection rule; `engine` is the share of
drafted tokens it kept. Then, along the tokens it produced, the exact per-position acceptance of each
rule given the same prefix, from both models' post-transform distributions p and q:
- rejection: Σ min(p, q) (a draft sampled from q, kept with probability min(1, p/q));
- match greedy: p(argmax q) (the old path: a greedy draft, kept if the target's sample equals it);
- match sampled: Σ p·q (a sampled draft kept if an independent target sample equals it).
Acceptance does not depend on timing; the 1-minute load average is recorded anyway.

    .venv/bin/python benchmarks/bench_rejection.py [--seeds 3] [--tokens 128] [--temps 0.7,1.0] [--draft-len 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.real_models


def workload_prompts(engine) -> dict[str, list[int]]:
    from bench_speculative import workloads

    chosen = {"free-form": ([{"role": "user", "content": "Write a short story about a lighthouse keeper and a "
                              "storm."}], ""),
              "code edit": workloads()["code edit"]}
    return {name: engine.chat_tokens(msgs) + (engine.tokenize(prefix, add_special=False) if prefix else [])
            for name, (msgs, prefix) in chosen.items()}


def exact_acceptance(target, draft, prompt: list[int], generated: list[int], sampling) -> dict[str, float]:
    """Mean per-position acceptance of each rule along `generated` (see the module docstring)."""
    import numpy as np

    from edgeinfer.engine.core.sampler import sampling_distribution

    seq = prompt + generated
    start = len(prompt) - 1
    p_rows, q_rows = target.logits(seq[:-1], start), draft.logits(seq[:-1], start)
    rej, greedy, sampled = [], [], []
    for pr, qr in zip(p_rows, q_rows):
        p, q = sampling_distribution(pr, sampling), sampling_distribution(qr, sampling)
        rej.append(float(np.minimum(p.probs, q.prob(p.ids)).sum()))
        greedy.append(float(p.prob(int(np.argmax(qr)))))
        sampled.append(float((p.probs * q.prob(p.ids)).sum()))
    return {"rejection": float(np.mean(rej)), "match greedy": float(np.mean(greedy)),
            "match sampled": float(np.mean(sampled))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temps", default="0.7,1.0")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    os.environ["EDGEINFER_HOME"] = tempfile.mkdtemp(prefix="bench-rejection-")  # never the user's store

    import edgeinfer
    from edgeinfer.engine.core.options import GenerateOptions, LoadOptions, SamplingOptions, SpeculationOptions
    from tests.real_models import qwen_pair

    target_path, draft_path = qwen_pair()
    load_before = os.getloadavg()[0]
    rows = []
    opts = LoadOptions(n_ctx=2048, n_threads=args.threads)
    with edgeinfer.load(model=str(target_path), options=opts) as target, \
            edgeinfer.load(model=str(draft_path), options=opts) as draft:
        spec = SpeculationOptions(method="draft", draft_model=str(draft_path), adaptive=False,
                                  draft_max=args.draft_len, p_min=0.0)
        target.prepare_speculation(spec)
        for name, prompt in workload_prompts(target).items():
            for temp in (float(t) for t in args.temps.split(",")):
                per_seed = []
                for seed in range(args.seeds):
                    sampling = SamplingOptions(temperature=temp, seed=seed)
                    done = target.generate(prompt, GenerateOptions(max_tokens=args.tokens, sampling=sampling,
                                                                   speculation=spec)).result()
                    exact = exact_acceptance(target, draft, prompt, done.tokens, sampling)
                    exact["engine"] = done.stats.speculation.acceptance_rate
                    per_seed.append(exact)
                    print(f"  {name} T={temp} seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in exact.items()),
                          file=sys.stderr, flush=True)
                row = {"workload": name, "T": temp, **{k: statistics.median(r[k] for r in per_seed) for k in per_seed[0]}}
                rows.append(row)
    load_after = os.getloadavg()[0]
    print(f"\nacceptance per drafted token, medians over {args.seeds} seeds, {args.tokens} tokens, "
          f"draft length {args.draft_len} (load average {load_before:.1f} before, {load_after:.1f} after)")
    print(f"{'workload':<10} {'T':>4} {'engine (rejection)':>19} {'rejection':>10} {'match greedy':>13} "
          f"{'match sampled':>14} {'gain vs greedy':>15}")
    for r in rows:
        print(f"{r['workload']:<10} {r['T']:>4} {r['engine']:>19.3f} {r['rejection']:>10.3f} {r['match greedy']:>13.3f} "
              f"{r['match sampled']:>14.3f} {r['rejection'] / r['match greedy']:>14.2f}×")
    if args.json:
        Path(args.json).write_text(json.dumps({"load": [load_before, load_after], "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
