"""The child side of `edgeinfer.validate.probe_load`, run as a script: `python -I load_probe.py FILE`.

Loads FILE in llama.cpp (weights mmap'd, a small context), tokenizes a text, decodes it, reads
the logits and detokenizes: the calls where llama.cpp asserts on a bad file. Exit status 0 means
it all worked; a failure prints one "edgeinfer-probe: ..." line on stderr and exits 3; an abort
kills this process, not the caller. llama.cpp's log goes to stderr so the parent can quote it.

It imports nothing but the standard library and llama.cpp's bindings (child_llama.py; not the
edgeinfer package), so the verdict on a file depends on llama.cpp alone, and it starts fast; `-I`
keeps the script's folder off sys.path.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["probe", "main"]

# Bytes beyond ASCII and a newline: byte-fallback and pre-tokenizer paths are exercised too.
_TEXT = "Hello, world!\nÜber 東京 ✓ 123"
_MAX_TOKENS = 16
# Drafters whose weights alone cannot run (llama.cpp reads the target's embeddings and head)
_DRAFTERS = (b"eagle3",)


def _llama():
    """llama.cpp's ctypes bindings without the rest of the llama_cpp package (child_llama.py, run
    by its path: -I keeps this folder off sys.path)."""
    import runpy
    from pathlib import Path

    return runpy.run_path(str(Path(__file__).with_name("child_llama.py")))["bindings"]()


def probe(path: str) -> None:
    ll = _llama()
    ll.llama_backend_init()

    @ll.llama_log_callback
    def on_log(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        sys.stderr.write(text.decode("utf-8", errors="replace"))

    ll.llama_log_set(on_log, ctypes.c_void_p(0))
    # On the host alone, whatever the parent's placement (edgeinfer.devices): the verdict is about
    # the file and is remembered per file, not per placement; a GPU would hold a second copy of the
    # weights for nothing, and an RPC worker would receive them twice over the network and could be
    # aborted by a bad file (this child exists so that only it dies).
    mparams = ll.llama_model_default_params()
    assert "n_gpu_layers" in {f[0] for f in type(mparams)._fields_}
    mparams.n_gpu_layers = 0
    model = ll.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        raise RuntimeError("llama.cpp could not load this model")
    try:
        vocab = ll.llama_model_get_vocab(model)
        n_vocab = ll.llama_vocab_n_tokens(vocab)
        arch = ctypes.create_string_buffer(64)
        ll.llama_model_meta_val_str(model, b"general.architecture", arch, len(arch))
        if arch.value in _DRAFTERS:
            return  # loaded; its context needs the target's (ctx_other), which a probe does not have
        n_ctx = max(1, min(64, ll.llama_model_n_ctx_train(model)))
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = min(32, n_ctx)
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = 1
        ctx = ll.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        try:
            data = _TEXT.encode()
            buf = (ll.llama_token * (len(data) + 8))()
            n = ll.llama_tokenize(vocab, data, len(data), buf, len(buf), True, False)
            tokens = list(buf[: max(n, 0)])[: min(_MAX_TOKENS, cparams.n_batch)] or [0]
            ids = (ll.llama_token * len(tokens))(*tokens)  # kept alive: the batch points into it
            status = ll.llama_decode(ctx, ll.llama_batch_get_one(ids, len(tokens)))
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            logits = ll.llama_get_logits_ith(ctx, -1)
            best = max(range(n_vocab), key=lambda i: logits[i])
            piece = ctypes.create_string_buffer(256)
            for t in [*tokens, best]:
                ll.llama_token_to_piece(vocab, t, piece, len(piece), 0, True)
                ll.llama_vocab_get_text(vocab, t)
        finally:
            ll.llama_free(ctx)
    finally:
        ll.llama_model_free(model)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -I load_probe.py FILE.gguf", file=sys.stderr)
        return 2
    try:
        probe(argv[0])
    except Exception as e:  # noqa: BLE001 - any failure is reported to the parent as one line
        print(f"edgeinfer-probe: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
