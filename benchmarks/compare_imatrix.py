"""edgeinfer's importance matrix beside llama.cpp's own `llama-imatrix`, on the same model, text and chunks.

Both run the model over the text in chunks of --ctx tokens (llama-imatrix with `-b CTX` so that
each chunk is one batch, as edgeinfer decodes it) and sum the squared inputs of every layer matmul.
The script prints both runs' entries and chunk counts and, per tensor, the largest relative
difference of the importances (in_sum2 / counts): llama-imatrix sums in float32, edgeinfer in
float64, so they agree within float32's rounding of a sum over the text's tokens. The tool comes
from benchmarks/build_llama_tools.sh (llama-imatrix).

    .venv/bin/python -m benchmarks.compare_imatrix [MODEL] [--text FILE] [--ctx 512] [--chunks N] [--threads 2]

MODEL defaults to an F16 copy of the default model (made in a scratch store).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_batch_curve import TOOLS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", help="a .gguf file (default: the default model as F16)")
    ap.add_argument("--text", help="calibration text (default: edgeinfer's shipped one)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tool = TOOLS / "llama-imatrix"
    if not tool.exists():
        raise SystemExit(f"{tool} not found: run benchmarks/build_llama_tools.sh")

    import warnings

    from edgeinfer import Store
    from edgeinfer.imatrix import read_imatrix
    from edgeinfer.imatrix_compute import calibration_text, compute_imatrix
    from edgeinfer.quantize import quantize_model

    scratch = Path(tempfile.mkdtemp(prefix="compare-imatrix-"))
    if args.model:
        model = Path(args.model)
    else:
        from edgeinfer.default_model import default_model_file

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = quantize_model(default_model_file(), "F16", store=Store(scratch / "store"), n_threads=args.threads).path
    text_file = Path(args.text) if args.text else scratch / "calibration.txt"
    if not args.text:
        text_file.write_text(calibration_text(), encoding="utf-8")

    theirs = scratch / "llama-imatrix.gguf"
    cmd = [str(tool), "-m", str(model), "-f", str(text_file), "-c", str(args.ctx), "-b", str(args.ctx),
           "-ub", str(args.ctx), "-t", str(args.threads), "-ngl", "0", "--no-ppl", "-o", str(theirs)]
    if args.chunks:
        cmd += ["--chunks", str(args.chunks)]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    t_theirs = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(f"llama-imatrix failed ({out.returncode}): {(out.stdout + out.stderr).strip().splitlines()[-3:]}")
    t0 = time.monotonic()
    ours = compute_imatrix(model, text=text_file.read_text(encoding="utf-8"), ctx=args.ctx, chunks=args.chunks,
                           output=scratch / "edgeinfer.gguf", n_threads=args.threads, store=Store(scratch / "store"))
    t_ours = time.monotonic() - t0
    a, b = read_imatrix(theirs), read_imatrix(ours.path)
    rel = {k: float(np.max(np.abs(b.entries[k] - v) / np.maximum(np.abs(v), 1e-30))) for k, v in a.entries.items()
           if k in b.entries}
    worst = max(rel, key=rel.__getitem__) if rel else "-"
    print(f"model {model.name}, text {text_file.name}, ctx {args.ctx}, threads {args.threads}")
    print(f"{'':14} {'entries':>8} {'chunks':>7} {'seconds':>8}")
    print(f"{'llama-imatrix':14} {len(a):>8} {a.chunk_count:>7} {t_theirs:>8.1f}")
    print(f"{'edgeinfer':14} {len(b):>8} {b.chunk_count:>7} {t_ours:>8.1f}")
    print(f"same tensors: {set(a.entries) == set(b.entries)}")
    values = sorted(rel.values())
    print(f"max |relative difference| per tensor: median {values[len(values) // 2]:.2g}, max {values[-1]:.2g} ({worst})")


if __name__ == "__main__":
    main()
