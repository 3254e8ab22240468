"""FP4 and i-quants on the default model: quality against F16 and decode speed, side by side.

    .venv/bin/python -m benchmarks.bench_fp4_iquants [--ctx 512] [--chunks N] [--rounds 5] [--threads 1]
        [--home DIR] [--speed-only]

With --home the store is kept, and a later run reuses the files it holds (--speed-only: decode
speed again, e.g. in a quieter window, without the quality pass).

1. The F16 reference: the default model (shipped as Q4_1) dequantized by llama.cpp's quantizer
   (no full-precision SmolLM2 is reachable offline; every quant below comes from those values).
2. Its importance matrix on the calibration text shipped with edgeinfer (`edgeinfer imatrix`).
3. FP4 beside the 4-bit types people use: NVFP4, MXFP4, Q4_K_M, IQ4_XS (IQ4_XS and the k-quant with
   the importance matrix where they use one: quantize's default).
4. The i-quants IQ3_XXS, IQ3_S, IQ3_M, IQ2_XS, IQ2_M each twice: with the model's importance
   matrix, and without one. The types llama.cpp refuses to make without one (IQ3_XXS, IQ2_XS, IQ2_M)
   get a uniform matrix instead (every column of every tensor equally important: the information
   the matrix adds taken away, which is what "without" can mean for them).
5. Every file evaluated on the same chunks of the shipped evaluation text against the F16 reference
   (KLD ± standard error, same-top %), and decode speed at batch 1 in alternating rounds (every
   model once per round), medians.

The default model's hidden size (576) is not a multiple of 256: the i-quants' 256-wide blocks fit
only ffn_down (1536 inputs); everything else falls back (to IQ4_NL mostly), so the effective bits
per weight (over every tensor, the Q8_0 token embedding included) are printed beside each type.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

from benchmarks._store import use_home

FP4_TABLE = ("NVFP4", "MXFP4", "Q4_K_M", "IQ4_XS")
IQUANTS = ("IQ3_M", "IQ3_S", "IQ3_XXS", "IQ2_M", "IQ2_XS")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=None, help="evaluation chunks (default: all the text holds)")
    ap.add_argument("--rounds", type=int, default=5, help="decode-speed rounds, alternating over the models")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--home", help="EDGEINFER_HOME (default: a fresh temporary store); files already there are reused")
    ap.add_argument("--speed-only", action="store_true", help="measure decode speed only (no evaluation)")
    args = ap.parse_args()
    if args.speed_only and not args.home:
        ap.error("--speed-only measures the files a run with the same --home left")
    tmp = use_home(args.home, "edgeinfer-fp4-iq-")

    import numpy as np

    from edgeinfer import Store
    from edgeinfer.bench import bench, measure_bandwidth
    from edgeinfer.cli._common import format_bytes, print_table
    from edgeinfer.evaluate import evaluate_many
    from edgeinfer.imatrix import read_imatrix, write_imatrix
    from edgeinfer.imatrix_compute import compute_imatrix, stored_imatrix
    from edgeinfer.quant_types import IMATRIX_REQUIRED, IMATRIX_USED
    from edgeinfer.quantize import quantize_model

    store = Store()
    name = "smollm2-135m-instruct"
    t0 = time.monotonic()
    ref = f"{name}:f16"
    if store.find(ref) is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_model(f"{name}:q4_1", "F16", allow_requantize=True, n_threads=args.threads)
    im_path = stored_imatrix(store.get(ref))
    if im_path is None:
        im = compute_imatrix(ref, n_threads=args.threads)
        print(f"importance matrix: {im.entries} tensors, {im.chunks} chunks of {im.ctx} ({im.tokens} tokens), "
              f"{im.seconds:.0f}s", flush=True)
        im_path = im.path
    entries = read_imatrix(im_path).entries
    uniform = im_path.with_name("uniform.imatrix.gguf")
    write_imatrix(uniform, {k: np.ones((1, v.size)) for k, v in entries.items()},
                  {k: np.ones(1) for k in entries}, datasets=("uniform",))

    made: dict[str, tuple[str, float, str]] = {}  # label -> (ref, quantize seconds (0: reused), imatrix)

    def make(label: str, qtype: str, tag: str, imatrix: object, how: str) -> None:
        existing = store.find(f"{name}:{tag}")
        if existing is not None:
            made[label] = (existing.ref, 0.0, how)
            return
        r = quantize_model(ref, qtype, imatrix=imatrix, tag=tag, n_threads=args.threads)  # type: ignore[arg-type]
        made[label] = (r.ref, r.seconds, how)

    for q in FP4_TABLE:
        make(q, q, q.lower(), "auto", "store" if q in IMATRIX_USED else "-")
    for q in IQUANTS:
        make(q, q, q.lower(), "auto", "store")
        if args.speed_only:
            continue  # one file per type: the variants without the matrix decode alike
        if q in IMATRIX_REQUIRED:
            make(f"{q} uniform", q, f"{q.lower()}-uniform", uniform, "uniform")
        else:
            make(f"{q} none", q, f"{q.lower()}-noimat", None, "none")
        print(f"  {q} twice", flush=True)

    results = {} if args.speed_only else {
        r.model: r for r in evaluate_many([m for m, _, _ in made.values()], ref, ctx=args.ctx, chunks=args.chunks,
                                          store=store, n_threads=args.threads)}
    order = [ref] + [m for m, _, _ in made.values()]
    bandwidth = measure_bandwidth()
    speeds: dict[str, list[float]] = {m: [] for m in order}
    for _ in range(args.rounds):
        for m in order:
            speeds[m].append(bench(m, prompt_tokens=32, decode_tokens=64, repeats=1, n_threads=args.threads,
                                   store=store, save=False, flash_depth=0, bandwidth=bandwidth).decode_tok_s)

    def row(label: str, m: str, seconds: float, imatrix: str) -> list[str]:
        man, e = store.get(m), results[m]
        return [label, imatrix, f"{man.bits_per_weight:.2f}", format_bytes(man.size), f"{e.kld:.4f} ± {e.kld_stderr:.4f}",
                f"{e.same_top * 100:.2f}", f"{e.ppl_ratio:.4f}", f"{statistics.median(speeds[m]):.1f}",
                f"{seconds:.0f}"]

    if args.speed_only:
        rows = [[label, f"{store.get(m).bits_per_weight:.2f}", f"{statistics.median(speeds[m]):.1f}",
                 " ".join(f"{v:.1f}" for v in speeds[m])] for label, m in [("F16", ref)] + [(k, v[0]) for k, v in made.items()]]
        print_table(rows, ["type", "bits/weight", "decode tok/s (median)", "every round"])
        print(f"\ndecode: {args.rounds} alternating rounds of 64 tokens after a 32-token prompt, {args.threads} thread(s)")
        return 0
    head = ["type", "imatrix", "bits/weight", "size", "KLD vs F16", "same-top %", "PPL ratio", "decode tok/s",
            "quantize s"]
    f16 = store.get(ref)
    first = [["F16 (ref)", "-", f"{f16.bits_per_weight:.2f}", format_bytes(f16.size), "0", "100.00", "1.0000",
              f"{statistics.median(speeds[ref]):.1f}", "-"]]
    print("\nFP4 beside the usual 4-bit types")
    print_table(first + [row(q, *made[q]) for q in FP4_TABLE], head)
    print("\ni-quants with the model's importance matrix and without")
    print_table([row(label, *v) for label, v in made.items() if label.split()[0] in IQUANTS], head)

    # the ladder by bits: a type with more bits should not be worse beyond the noise (2 standard errors)
    ladder = sorted(((store.get(m).bits_per_weight, label, results[m]) for label, (m, _, how) in made.items()
                     if how != "uniform" and how != "none"), key=lambda x: -x[0])
    out_of_order = [f"{a[1]} ({a[0]:.2f} b, {a[2].kld:.4f}) > {b[1]} ({b[0]:.2f} b, {b[2].kld:.4f})"
                    for i, a in enumerate(ladder) for b in ladder[i + 1:]
                    if a[0] > b[0] and a[2].kld > b[2].kld + 2 * (a[2].kld_stderr ** 2 + b[2].kld_stderr ** 2) ** 0.5]
    print("\nladder by bits/weight:", ", ".join(f"{label} {bits:.2f}" for bits, label, _ in ladder))
    print("more bits but worse KLD beyond 2 standard errors:", "; ".join(out_of_order) or "none")
    better = [label for label in IQUANTS
              if results[made[label][0]].kld < results[made[next(k for k in made if k.startswith(label + ' '))][0]].kld]
    print(f"KLD with the importance matrix below KLD without: {len(better)} of {len(IQUANTS)} ({', '.join(better)})")
    n = next(iter(results.values()))
    print(f"\n{n.positions} scored tokens ({n.chunks} chunks of {n.ctx}, second halves) of the shipped evaluation "
          f"text; decode: median of {args.rounds} alternating rounds of 64 tokens after a 32-token prompt, "
          f"{args.threads} thread(s). Total {time.monotonic() - t0:.0f}s.")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
