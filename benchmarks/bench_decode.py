"""Decode speed of edgeinfer's own loop vs llama-cpp-python's high-level `create_completion`, and
the C++ floor (time spent inside llama_decode only), on the default model.

Greedy, 256 tokens, same threads, measured alternately in one run (the machine is shared and
noisy, so the ratios matter more than the absolute numbers). Peak RSS is measured in fresh
child processes, one per implementation.

    .venv/bin/python -m benchmarks.bench_decode [--rounds 5] [--tokens 256] [--threads 2] [--pair | --model PATH]
        [--no-rss] [--no-flash-choice] [--before TREE]

A second row loads the model again after `Engine.measure_flash_attn` (what `edgeinfer bench` keeps):
flash attention on or off as measured faster here (`--no-flash-choice` skips it; run with a fresh
EDGEINFER_HOME so that the first row is llama.cpp's own choice).

--pair runs it on the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M (tests/real_models.py). The 1-minute
load average is printed next to the table: on a shared machine read the ratios.

--before TREE compares two checkouts (e.g. `git worktree add /tmp/before COMMIT` with its own .venv):
each round runs this file's single-round measurement once in TREE and once here, alternately, each in a
fresh process, and the table gives the medians of our loop's tok/s and of its ratio to the binding's
(measured in the same process, which cancels most of the machine's load).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

PROMPT = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4,"


def run_ours(engine, n: int) -> tuple[float, float, int]:
    import edgeinfer

    opts = edgeinfer.GenerateOptions(max_tokens=n, sampling=edgeinfer.SamplingOptions(temperature=0.0))
    engine.reset()  # no prefix cache between rounds: every round pays the same prefill
    done = engine.generate(PROMPT, opts).result()
    return done.stats.decode_tok_s, done.stats.ttft_s, done.stats.generated_tokens


def run_binding(llm, n: int) -> tuple[float, float, int]:
    llm.reset()
    t0 = time.perf_counter()
    t_first = None
    count = 0
    for _chunk in llm.create_completion(PROMPT, max_tokens=n, temperature=0.0, top_k=1, repeat_penalty=1.0, stream=True):
        count += 1
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return (count - 1) / (t_end - t_first), t_first - t0, count


def run_decode_only(engine, n: int) -> tuple[float, float, int]:
    """llama_decode of one token at a time with argmax: what C++ would do, minus nothing."""
    import numpy as np

    engine.reset()
    rt = engine._runtime
    seq = engine._scheduler.slots[0].seq  # the engine's own sequence, driven by hand
    toks = engine.tokenize(PROMPT)
    t0 = time.perf_counter()
    seq.decode_all(toks)
    tok = int(np.argmax(rt.logits_row(-1)))
    ttft = time.perf_counter() - t0
    spent = 0.0
    for _ in range(n - 1):
        t = time.perf_counter()
        seq.decode([tok])
        spent += time.perf_counter() - t
        tok = int(np.argmax(rt.logits_row(-1)))
    return (n - 1) / spent, ttft, n


def peak_rss(which: str, threads: int, n: int, path: str) -> float:
    code = f"""
import resource, sys
sys.argv = ['x']
from benchmarks.bench_decode import *
path = {path!r}
if {which!r} == 'ours':
    import edgeinfer
    e = edgeinfer.load(path, n_ctx=2048, n_threads={threads})
    run_ours(e, {n})
else:
    import llama_cpp
    llm = llama_cpp.Llama(path, n_ctx=2048, n_threads={threads}, n_threads_batch={threads}, verbose=False)
    run_binding(llm, {n})
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", help="GGUF path (default: the default model)")
    ap.add_argument("--pair", action="store_true", help="the real Qwen2.5-Coder-1.5B target")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    ap.add_argument("--no-flash-choice", action="store_true",
                    help="skip the row of an engine loaded with the flash-attention verdict it measured first")
    ap.add_argument("--before", metavar="TREE", help="another checkout with its own .venv: before and after, alternating")
    args = ap.parse_args()
    if args.before:
        return compare_trees(args)

    import os

    import llama_cpp

    import edgeinfer
    from edgeinfer.default_model import default_model_file

    if args.pair:
        from tests.real_models import qwen_pair

        path = str(qwen_pair()[0])
    else:
        path = args.model or str(default_model_file())
    load_before = os.getloadavg()[0]
    engine = edgeinfer.load(path, n_ctx=2048, n_threads=args.threads)  # (a fresh store: llama.cpp's auto)
    impls = {"edgeinfer loop": lambda: run_ours(engine, args.tokens)}
    if not args.no_flash_choice:  # what `edgeinfer bench` measures and later loads use (engine/llama/flash_choice.py)
        from edgeinfer.bench import FLASH_DEPTH
        from edgeinfer.evaluate import default_eval_text

        probe = engine.tokenize(default_eval_text(), add_special=True)[:FLASH_DEPTH]
        choice = engine.measure_flash_attn(probe)
        print(f"measured: {choice.summary()}", file=sys.stderr)
        measured = edgeinfer.load(path, n_ctx=2048, n_threads=args.threads)
        impls[f"edgeinfer loop, flash attention {'on' if measured.options.flash_attn else 'off'} (measured)"] = \
            lambda: run_ours(measured, args.tokens)
    llm = llama_cpp.Llama(path, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    impls |= {"llama-cpp-python create_completion": lambda: run_binding(llm, args.tokens),
              "llama_decode only (C++ floor)": lambda: run_decode_only(engine, args.tokens)}
    for f in impls.values():  # warm-up
        f()
    results: dict[str, list[tuple[float, float, int]]] = {k: [] for k in impls}
    for _ in range(args.rounds):
        for name, f in impls.items():  # alternate
            results[name].append(f())
    load_after = os.getloadavg()[0]
    rss = {} if args.no_rss else {
        "edgeinfer loop": peak_rss("ours", args.threads, args.tokens, path),
        "llama-cpp-python create_completion": peak_rss("binding", args.threads, args.tokens, path)}
    base = statistics.median(r[0] for r in results["llama-cpp-python create_completion"])
    rows = []
    for name, rs in results.items():
        tps = statistics.median(r[0] for r in rs)
        ttft = statistics.median(r[1] for r in rs)
        rows.append({"impl": name, "decode_tok_s": round(tps, 1), "vs_binding": round(tps / base, 3),
                     "ttft_ms": round(ttft * 1000, 1), "tokens": rs[0][2],
                     "peak_rss_mb": round(rss[name], 0) if name in rss else None})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{os.path.basename(path)}, greedy, {args.tokens} tokens, {args.threads} threads, median of {args.rounds} "
          f"alternating rounds, load average {load_before:.1f} before / {load_after:.1f} after")
    print(f"{'implementation':38} {'decode tok/s':>12} {'× binding':>10} {'TTFT ms':>8} {'peak RSS MB':>12}")
    for r in rows:
        rss_s = f"{r['peak_rss_mb']:.0f}" if r["peak_rss_mb"] else "-"
        print(f"{r['impl']:38} {r['decode_tok_s']:12.1f} {r['vs_binding']:10.3f} {r['ttft_ms']:8.1f} {rss_s:>12}")


def compare_trees(args) -> None:
    """Rounds of one measurement in each checkout, alternating, each in a fresh process: medians."""
    import os
    from pathlib import Path

    trees = {"before": Path(args.before).resolve(), "after": Path(__file__).resolve().parents[1]}
    extra = ["--pair"] if args.pair else (["--model", args.model] if args.model else [])
    got: dict[str, list[dict]] = {k: [] for k in trees}
    loads = []
    for rnd in range(args.rounds):
        for name in (list(trees) if rnd % 2 == 0 else list(trees)[::-1]):
            tree = trees[name]
            out = subprocess.run([str(tree / ".venv" / "bin" / "python"), "-m", "benchmarks.bench_decode", "--json",
                                  "--rounds", "1", "--no-rss", "--no-flash-choice", "--tokens", str(args.tokens),
                                  "--threads", str(args.threads), *extra], cwd=tree, capture_output=True, text=True,
                                 check=True).stdout
            rows = {r["impl"]: r for r in json.loads(out[out.index("["):])}
            got[name].append(rows["edgeinfer loop"])
            loads.append(os.getloadavg()[0])
            print(f"round {rnd + 1} {name}: {rows['edgeinfer loop']}", file=sys.stderr)
    print(f"greedy, {args.tokens} tokens, {args.threads} threads, median of {args.rounds} alternating rounds, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print("| checkout | decode tok/s | × binding (same process) | TTFT ms |\n| --- | ---: | ---: | ---: |")
    for name, rs in got.items():
        print(f"| {name} ({trees[name]}) | {statistics.median(r['decode_tok_s'] for r in rs):.1f} | "
              f"{statistics.median(r['vs_binding'] for r in rs):.3f} | {statistics.median(r['ttft_ms'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
