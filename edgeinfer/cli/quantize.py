"""`edgeinfer quantize MODEL --type T | --types A,B,C | --profile NAME`: llama.cpp's quants into the store."""

from __future__ import annotations

import argparse
import sys
import warnings

from ._common import ProgressBar, common_options, format_bytes, print_table, threads_type

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        parents=[common_options()],
        help="quantize a model into the store (k-quants, i-quants, FP4 through llama.cpp's quantizer)",
        description="Quantize a GGUF (store name or path) with llama.cpp's own quantizer. The result is a new "
        "store entry NAME:TYPE (e.g. smollm2-135m-instruct:q4_k_m); its effective bits per weight and the "
        "tensors that fell back to another type (rows not a multiple of 256) are reported. i-quants use the "
        "model's importance matrix (see --imatrix and `edgeinfer imatrix`).",
    )
    p.add_argument("model", help="source model: store name or .gguf path (ideally F16/BF16/F32)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--type", help="quant type, e.g. Q4_K_M, Q6_K, Q8_0")
    what.add_argument("--types", help="several quant types, comma-separated: a ladder in one go")
    what.add_argument("--profile", help="a named recipe (see `edgeinfer profiles`)")
    p.add_argument("--output-type", help="ggml type of output.weight, e.g. Q6_K")
    p.add_argument("--embedding-type", help="ggml type of token_embd.weight")
    p.add_argument("--override", action="append", default=[], metavar="PATTERN=TYPE",
                   help="tensor-name regex = ggml type (repeatable; first match wins)")
    p.add_argument("--imatrix", default="auto", metavar="FILE|auto|none",
                   help="importance matrix: a llama-imatrix GGUF file; 'auto' (the default): the one `edgeinfer "
                   "imatrix` kept with the source, for the types that use one (i-quants, k-quants below 4 bits), "
                   "computed first where the type needs one (IQ1_*, IQ2_*, IQ3_XXS, IQ3_XS); 'none': none "
                   "(the tag gets -noimat)")
    p.add_argument("--allow-requantize", action="store_true",
                   help="allow a source that is already quantized (quality is lost twice)")
    p.add_argument("--name", help="store name of the result (default: the source's name)")
    p.add_argument("--tag", help="store tag of the result (default: the quant type, lowercase)")
    p.add_argument("--force", action="store_true", help="replace an existing store entry of that name")
    p.add_argument("--threads", type=threads_type, help="threads (default: all cores)")
    p.set_defaults(func=run)


def _parse_overrides(items: list[str]) -> list[tuple[str, str]]:
    from edgeinfer.errors import InvalidOptionError

    out = []
    for item in items:
        pattern, sep, qtype = item.rpartition("=")
        if not sep or not pattern or not qtype:
            raise InvalidOptionError(f"--override {item!r}: expected PATTERN=TYPE")
        out.append((pattern, qtype))
    return out


def _compute_needed_imatrix(model: str, types: list[str], threads: int | None) -> None:
    """A type that needs an importance matrix gets one computed first, with a progress bar (the
    library would compute it silently)."""
    from edgeinfer.imatrix_compute import stored_imatrix
    from edgeinfer.quant_types import IMATRIX_REQUIRED
    from edgeinfer.store import Store

    needs = [t for t in types if t.upper() in IMATRIX_REQUIRED]
    if not needs:
        return
    _, manifest = Store().resolve(model)
    if manifest is not None and stored_imatrix(manifest) is None:
        from .imatrix import compute_with_progress

        print(f"{manifest.ref}: computing an importance matrix ({', '.join(needs)} need one)", file=sys.stderr)
        r = compute_with_progress(manifest.ref, n_threads=threads)
        print(f"{r.model}: importance matrix of {r.entries} tensors, {r.chunks} chunks -> {r.path}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from edgeinfer.errors import InvalidOptionError
    from edgeinfer.profiles import get_profile
    from edgeinfer.quantize import quantize_model

    profile = get_profile(args.profile) if args.profile else None
    if args.types:
        types = [t.strip() for t in args.types.split(",") if t.strip()]
        if args.tag and len(types) > 1:
            raise InvalidOptionError("--tag names one result; it cannot be used with several --types")
    else:
        types = [args.type or profile.weights]  # type: ignore[union-attr]
    overrides = _parse_overrides(args.override)
    imatrix = None if args.imatrix == "none" else args.imatrix
    if imatrix == "auto":
        _compute_needed_imatrix(args.model, types, args.threads)

    rows = []
    for qtype in types:
        bar = ProgressBar(f"{qtype:<7}", None)

        def progress(ev, bar=bar, qtype=qtype):  # noqa: ANN001
            bar.update(ev.tensor_index, ev.n_tensors, label=f"{qtype:<7} {ev.tensor_name[:28]:<28}")

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = quantize_model(
                    args.model, qtype, profile=profile, output_type=args.output_type,
                    embedding_type=args.embedding_type, overrides=overrides, imatrix=imatrix,
                    allow_requantize=args.allow_requantize, name=args.name, tag=args.tag,
                    overwrite=args.force, on_progress=progress, n_threads=args.threads,
                )
            finally:
                bar.label = f"{qtype:<7}"
                bar.close()
        for w in caught:
            print(f"edgeinfer: warning: {w.message}", file=sys.stderr)
        fb = result.fallbacks
        print(f"{result.ref}: {format_bytes(result.size)}, {result.bits_per_weight:.2f} bits/weight, "
              f"{result.seconds:.1f}s -> {result.path}")
        if fb:
            kinds: dict[str, int] = {}
            for f in fb:
                kinds[f"{f.requested}->{f.got}"] = kinds.get(f"{f.requested}->{f.got}", 0) + 1
            summary = ", ".join(f"{k} ×{n}" for k, n in sorted(kinds.items()))
            print(f"  {len(fb)} tensors fell back (row length not a multiple of the block): {summary}")
            print(f"  e.g. {fb[0].tensor} {list(fb[0].shape)}: {fb[0].reason}")
        rows.append([result.ref, format_bytes(result.size), f"{result.bits_per_weight:.2f}", str(len(fb)),
                     f"{result.seconds:.1f}"])
    if len(rows) > 1:
        print()
        print_table(rows, ["model", "size", "bits/weight", "fallbacks", "seconds"])
    return 0
