"""Replay prompt lookup on recorded outputs: how good is the draft-length policy, free of noise?

Timing speculative decoding on a shared 2-core machine moves ±10 % between runs, more than most
policy changes are worth. This benchmark separates the two: it records each workload's plain greedy
output once, measures the model's decode cost curve (time of a b-token decode / one-token decode)
once, and then replays the lookup drafter step by step on the recorded tokens — every draft is
judged against what the target really produced, every step costs what the curve says. Printed per
workload: the replayed speed-up of the shipped policy and two bounds for the same drafts:
"first-token oracle" skips exactly the steps whose first draft token would be rejected, "length
oracle" drafts exactly as many tokens as will be accepted. The gap between policy and oracles is
what better acceptance prediction could still buy; the rest is the drafts themselves.

Also replays sampled text (temperature 0.9), where lookup has little to copy: the policy must stay
within a few percent of plain there.

    .venv/bin/python benchmarks/replay_speculation.py [--tokens 384] [--quants F16,Q8_0]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.bench_speculative import make_models, workloads

SAMPLED = {"sampled story": "Write a short story about a lighthouse keeper and a storm.",
           "sampled facts": "Tell me ten surprising facts about octopuses."}


def cost_curve(engine, prompt: list[int], reps: int = 5, max_b: int = 33) -> dict[int, float]:
    """Median time of a b-token decode (logits for every row) over one-token decode, every b."""
    rt = engine._runtime
    engine.reset()
    rt.decode_all(prompt)
    base = len(rt.cached)
    times: dict[int, list[float]] = {}
    for _ in range(reps):
        for b in range(1, max_b + 1):
            t0 = time.perf_counter()
            rt.decode([prompt[i % len(prompt)] for i in range(b)], logits_from=0)
            times.setdefault(b, []).append(time.perf_counter() - t0)
            rt.truncate(base)
    t1 = statistics.median(times[1])
    return {b: statistics.median(v) / t1 for b, v in times.items()}


def replay(prompt: list[int], output: list[int], curve: dict[int, float], oracle: str | None = None) -> float:
    """Replayed speed-up of lookup over plain decoding of `output` (its first token comes from
    the prompt's logits, as in the engine)."""
    from edgeinfer import SpeculationOptions
    from edgeinfer.engine.speculation import CostModel, LengthPolicy, LookupDrafter

    seconds = {b: curve[b] for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33) if b in curve}
    drafter = LookupDrafter(LengthPolicy(CostModel(seconds), SpeculationOptions(method="lookup")))
    drafter.start(prompt)
    i, spent = 1, 0.0
    while i < len(output):
        history = prompt + output[:i]
        draft = drafter.propose(history, len(output) - i)
        ok = 0
        while ok < len(draft) and i + ok < len(output) and draft[ok] == output[i + ok]:
            ok += 1
        if oracle == "first" and ok == 0:
            draft = []
        elif oracle == "length":
            draft = draft[:ok]
        cost = curve[min(len(draft) + 1, max(curve))]
        spent += cost
        drafter.observe(history + output[i : i + ok], len(draft), min(ok, len(draft)), cost, 0.0)
        i += min(ok, len(draft)) + 1
    return (len(output) - 1) / spent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--quants", default="F16,Q8_0")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import edgeinfer

    tmp = tempfile.TemporaryDirectory(prefix="edgeinfer-replay-")
    store = edgeinfer.Store(Path(tmp.name))
    quants = [q.strip().upper() for q in args.quants.split(",")]
    refs = make_models(store, quants)
    print(f"lookup replayed on recorded outputs ({args.tokens} tokens), cost curve measured on this machine")
    print(f"{'model':5} {'workload':14} {'policy':>7} {'first-token oracle':>19} {'length oracle':>14}  curve b=2,3,5,9,17")
    for quant in quants:
        engine = edgeinfer.load(refs[quant], n_ctx=4096, n_threads=args.threads, flash_attn=False, store=store)
        loads: dict[str, tuple[list[int], edgeinfer.SamplingOptions]] = {}
        for name, (messages, reply_start) in workloads().items():
            loads[name] = (engine.tokenize(engine.render_chat(messages) + reply_start, add_special=False,
                                           parse_special=True), edgeinfer.SamplingOptions(temperature=0.0))
        for name, text in SAMPLED.items():
            loads[name] = (engine.tokenize(engine.render_chat([{"role": "user", "content": text}]),
                                           add_special=False, parse_special=True),
                           edgeinfer.SamplingOptions(temperature=0.9, top_p=0.95, seed=7))
        curve = cost_curve(engine, loads["code edit"][0])
        shape = ",".join(f"{curve[b]:.2f}" for b in (2, 3, 5, 9, 17))
        for name, (prompt, sampling) in loads.items():
            engine.reset()
            opts = edgeinfer.GenerateOptions(max_tokens=args.tokens, sampling=sampling,
                                             speculation=edgeinfer.SpeculationOptions(method="off"))
            output = engine.generate(prompt, opts).result().tokens
            run: Callable[[str | None], float] = lambda o: replay(prompt, output, curve, o)  # noqa: E731
            print(f"{quant:5} {name:14} {run(None):7.2f} {run('first'):19.2f} {run('length'):14.2f}  {shape}")
        engine.close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
