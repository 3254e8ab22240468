"""Where a drafter's greedy answer parts from plain's on bench_suffix's sequences, and how close
off's two best candidates were there (its top log-probabilities at that token).

Each request runs from an empty cache, first `off` with the top 3 log-probabilities of every
token, then the drafter in a memory scope of its own that keeps the earlier answers (as
bench_suffix's rows do). A part at a near-tie is the batch's kernels (benchmarks/batch_logits.py);
a part where off's best was clear would be a drafter's fault.

    .venv/bin/python -m benchmarks.suffix_divergence [--sequences tools,tests] [--methods suffix,auto] [--model GGUF]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", default="tools,tests")
    ap.add_argument("--methods", default="suffix")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--model", help="a GGUF file instead of the real 1.5B")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import edgeinfer
    from benchmarks.bench_suffix import FRESH, sequences
    from tests.real_models import qwen_pair

    target = args.model or str(qwen_pair()[0])
    with tempfile.TemporaryDirectory(prefix="edgeinfer-divergence-") as home, \
            edgeinfer.load(target, n_ctx=4096, n_threads=args.threads, flash_attn=False,
                           store=edgeinfer.Store(Path(home))) as engine:
        seqs = sequences()
        requests = []
        for name in args.sequences.split(","):
            requests += [(f"{name} {i + 1}", m) for i, m in enumerate(seqs[name])] + [(f"{name} fresh", FRESH)]
        prompts = [(n, engine.tokenize(engine.render_chat(m), add_special=False, parse_special=True))
                   for n, m in requests]

        def run(method: str, scope: str, prompt: list[int], top: int | None):
            opts = edgeinfer.GenerateOptions(max_tokens=args.tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0),
                                             speculation=edgeinfer.SpeculationOptions(method=method, memory_scope=scope))
            engine.reset()
            events = [e for e in engine.generate(prompt, opts, logprobs=top) if hasattr(e, "token")]
            return [e.token for e in events], [getattr(e, "top_logprobs", ()) for e in events]

        for method in args.methods.split(","):
            for name, prompt in prompts:
                plain, tops = run("off", f"divergence-off-{method}", prompt, 3)
                drafted, _ = run(method, f"divergence-{method}", prompt, None)
                if plain == drafted:
                    print(f"{method} {name}: same ({len(plain)} tokens)", flush=True)
                    continue
                i = next((j for j, (a, b) in enumerate(zip(plain, drafted)) if a != b), min(len(plain), len(drafted)))
                top = [(t, round(lp, 4)) for t, lp in tops[i]] if i < len(tops) else []
                print(f"{method} {name}: parts at token {i} of {len(plain)}/{len(drafted)}: off {plain[i:i + 1]}, "
                      f"{method} {drafted[i:i + 1]}; off's top log-probabilities there {top}", flush=True)


if __name__ == "__main__":
    main()
