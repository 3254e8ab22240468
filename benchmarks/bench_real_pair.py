"""Plain vs speculative decoding on the real Qwen2.5-Coder-1.5B target, one engine, rows alternating.

The engine is fresh, so the first speculative row is its first speculative request (what a user's
first request pays: no calibration, a size prior learned online). Per row: decode tok/s, TTFT and
the prefill inside it, steps and plain steps, acceptance, the load average, and the cost curve the
engine has learned by then at the current depth.

    .venv/bin/python -m benchmarks.bench_real_pair [--workload "code edit"] [--rows off,auto,lookup,off,auto,lookup]
        [--tokens 256] [--threads 2] [--draft]     # --draft: rows named 'draft' use the 0.5B
"""

from __future__ import annotations

import argparse
import os
import tempfile

from benchmarks.replay_speculation import pair_workloads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="code edit", choices=list(pair_workloads()))
    ap.add_argument("--rows", default="off,auto,lookup,off,auto,lookup")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before llama.cpp loads: see RESULTS.md
    os.environ["EDGEINFER_HOME"] = tempfile.mkdtemp(prefix="edgeinfer-pair-")  # no stored cost curve

    import edgeinfer
    from tests.real_models import qwen_pair

    target, draft = qwen_pair()
    engine = edgeinfer.load(str(target), n_ctx=4096, n_threads=args.threads, flash_attn=False)
    messages, start = pair_workloads()[args.workload]
    prompt = engine.tokenize(engine.render_chat(messages) + start, add_special=False, parse_special=True)
    print(f"{args.workload}: prompt depth {len(prompt)}, {args.tokens} tokens, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    for method in args.rows.split(","):
        engine.reset()
        spec = (edgeinfer.SpeculationOptions(method="draft", draft_model=str(draft)) if method == "draft"
                else edgeinfer.SpeculationOptions(method=method))
        done = engine.generate(prompt, edgeinfer.GenerateOptions(
            max_tokens=args.tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0), speculation=spec)).result()
        st = done.stats
        sp = st.speculation
        spec_s = (f"drafting steps {sp.steps}, plain steps {sp.plain_steps}, accepted {sp.accepted}/{sp.drafted}" if sp else "")
        print(f"{method:7} decode {st.decode_tok_s:6.2f} tok/s  TTFT {st.ttft_s:6.2f} s (prefill {st.prefill_s:6.2f} s)  "
              f"{spec_s}  load {os.getloadavg()[0]:.1f}", flush=True)
        costs = engine._costs
        if costs is not None:
            print("        learned cost at depth", costs.depth, {b: round(costs.ratio(b), 2) for b in (2, 3, 4, 5, 8, 16)},
                  f"t1 {costs.t1:.3f} s", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
