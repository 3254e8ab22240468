"""`edgeinfer imatrix MODEL`: an importance matrix from llama.cpp's own forward pass, kept with the model.

The method is llama-imatrix's: the text is tokenized once (special tokens as text) and cut into
chunks of `ctx` tokens, the first token of each replaced by BOS when the model adds one; the KV
cache is cleared for every chunk, which is decoded as one batch with outputs for every token (so the
last layer runs on every row); `imatrix_collect.ActivationCollector` sums the squared inputs of every
layer matmul. The file is llama.cpp's imatrix GGUF (`imatrix.write_imatrix`): `<tensor>.in_sum2`,
`<tensor>.counts`, `imatrix.chunk_count` (rows seen / ctx), `imatrix.chunk_size`, `imatrix.datasets`.

Without a text, the calibration text shipped with edgeinfer is used (edgeinfer/data/calibration.txt,
written for edgeinfer, Apache-2.0 like the rest of it, as data/SOURCES.md says; not the evaluation
text, so `eval` does not score what the matrix was fitted to). A store model's matrix is kept beside its file,
`models/<name>/<name>-<tag>.imatrix.gguf`, and recorded in its manifest (metrics["imatrix"]:
file, sha256, text hash, chunks), where `quantize` finds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cancel import CancelToken, raise_if_cancelled
from .errors import ContextLengthError, InvalidModelError, InvalidOptionError
from .fsutil import atomic_path, ensure_free_space, sha256_file
from .llama_backend import check_threads

if TYPE_CHECKING:
    from .store import ModelManifest, Store

__all__ = ["ImatrixProgress", "ImatrixResult", "compute_imatrix", "calibration_text", "stored_imatrix",
           "imatrix_file", "imatrix_for_quantize", "MAX_TEXT_BYTES", "MAX_CTX"]

MAX_TEXT_BYTES = 16 << 20  # a calibration text past this is refused before it is tokenized
MAX_CTX = 8192  # tokens a chunk (one batch: its logits are ctx x vocabulary floats)
_METRICS_KEY = "imatrix"


@dataclass(frozen=True)
class ImatrixProgress:
    chunk: int  # chunks done, 1-based
    n_chunks: int


@dataclass(frozen=True)
class ImatrixResult:
    path: Path
    model: str  # store ref or path
    entries: int  # weight tensors with data
    chunks: int
    ctx: int
    tokens: int  # of the whole text
    text_sha256: str
    dataset: str
    seconds: float


def calibration_text() -> str:
    """The calibration text shipped with edgeinfer (written for it; Apache-2.0)."""
    return (resources.files("edgeinfer") / "data" / "calibration.txt").read_text(encoding="utf-8")


def imatrix_file(store: Store, manifest: ModelManifest) -> Path:
    """Where a store model's importance matrix is kept: beside the model, in its name's folder."""
    return store.models_dir / manifest.name / f"{manifest.name}-{manifest.tag}.imatrix.gguf"


def stored_imatrix(manifest: ModelManifest | None) -> Path | None:
    """The importance matrix recorded for a store model, when its file is still the one recorded."""
    rec = manifest.metrics.get(_METRICS_KEY) if manifest is not None else None
    if not isinstance(rec, dict) or not isinstance(rec.get("file"), str):
        return None
    path = Path(rec["file"])
    with contextlib.suppress(OSError):
        if path.stat().st_size == rec.get("size") and sha256_file(path) == rec.get("sha256"):
            return path
    return None


def _tokens_and_bos(ll: Any, model: Any, text: str) -> tuple[list[int], int | None]:
    vocab = ll.llama_model_get_vocab(model)
    data = text.encode("utf-8")
    n_max = len(data) + 8
    buf = (ll.llama_token * n_max)()
    n = ll.llama_tokenize(vocab, data, len(data), buf, n_max, True, False)
    if n < 0:
        raise InvalidOptionError("the calibration text could not be tokenized")
    bos = ll.llama_vocab_bos(vocab) if ll.llama_vocab_get_add_bos(vocab) else None
    return list(buf[:n]), bos


def _collect(path: Path, text: str, ctx: int, chunks: int | None, n_threads: int,
             on_progress: Callable[[ImatrixProgress], None] | None, cancel: CancelToken):
    """Run the chunks through llama.cpp with the collector; (collector, chunks used, tokens)."""
    from .imatrix_collect import ActivationCollector
    from .llama_backend import backend

    ll = backend()
    collector = ActivationCollector(ll.ggml_backend_sched_eval_callback)
    mparams = ll.llama_model_default_params()
    mparams.n_gpu_layers = 0  # the callback reads host memory (a device copy would also work, untested)
    model = ll.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise InvalidModelError(f"{path.name}: llama.cpp could not load this model")
    ctx_ptr = batch = None
    try:
        tokens, bos = _tokens_and_bos(ll, model, text)
        available = len(tokens) // ctx
        if available < 1:
            raise ContextLengthError(f"the calibration text has {len(tokens)} tokens, fewer than one chunk of {ctx}")
        n_chunks = available if chunks is None else min(chunks, available)
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = ctx
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.cb_eval = collector.callback
        cparams.cb_eval_user_data = None
        ctx_ptr = ll.llama_init_from_model(model, cparams)
        if not ctx_ptr:
            raise InvalidModelError(f"{path.name}: llama.cpp could not create a context of {ctx} tokens")
        batch = ll.llama_batch_init(ctx, 0, 1)
        for i in range(n_chunks):
            raise_if_cancelled(cancel, "importance matrix cancelled")
            ll.llama_memory_clear(ll.llama_get_memory(ctx_ptr), True)
            chunk = tokens[i * ctx : (i + 1) * ctx]
            if bos is not None:
                chunk[0] = bos
            for j, tok in enumerate(chunk):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, j, 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = True  # every output, as llama-imatrix: the last layer runs on every row
            batch.n_tokens = ctx
            rc = ll.llama_decode(ctx_ptr, batch)
            if collector.error is not None:
                raise collector.error
            if rc != 0:
                raise InvalidModelError(f"{path.name}: llama_decode failed with code {rc}")
            if on_progress is not None:
                on_progress(ImatrixProgress(i + 1, n_chunks))
        return collector, n_chunks, len(tokens)
    finally:
        if batch is not None:
            ll.llama_batch_free(batch)
        if ctx_ptr:
            ll.llama_free(ctx_ptr)
        ll.llama_model_free(model)


def compute_imatrix(
    model: str | Path | None = None,
    *,
    text: str | None = None,
    dataset: str | None = None,
    ctx: int = 512,
    chunks: int | None = None,
    output: str | Path | None = None,
    store: Store | None = None,
    n_threads: int | None = None,
    on_progress: Callable[[ImatrixProgress], None] | None = None,
    cancel: CancelToken = None,
) -> ImatrixResult:
    """Compute `model`'s importance matrix (store ref or .gguf path; None: the default model).

    `text` (default: the shipped calibration text, `dataset` names it in the file), `ctx` tokens a
    chunk (llama-imatrix's -c), at most `chunks` chunks. Without `output` a store model's matrix is
    kept in the store beside it (replacing an older one) and recorded in its manifest; a path
    outside the store needs `output`. `cancel` is polled between chunks (`Cancelled`; nothing is
    left behind)."""
    from .fit import available_memory
    from .imatrix import write_imatrix
    from .store import Store
    from .validate import validate_file

    if isinstance(ctx, bool) or not isinstance(ctx, int) or not 16 <= ctx <= MAX_CTX:
        raise InvalidOptionError(f"ctx must be a whole number in [16, {MAX_CTX}], got {ctx!r}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise InvalidOptionError(f"chunks must be a whole number >= 1, got {chunks!r}")
    threads = check_threads(n_threads)
    store = store or Store()
    path, manifest = store.resolve(model)
    info = validate_file(path, store)
    tokens = info.metadata.get("tokenizer.ggml.tokens")
    n_vocab = int(getattr(tokens, "length", 0) or info.metadata.get(f"{info.architecture}.vocab_size") or 0)
    logits = ctx * n_vocab * 4  # every row's logits, as llama-imatrix asks for (the last layer runs on every row)
    if logits > available_memory() // 2:
        raise InvalidOptionError(f"ctx {ctx} needs {logits / 2**30:.1f} GiB of logits for a vocabulary of {n_vocab}: "
                                 "more than half the memory available; choose a smaller --ctx")
    if output is None and manifest is None:
        raise InvalidOptionError(f"{Path(path).name} is not a store model: give --output for its importance matrix")
    if text is None:
        text, dataset = calibration_text(), dataset or "edgeinfer:calibration.txt"
    if len(text.encode("utf-8")) > MAX_TEXT_BYTES:
        raise InvalidOptionError(f"the calibration text is larger than {MAX_TEXT_BYTES >> 20} MiB")
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    target = Path(output).expanduser() if output is not None else imatrix_file(store, manifest)  # type: ignore[arg-type]
    started = time.monotonic()
    collector, n_chunks, n_tokens = _collect(Path(path), text, ctx, chunks, threads, on_progress, cancel)
    if not collector.sums:
        raise InvalidModelError(f"{Path(path).name}: no layer matmul was seen (is it a decoder model?)")
    counts = {k: [float(v)] for k, v in collector.counts.items()}
    seen = max(collector.counts.values())
    ensure_free_space(target.parent, sum(s.nbytes for s in collector.sums.values()) + (1 << 20), "the importance matrix")
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        write_imatrix(tmp, collector.sums, counts, datasets=(dataset or "text",), chunk_count=seen // ctx, chunk_size=ctx)
    ref = manifest.ref if manifest is not None else str(path)
    if manifest is not None and output is None:
        store.update_metrics(manifest.ref, _METRICS_KEY, {
            "file": str(target), "size": target.stat().st_size, "sha256": sha256_file(target), "text_sha256": sha,
            "dataset": dataset or "text", "chunks": n_chunks, "ctx": ctx, "entries": len(collector.sums),
        })
    return ImatrixResult(target, ref, len(collector.sums), n_chunks, ctx, n_tokens, sha, dataset or "text",
                         time.monotonic() - started)


def imatrix_for_quantize(imatrix: str | Path | None, qtype: str, manifest: ModelManifest | None) -> tuple[Path | None, str]:
    """The importance matrix `quantize` uses, and how it was chosen: "file" (given), "store" (the
    source's kept matrix; None as the path: none is kept yet, `qtype` needs one, compute it), "none"
    (None asked for no matrix where `qtype` would use one), "" (none used, none useful). `imatrix`
    "auto" picks the store's for the types that use one (quant_types.IMATRIX_USED) and asks for one
    to be computed for those that need one (IMATRIX_REQUIRED)."""
    from .quant_types import IMATRIX_REQUIRED, IMATRIX_USED

    if imatrix is None:
        return None, "none" if qtype in IMATRIX_USED else ""
    if str(imatrix) != "auto":
        return Path(imatrix), "file"
    if qtype not in IMATRIX_USED:
        return None, ""
    kept = stored_imatrix(manifest)
    if kept is not None or qtype in IMATRIX_REQUIRED:
        if kept is None and manifest is None:
            raise InvalidOptionError(f"{qtype} needs an importance matrix: compute one with `edgeinfer imatrix MODEL "
                                     f"--output FILE` and pass --imatrix FILE")
        return kept, "store"
    return None, ""
