"""`edgeinfer convert SOURCE`: a Hugging Face model folder (or repo id) to GGUF in the store."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from ._common import ProgressBar, common_options, format_bytes

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        parents=[common_options()],
        help="convert a Hugging Face safetensors model to GGUF",
        description="Convert a Hugging Face model folder (config.json, *.safetensors, tokenizer.json or tokenizer.model) or a "
        "Hub repo id to GGUF and add it to the store as NAME:OUTTYPE.",
    )
    p.add_argument("source", metavar="SOURCE", help="a local model folder, or a Hub repo id like org/name")
    p.add_argument(
        "--outtype",
        choices=["f32", "f16", "bf16", "q8_0", "auto"],  # edgeinfer.convert.OUTTYPE_CHOICES (a test keeps them equal)
        default=None,
        help="tensor type of the output (default: bf16 for a bf16 checkpoint, else f16). Quantized checkpoints "
        "(FP8, AWQ, GPTQ, compressed-tensors, ModelOpt) are dequantized exactly; 'auto' writes their 4-bit layers "
        "straight into Q4_1/Q4_0 blocks (8-bit symmetric ones into Q8_0, NVFP4/MXFP4 into NVFP4/MXFP4) without "
        "re-quantizing, the rest as Q8_0",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write the GGUF here instead of into the store (a new "
                   "path or a regular file outside the store)")
    p.add_argument("--force", action="store_true", help="with -o: replace a file another store entry names (that "
                   "entry is then replaced by the new one)")
    p.add_argument("--name", help="store name (default: from the folder or repo name)")
    p.add_argument("--quant", metavar="TYPES", help="then quantize to these types, e.g. Q4_K_M,Q6_K")
    p.add_argument("--profile", metavar="NAME", help="then quantize with this quant profile")
    p.set_defaults(func=run_convert)


def _resolve_source(source: str) -> tuple[Path, str | None]:
    """A folder to convert and the repo id it came from (None for a local folder)."""
    from ..errors import ConversionError

    path = Path(source).expanduser()
    if path.is_dir():
        return path, None
    if "/" in source and not source.startswith((".", "/", "~")) and source.count("/") == 1:
        import edgeinfer

        bar = ProgressBar(f"pulling {source}", None, unit="B")

        def on_progress(ev: edgeinfer.DownloadProgress) -> None:
            bar.update(ev.done, ev.total, label=f"pulling {ev.file}")

        folder = edgeinfer.pull_source(source, on_progress=on_progress)
        bar.close()
        return Path(folder), source
    raise ConversionError(f"no such model folder: {source}")


def run_convert(args: argparse.Namespace) -> int:
    from ..convert import convert_model
    from ..errors import InvalidOptionError

    quant_types = [q.strip() for q in (args.quant or "").split(",") if q.strip()]
    if (quant_types or args.profile) and args.output:
        raise InvalidOptionError("--quant/--profile quantize into the store; they cannot be combined with -o")
    import edgeinfer

    store = edgeinfer.Store()
    # vetted before anything is pulled or written: never a device, a folder, a link, the store's own files
    replaced = store.check_output(args.output, force=args.force) if args.output else []
    folder, repo_id = _resolve_source(args.source)
    bar = ProgressBar("converting", None, unit="B")

    def on_progress(ev) -> None:  # ConvertProgress
        bar.update(ev.bytes_done, ev.bytes_total, label=f"[{ev.index}/{ev.count}] {ev.tensor}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = convert_model(
            folder, args.outtype, args.output, store=store, on_progress=on_progress, name=args.name, repo_id=repo_id
        )
    bar.label = "converted"
    bar.close()
    for old in replaced:  # their file now holds other weights: their manifests must not describe it
        if result.manifest is None or old.ref != result.manifest.ref:
            store.forget(old.ref)
            print(f"edgeinfer: note: {old.ref} named {args.output}; its store entry was dropped", file=sys.stderr)
    for w in caught:
        print(f"edgeinfer: warning: {w.message}", file=sys.stderr)
    if result.direct:
        worst = max(result.direct, key=lambda d: d.max_error)
        kinds = ", ".join(sorted({d.qtype for d in result.direct}))
        print(f"{len(result.direct)} {result.quantization} layers written directly as {kinds}; max |error| vs the "
              f"dequantized checkpoint {worst.max_error:.3g} ({worst.name})", file=sys.stderr)
    m = result.manifest
    where = f"{m.ref} ({result.path})" if m is not None and m.owned else str(result.path)
    print(
        f"{where}: {result.architecture}, {result.n_tensors} tensors, {format_bytes(result.output_bytes)}, "
        f"{m.bits_per_weight:.2f} bits/weight, {result.seconds:.1f}s"
        if m is not None
        else f"{where}: {result.architecture}, {result.n_tensors} tensors, {format_bytes(result.output_bytes)}"
    )
    if not (quant_types or args.profile):
        return 0
    from ..quantize import quantize_model

    source_ref = m.ref if m is not None else str(result.path)
    for qtype in quant_types or [None]:
        qbar = ProgressBar(f"quantizing {qtype or args.profile}", None, unit="")

        def on_q(ev) -> None:  # QuantizeProgress
            qbar.update(ev.tensor_index, ev.n_tensors, label=f"quantizing {ev.tensor_name}")

        q = quantize_model(source_ref, qtype, profile=args.profile, on_progress=on_q)
        qbar.close()
        print(f"{q.manifest.ref}: {format_bytes(q.size)}, {q.bits_per_weight:.2f} bits/weight")
    return 0
