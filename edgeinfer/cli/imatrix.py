"""`edgeinfer imatrix MODEL`: an importance matrix from llama.cpp's forward pass, kept with the model."""

from __future__ import annotations

import argparse
from pathlib import Path

from ._common import INT32_MAX, ProgressBar, common_options, int_range, threads_type

__all__ = ["register", "compute_with_progress"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "imatrix",
        parents=[common_options()],
        help="compute an importance matrix (for i-quants), kept with the model",
        description="Run the model over a calibration text as llama-imatrix does (chunks of --ctx tokens, "
        "the sum of squared input activations of every layer matmul, per input column) and keep the result "
        "beside the model in the store, where `quantize` uses it for the i-quants (IQ1..IQ4) and the "
        "k-quants below 4 bits. Default text: the calibration text shipped with edgeinfer.",
    )
    p.add_argument("model", nargs="?", help="store model (ideally the F16/BF16 one you quantize from) or .gguf path")
    p.add_argument("--text", metavar="FILE", help="calibration text (default: edgeinfer's own, Apache-2.0)")
    p.add_argument("--ctx", type=int_range(16, 8192), default=512, help="tokens per chunk (llama-imatrix's -c)")
    p.add_argument("--chunks", type=int_range(1, INT32_MAX), help="at most this many chunks (default: all the text holds)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the imatrix GGUF here instead of keeping it in the store")
    p.add_argument("--threads", type=threads_type, help="threads (default: EDGEINFER_THREADS, else all cores)")
    p.set_defaults(func=run)


def compute_with_progress(model: str | None, **kwargs):  # noqa: ANN003, ANN201 - edgeinfer.imatrix_compute's
    from edgeinfer.imatrix_compute import compute_imatrix

    bar = ProgressBar("imatrix", None)
    try:
        return compute_imatrix(model, on_progress=lambda e: bar.update(e.chunk, e.n_chunks, label="imatrix chunks"),
                               **kwargs)
    finally:
        bar.close()


def run(args: argparse.Namespace) -> int:
    from edgeinfer.errors import InvalidOptionError, ModelNotFoundError

    text = None
    if args.text is not None:
        from edgeinfer.imatrix_compute import MAX_TEXT_BYTES

        path = Path(args.text)
        try:
            if path.stat().st_size > MAX_TEXT_BYTES:
                raise InvalidOptionError(f"{path}: larger than {MAX_TEXT_BYTES >> 20} MiB")
            text = path.read_text(encoding="utf-8", errors="replace")
        except (FileNotFoundError, IsADirectoryError):
            raise ModelNotFoundError(f"no such text file: {path}") from None
    r = compute_with_progress(args.model, text=text, dataset=Path(args.text).name if args.text else None,
                              ctx=args.ctx, chunks=args.chunks, output=args.output, n_threads=args.threads)
    print(f"{r.model}: {r.entries} tensors, {r.chunks} chunks of {r.ctx} tokens ({r.dataset}), "
          f"{r.seconds:.1f}s -> {r.path}")
    return 0
