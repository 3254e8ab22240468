"""Speculative decoding vs plain decoding on the default model in F16 and Q8_0.

Greedy, 256 tokens, decode tok/s excluding prefill, three workloads (code edit, RAG quote, free
chat), rows: plain, lookup, self-draft Q3_K_M, auto, and llama-cpp-python's own
LlamaPromptLookupDecoding (with logits_all=True, the way it has to run). All rows are measured
alternately in one run, so machine load affects them alike; the table reports medians and the
ratio to plain measured in the same rounds. Also checks that every speculative row produced the
same tokens as plain (lossless).

    .venv/bin/python benchmarks/bench_speculative.py [--rounds 3] [--tokens 256] [--quants F16,Q8_0]
        [--rows lookup,auto] [--workloads "code edit"]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

WORKLOADS = Path(__file__).resolve().parent / "workloads"


def workloads() -> dict[str, tuple[list[dict[str, str]], str]]:
    """name -> (messages, start of the assistant's reply). The code edit starts the reply with a
    code fence, as editor integrations do; without it this 135M model tends to answer in prose."""
    code = (WORKLOADS / "code_edit.py").read_text()
    passage = (WORKLOADS / "rag_passage.txt").read_text()
    return {
        "code edit": ([{"role": "user", "content": "Here is a Python file:\n\n```python\n" + code + "```\n\nReturn the "
                        "whole file unchanged except that the function compute_total is renamed to total_stock_value."}],
                      "```python\n"),
        "RAG quote": ([{"role": "user", "content": "Passage:\n\n" + passage + "\nQuestion: what did Thomas Evans record, "
                        "and where are his logbooks now? Answer by quoting the passage word for word."}], ""),
        "free chat": ([{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}], ""),
    }


def make_models(store, quants: list[str]) -> dict[str, str]:
    """F16 (exact dequantization of the shipped Q4_1) and requantized copies, in a temp store."""
    import warnings

    from edgeinfer.default_model import default_model_file
    from edgeinfer.quantize import quantize_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f16 = quantize_model(default_model_file(), "F16", store=store, allow_requantize=True, name="bench")
    paths = {"F16": f16.ref}
    for q in quants:
        if q != "F16":
            paths[q] = quantize_model(f16.ref, q, store=store, name="bench").ref
    # the self-draft copy, made once up front so no row pays for it
    quantize_model(f16.ref, "Q3_K_M", store=store, name="bench")
    return paths


def run_ours(engine, prompt_tokens: list[int], n: int, spec) -> tuple[float, list[int], dict | None]:
    import edgeinfer

    engine.reset()
    opts = edgeinfer.GenerateOptions(max_tokens=n, sampling=edgeinfer.SamplingOptions(temperature=0.0),
                                     speculation=spec)
    done = engine.generate(prompt_tokens, opts).result()
    sp = done.stats.speculation.to_dict() if done.stats.speculation else None
    return done.stats.decode_tok_s, done.tokens, sp


def run_binding_lookup(llm, prompt_tokens: list[int], n: int) -> tuple[float, list[int], None]:
    llm.reset()
    t_first = None
    count = 0
    ids: list[int] = []
    for chunk in llm.create_completion(prompt_tokens, max_tokens=n, temperature=0.0, top_k=1, repeat_penalty=1.0,
                                       stream=True):
        count += 1
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return (count - 1) / (t_end - t_first) if count > 1 else 0.0, ids, None


def lossless_verdict(engine, prompt: list[int], plain: list[int], other: list[int] | None) -> str | None:
    """'yes', or where the outputs part and the top-2 logit margin there in a fresh context: a
    near-tie means batch-shape rounding (llama.cpp's logits differ in the last bits between batch sizes), a large margin would mean a bug."""
    import numpy as np

    if not other:
        return None
    if other == plain:
        return "yes"
    i = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), min(len(plain), len(other)))
    if i >= min(len(plain), len(other)):
        return f"prefix (lengths {len(plain)}/{len(other)})"
    row = engine.logits(prompt + plain[:i])[-1]
    top2 = np.sort(row)[-2:]
    return f"from token {i}: top-2 margin {top2[1] - top2[0]:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quants", default="F16,Q8_0")
    ap.add_argument("--no-binding", action="store_true", help="skip llama-cpp-python's prompt lookup row")
    ap.add_argument("--rows", default="", help="comma-separated subset of rows (plain is always run)")
    ap.add_argument("--workloads", default="", help="comma-separated subset of workloads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    import edgeinfer

    tmp = tempfile.TemporaryDirectory(prefix="edgeinfer-bench-")
    store = edgeinfer.Store(Path(tmp.name))
    quants = [q.strip().upper() for q in args.quants.split(",")]
    refs = make_models(store, quants)
    loads = workloads()
    if args.workloads:
        keep = {w.strip() for w in args.workloads.split(",")}
        loads = {k: v for k, v in loads.items() if k in keep}
    rows = {
        "plain": edgeinfer.SpeculationOptions(method="off"),
        "lookup": edgeinfer.SpeculationOptions(method="lookup"),
        "self-draft Q3_K_M": edgeinfer.SpeculationOptions(method="self", self_quant="Q3_K_M"),
        "auto": edgeinfer.SpeculationOptions(method="auto"),
    }
    if args.rows:
        keep = {r.strip() for r in args.rows.split(",")} | {"plain"}
        rows = {k: v for k, v in rows.items() if k in keep}
        args.no_binding = args.no_binding or "llama-cpp-python prompt lookup" not in keep
    results = []
    for quant in quants:
        engine = edgeinfer.load(refs[quant], n_ctx=4096, n_threads=args.threads, flash_attn=False, store=store)
        path = str(engine.path)
        binding = None
        if not args.no_binding:
            binding = llama_cpp.Llama(path, n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads,
                                      logits_all=True, verbose=False,
                                      draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
        for wname, (messages, reply_start) in loads.items():
            prompt_text = engine.render_chat(messages) + reply_start
            prompt_tokens = engine.tokenize(prompt_text, add_special=False, parse_special=True)
            impls = {name: (lambda s=spec: run_ours(engine, prompt_tokens, args.tokens, s)) for name, spec in rows.items()}
            if binding is not None:
                impls["llama-cpp-python prompt lookup"] = lambda: run_binding_lookup(binding, prompt_tokens, args.tokens)
            for f in impls.values():  # warm-up (and the cost calibration of the engine)
                f()
            speeds: dict[str, list[float]] = {k: [] for k in impls}
            ratios: dict[str, list[float]] = {k: [] for k in impls}
            tokens: dict[str, list[int]] = {}
            stats: dict[str, dict | None] = {}
            for _ in range(args.rounds):
                round_speed = {}
                for name, f in impls.items():
                    tps, toks, sp = f()
                    round_speed[name] = tps
                    tokens[name], stats[name] = toks, sp
                for name in impls:
                    speeds[name].append(round_speed[name])
                    ratios[name].append(round_speed[name] / round_speed["plain"])
            verdicts = {name: lossless_verdict(engine, prompt_tokens, tokens["plain"], tokens.get(name)) for name in impls}
            for name in impls:
                sp = stats.get(name)
                results.append({
                    "model": quant, "workload": wname, "row": name,
                    "decode_tok_s": round(statistics.median(speeds[name]), 1),
                    "vs_plain": round(statistics.median(ratios[name]), 3),
                    "acceptance": sp["acceptance_rate"] if sp else None,
                    "mean_accepted_len": sp["mean_accepted_len"] if sp else None,
                    "lossless": verdicts[name],
                })
        engine.close()
        if binding is not None:
            binding.close()
    tmp.cleanup()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"greedy, {args.tokens} tokens, {args.threads} threads, median of {args.rounds} alternating rounds; "
          "ratio = median of per-round ratios to plain")
    print(f"{'model':5} {'workload':10} {'row':32} {'tok/s':>7} {'× plain':>8} {'accept':>7} {'run':>5} same tokens as plain")
    for r in results:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        run = f"{r['mean_accepted_len']:.1f}" if r["mean_accepted_len"] is not None else "-"
        same = r["lossless"] or "-"
        print(f"{r['model']:5} {r['workload']:10} {r['row']:32} {r['decode_tok_s']:7.1f} {r['vs_plain']:8.3f} "
              f"{acc:>7} {run:>5} {same}")


if __name__ == "__main__":
    main()
