"""How far a logits row computed in a batch is from the same row computed one token at a time.

Greedy speculative decoding verifies drafts in a batch; plain decoding computes one token at a
time. llama.cpp's kernels round differently between the two, so greedy speculation is exact only up
to this difference: where the top-2 margin is below it, the two may pick different tokens. Per
position of a greedy output: max |Δ logit| over the vocabulary, and the top-2 margin there.

    .venv/bin/python -m benchmarks.bench_batch_rounding [--model PATH] [--tokens 30]   # default: the real 1.5B
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="GGUF path (default: the real Qwen2.5-Coder-1.5B target)")
    ap.add_argument("--tokens", type=int, default=30)
    args = ap.parse_args()

    import edgeinfer
    from benchmarks.replay_speculation import pair_workloads

    if args.model:
        model = args.model
    else:
        from tests.real_models import qwen_pair

        model = str(qwen_pair()[0])
    engine = edgeinfer.load(model, n_ctx=2048, n_threads=2, flash_attn=False)
    rt = engine._runtime  # a benchmark of the runtime itself: one-token decodes by hand
    seq = engine._scheduler.slots[0].seq
    greedy = edgeinfer.GenerateOptions(max_tokens=args.tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0),
                                       speculation=edgeinfer.SpeculationOptions(method="off"))
    for name in ("story", "coding question"):
        messages, start = pair_workloads()[name]
        prompt = engine.tokenize(engine.render_chat(messages) + start, add_special=False, parse_special=True)
        engine.reset()
        out = engine.generate(prompt, greedy).result().tokens
        engine.reset()
        seq.decode_all(prompt)
        single = []
        for t in out:
            single.append(rt.logits_row(-1).copy())
            seq.decode([t])
        batch = engine.logits(prompt + out, start=len(prompt) - 1)[: len(out)]
        diffs = [float(np.abs(s - b).max()) for s, b in zip(single, batch)]
        margins = [float(np.diff(np.sort(s)[-2:])[0]) for s in single]
        print(f"{name}: max |single - batch| per position: min {min(diffs):.3f}, median {np.median(diffs):.3f}, "
              f"max {max(diffs):.3f}; positions whose top-2 margin is below that max: "
              f"{sum(m < max(diffs) for m in margins)} of {len(margins)}")
    engine.close()


if __name__ == "__main__":
    main()
