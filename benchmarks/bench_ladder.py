"""The quant ladder of the default model: size, effective bits/weight, quality and speed per type.

    .venv/bin/python benchmarks/bench_ladder.py [--chunks 3] [--ctx 512] [--types Q2_K,...] [--home DIR]

1. An F16 reference is made from the default model (SmolLM2-135M-Instruct, shipped as Q4_1) with
   llama.cpp's quantizer and allow_requantize: it holds exactly the Q4_1 model's weights, dequantized.
   No full-precision SmolLM2 is reachable offline, so every quant below is a requantization of those
   values; KLD is measured against the model they came from, which is what a user's ladder does too.
2. Each type is quantized from that F16 file (time per quantization).
3. All of them are evaluated on the same chunks of the shipped evaluation text against the F16
   reference, whose logits are computed once per chunk (time per evaluation).
4. Decode speed at batch 1: every model once per round, rounds alternating, best kept, so that load
   from other processes on this shared machine hits all of them alike.

On a shared 2-core machine pass --threads 1: when other processes take a core, ggml's two-thread
barrier collapses (measured here: 0.5 decode tok/s with 2 threads vs 48 with 1, same model, same minute);
quality figures do not depend on the thread count (identical to 4 digits in both runs).

Reference figures from llama.cpp's llama-perplexity on this model at ctx 512 (another text):
Q8_0 KLD ≈ 0.004 / same-top ≈ 96.6 %, Q4_K_M ≈ 0.060 / 87.7 %, Q2_K ≈ 0.40 / 69 %.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

from benchmarks._store import use_home

LADDER = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "IQ4_XS", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--types", default=",".join(LADDER))
    ap.add_argument("--rounds", type=int, default=2, help="decode-speed rounds (alternating over models)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--home", help="EDGEINFER_HOME to use (default: a fresh temporary store)")
    args = ap.parse_args()

    tmp = use_home(args.home, "edgeinfer-ladder-")

    from edgeinfer import Store, read_gguf
    from edgeinfer.bench import bench, bytes_per_token, measure_bandwidth
    from edgeinfer.cli._common import format_bytes, print_table
    from edgeinfer.evaluate import EvalProgress, evaluate_many
    from edgeinfer.quantize import quantize_model

    store = Store()
    name = "smollm2-135m-instruct"
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    print(f"store {os.environ['EDGEINFER_HOME']}; ctx {args.ctx}, {args.chunks} chunks; threads {args.threads or os.cpu_count()}")

    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = quantize_model(f"{name}:q4_1", "F16", allow_requantize=True, n_threads=args.threads)
    print(f"reference {ref.ref}: requantized Q4_1 -> F16 with allow_requantize (dequantized Q4_1 weights), "
          f"{format_bytes(ref.size)}, {time.monotonic() - t0:.1f}s")

    quant_s: dict[str, float] = {}
    refs: dict[str, str] = {}
    for q in types:
        r = quantize_model(ref.ref, q, n_threads=args.threads)
        quant_s[q], refs[q] = r.seconds, r.ref
        print(f"  quantized {q:<7} {r.seconds:5.1f}s  {r.bits_per_weight:5.2f} bpw  {len(r.fallbacks)} fallbacks", flush=True)

    def progress(e: EvalProgress) -> None:
        print(f"  eval {e.model_index}/{e.n_models} {e.model} chunk {e.chunk}/{e.n_chunks}", file=sys.stderr, flush=True)

    t_eval = time.monotonic()
    results = evaluate_many([refs[q] for q in types], ref.ref, ctx=args.ctx, chunks=args.chunks, store=store,
                            n_threads=args.threads, on_progress=progress)
    eval_total = time.monotonic() - t_eval
    by_ref = {r.model: r for r in results}

    bw = measure_bandwidth()
    speed: dict[str, float] = {}
    order = [ref.ref] + [refs[q] for q in types]
    for _ in range(args.rounds):
        for m in order:
            b = bench(m, prompt_tokens=32, decode_tokens=48, repeats=1, n_threads=args.threads, store=store,
                      bandwidth=bw, save=False)
            speed[m] = max(speed.get(m, 0.0), b.decode_tok_s)
    roof = {m: bw / bytes_per_token(read_gguf(store.get(m).path)) for m in order}

    rows = []
    f16 = store.get(ref.ref)
    ref_ppl = results[0].ref_ppl if results else None
    rows.append(["F16 (ref)", f"{f16.bits_per_weight:.2f}", format_bytes(f16.size), f"{ref_ppl:.3f}", "1.0000",
                 "0", "100.00", f"{speed[ref.ref]:.1f}", f"{speed[ref.ref] / roof[ref.ref] * 100:.0f}%", "-", "-"])
    for q in types:
        m = store.get(refs[q])
        e = by_ref[refs[q]]
        rows.append([q, f"{m.bits_per_weight:.2f}", format_bytes(m.size), f"{e.ppl:.3f}", f"{e.ppl_ratio:.4f}",
                     f"{e.kld:.4f}", f"{e.same_top * 100:.2f}", f"{speed[refs[q]]:.1f}",
                     f"{speed[refs[q]] / roof[refs[q]] * 100:.0f}%", f"{quant_s[q]:.1f}", f"{e.seconds:.1f}"])
    print()
    print_table(rows, ["type", "bits/weight", "size", "PPL", "PPL ratio", "KLD", "same-top %", "decode tok/s",
                       "of roofline", "quantize s", "eval s"])
    n_pos = results[0].positions if results else 0
    print(f"\nPPL/KLD over {n_pos} scored tokens ({args.chunks} chunks × {args.ctx // 2 - 1}) of the shipped eval text; "
          f"eval s = one model's pass (the reference's logits are computed once per chunk, in the first model's time); "
          f"all evals {eval_total:.0f}s. Memory bandwidth {bw / 1e9:.1f} GB/s (numpy); decode best of {args.rounds} "
          f"alternating rounds of 48 tokens. Total {time.monotonic() - t0:.0f}s.")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
