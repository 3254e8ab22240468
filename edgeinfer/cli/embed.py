"""`edgeinfer embed`: one vector per line of a file (or of standard input)."""

from __future__ import annotations

import argparse
import json
import sys

from ._common import (
    INT32_MAX,
    THREADS_HELP,
    add_encoding_option,
    add_kv_options,
    common_options,
    ctx_type,
    decode_bytes,
    int_range,
    kv_options,
    threads_type,
)

__all__ = ["register"]

_MAX_INPUT_BYTES = 32 << 20  # `-f /dev/zero` must end, not fill memory


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "embed",
        parents=[common_options()],
        help="embed texts (one per line) with a model",
        description="Print one embedding per input line: its values separated by spaces, one line each (or --json, "
        "OpenAI's response shape). Pooling and normalization are the model's own (an embedding model declares "
        "them); a model that declares no pooling (a chat model) needs --pooling. No model means the default model.",
    )
    p.add_argument("model", nargs="?", help="model (store name or .gguf path; default: the default model)")
    p.add_argument("-f", "--file", help="texts, one per line ('-' for stdin; default: stdin when it is not a terminal)")
    add_encoding_option(p)
    p.add_argument("--pooling", choices=("mean", "cls", "last"), type=str.lower,
                   help="pooling of the token vectors (default: what the model declares)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalize the vectors (default: as the model's card says; on for embedding models)")
    p.add_argument("--dimensions", type=int_range(1, INT32_MAX), metavar="N",
                   help="keep the first N values (Matryoshka models only)")
    p.add_argument("--prompt-name", metavar="NAME",
                   help="prepend a prompt the model declares to every text (e.g. 'query' for Qwen3-Embedding's instruction)")
    p.add_argument("--truncate", action="store_true", help="cut texts longer than the context instead of failing")
    p.add_argument("--ctx", type=ctx_type, help="the longest input in tokens (default: min(model's, 4096))")
    p.add_argument("--threads", type=threads_type, help=THREADS_HELP)
    add_kv_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (OpenAI's embeddings response shape)")
    p.set_defaults(func=run)


def _read(args: argparse.Namespace) -> list[str]:
    import edgeinfer

    if args.file in (None, "-"):
        if args.file is None and sys.stdin.isatty():
            raise edgeinfer.InvalidOptionError("no input: give -f FILE (one text per line) or pipe the texts in")
        buffer = getattr(sys.stdin, "buffer", None)
        raw = buffer.read(_MAX_INPUT_BYTES + 1) if buffer is not None else sys.stdin.read(_MAX_INPUT_BYTES + 1).encode()
        what = "standard input"
    else:
        try:
            with open(args.file, "rb") as f:
                raw = f.read(_MAX_INPUT_BYTES + 1)
        except OSError as e:
            raise edgeinfer.InvalidOptionError(f"cannot read {args.file}: {e.strerror}") from None
        what = args.file
    if len(raw) > _MAX_INPUT_BYTES:
        raise edgeinfer.InvalidOptionError(f"{what} is larger than {_MAX_INPUT_BYTES >> 20} MiB")
    lines = decode_bytes(raw, what, args.encoding_errors).splitlines()
    if not lines:
        raise edgeinfer.InvalidOptionError(f"{what} holds no text (one text per line)")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            raise edgeinfer.InvalidOptionError(f"{what}: line {i} is empty (one text per line; remove blank lines)")
    return lines


def run(args: argparse.Namespace) -> int:
    import edgeinfer

    texts = _read(args)
    options = edgeinfer.EmbedOptions(pooling=args.pooling, normalize=args.normalize, dimensions=args.dimensions,
                                     truncate=args.truncate, prompt_name=args.prompt_name).validate()
    load = edgeinfer.LoadOptions(n_ctx=args.ctx, n_threads=args.threads, **kv_options(args)).validate()
    with edgeinfer.load(args.model, load) as engine:
        result = engine.embed(texts, options)
        name = engine.name
    out = sys.stdout
    if args.json:
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(result.tolist())]
        json.dump({"object": "list", "data": data, "model": name,
                   "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
                   "edgeinfer": {"pooling": result.pooling, "normalized": result.normalized,
                                 "dimensions": result.dimensions, "truncated": [i for i, t in enumerate(result.truncated) if t]}},
                  out)
        out.write("\n")
    else:
        for v in result.vectors:
            out.write(" ".join(f"{x:.9g}" for x in v.tolist()) + "\n")
    cut = sum(result.truncated)
    print(f"[{name}: {len(result)} texts, {result.prompt_tokens} tokens, {result.dimensions} dimensions, "
          f"{result.pooling} pooling{', normalized' if result.normalized else ''}"
          f"{f', {cut} truncated' if cut else ''}]", file=sys.stderr)
    return 0
