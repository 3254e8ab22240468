"""The child side of `edgeinfer.validate.probe_load`: `python -m edgeinfer.load_probe FILE`.

Loads FILE in llama.cpp the way the engine does (weights mmap'd, a small context), tokenizes a
text, decodes it, reads the logits and detokenizes: the calls where llama.cpp asserts on a bad
file. Exit status 0 means it all worked; a failure prints one "edgeinfer-probe: ..." line on
stderr and exits 3; an abort kills this process, not the caller. llama.cpp's log goes to stderr
so the parent can quote its last line.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["probe", "main"]

# Bytes beyond ASCII and a newline: byte-fallback and pre-tokenizer paths are exercised too.
_TEXT = "Hello, world!\nÜber 東京 ✓ 123"


def probe(path: Path) -> None:
    from .engine.llama import LlamaRuntime, log_capture
    from .engine.options import LoadOptions
    from .gguf_file import read_gguf

    info = read_gguf(path)
    n_ctx = max(1, min(64, info.context_length or 64))
    with log_capture(lambda _level, text: sys.stderr.write(text)):
        rt = LlamaRuntime(path, LoadOptions(n_ctx=n_ctx, n_threads=1, n_batch=32))
        try:
            tokens = rt.tokenize(_TEXT, True, False)[: min(16, rt.n_batch)] or [0]
            rt.decode(tokens)
            row = rt.logits_row(-1)
            best = int(row.argmax())
            rt.piece(best)
            for t in tokens:
                rt.piece(t, True)
                rt.token_text(t)
        finally:
            rt.close()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m edgeinfer.load_probe FILE.gguf", file=sys.stderr)
        return 2
    try:
        probe(Path(argv[0]))
    except Exception as e:  # noqa: BLE001 - any failure is reported to the parent as one line
        print(f"edgeinfer-probe: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
