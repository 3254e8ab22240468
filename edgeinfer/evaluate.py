"""Measured quality of a (quantized) model: perplexity, KL divergence, same-top %, Δp.

The method is llama-perplexity's (tools/perplexity/perplexity.cpp): the text is tokenized once,
cut into chunks of `ctx` tokens (the first token of each chunk replaced by BOS when the model adds
one), the KV cache is cleared for every chunk, and only the second half of each chunk is scored,
with the first half as context: row j predicts token j+1 for j in [ctx/2, ctx-1).

Against a reference model (by default the full-precision model this one was derived from):
- KLD: mean over positions of sum_v p_ref(v) * (log p_ref(v) - log p(v));
- same-top: share of positions where both models' most likely token is the same;
- Δp: mean of p(correct token) - p_ref(correct token) (llama-perplexity's definition), and its RMS.
All log-softmaxes are computed in float64 from llama.cpp's float32 logits. The reference's
log-probabilities are computed once per chunk and kept in memory (within a budget) so that a whole
ladder is evaluated with one reference pass.

`evaluate_kv` measures what KV-cache quantization alone costs: the same model with a quantized K
and/or V cache against itself with an f16 cache, on long chunks (4096 tokens by default) of which
only the last `scored` positions are scored, where the quantized cache holds the most context.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .cancel import CancelToken, raise_if_cancelled
from .errors import ContextLengthError, InvalidOptionError

if TYPE_CHECKING:
    from .store import ModelManifest, Store

__all__ = [
    "EvalProgress",
    "EvalResult",
    "evaluate",
    "evaluate_many",
    "evaluate_kv",
    "default_eval_text",
    "default_reference",
    "make_chunks",
    "log_softmax",
]

_FULL_PRECISION_BPW = 15.9  # F16/BF16/F32 files (plus their F32 norms) have at least 16 bits/weight


@dataclass(frozen=True)
class EvalProgress:
    model: str
    chunk: int  # 1-based, chunks finished so far
    n_chunks: int
    model_index: int = 1
    n_models: int = 1


@dataclass(frozen=True)
class EvalResult:
    model: str
    reference: str | None
    ctx: int
    chunks: int
    positions: int  # scored tokens
    ppl: float
    ppl_stderr: float  # of ln(PPL), i.e. of the mean NLL
    ref_ppl: float | None
    ppl_ratio: float | None
    kld: float | None
    kld_stderr: float | None
    same_top: float | None  # fraction in [0, 1]
    delta_p: float | None  # mean p(correct) - p_ref(correct)
    rms_delta_p: float | None
    text_sha256: str
    seconds: float
    kv_types: str = "f16/f16"  # K/V cache types the model ran with (the reference always f16/f16)

    def to_metrics(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("model")
        return d


def default_eval_text() -> str:
    """The evaluation text shipped with edgeinfer (self-written prose and code, ~30 kB)."""
    return (resources.files("edgeinfer") / "data" / "eval.txt").read_text(encoding="utf-8")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def make_chunks(tokens: Sequence[int], ctx: int, n_chunks: int | None, bos: int | None) -> list[list[int]]:
    """Cut tokens into chunks of ctx tokens as llama-perplexity does (BOS replaces each first token)."""
    available = len(tokens) // ctx
    if available < 1:
        raise ContextLengthError(f"the evaluation text has {len(tokens)} tokens, fewer than one chunk of {ctx}")
    n = available if n_chunks is None else min(n_chunks, available)
    if n < 1:
        raise InvalidOptionError(f"chunk count must be at least 1, got {n_chunks}")
    out = []
    for i in range(n):
        chunk = list(tokens[i * ctx : (i + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def default_reference(manifest: ModelManifest | None, store: Store) -> str | None:
    """The full-precision ancestor of a store model (following derived_from), or None."""
    seen = set()
    current = manifest
    while current is not None and current.derived_from and current.derived_from not in seen:
        seen.add(current.derived_from)
        parent = current.derived_from
        pm = store.find(parent) if ":" in parent and "/" not in parent else None
        if pm is None:
            return parent if Path(parent).exists() else None
        if pm.bits_per_weight >= _FULL_PRECISION_BPW:
            return pm.ref
        current = pm
    return current.ref if current is not manifest and current is not None else None


class _Acc:
    """Running sums over scored positions."""

    def __init__(self) -> None:
        self.nll: list[np.ndarray] = []
        self.ref_nll: list[np.ndarray] = []
        self.kld: list[np.ndarray] = []
        self.same: list[np.ndarray] = []
        self.dp: list[np.ndarray] = []

    def add(self, lp: np.ndarray, targets: np.ndarray, ref: tuple[np.ndarray, np.ndarray] | None) -> None:
        rows = np.arange(len(targets))
        self.nll.append(-lp[rows, targets])
        if ref is not None:
            ref_lp, ref_top = ref
            ref_lp64 = ref_lp.astype(np.float64)
            p_ref = np.exp(ref_lp64)
            self.kld.append((p_ref * (ref_lp64 - lp)).sum(axis=1))
            self.same.append(lp.argmax(axis=1) == ref_top)
            self.ref_nll.append(-ref_lp64[rows, targets])
            self.dp.append(np.exp(lp[rows, targets]) - np.exp(ref_lp64[rows, targets]))

    def result(self, model: str, reference: str | None, ctx: int, chunks: int, sha: str, seconds: float) -> EvalResult:
        nll = np.concatenate(self.nll)
        n = len(nll)
        stderr = float(nll.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0
        ppl = float(np.exp(nll.mean()))
        if reference is None:
            return EvalResult(model, None, ctx, chunks, n, ppl, stderr, None, None, None, None, None, None, None, sha, seconds)
        kld = np.concatenate(self.kld)
        ref_ppl = float(np.exp(np.concatenate(self.ref_nll).mean()))
        dp = np.concatenate(self.dp)
        return EvalResult(
            model=model,
            reference=reference,
            ctx=ctx,
            chunks=chunks,
            positions=n,
            ppl=ppl,
            ppl_stderr=stderr,
            ref_ppl=ref_ppl,
            ppl_ratio=ppl / ref_ppl,
            kld=float(kld.mean()),
            kld_stderr=float(kld.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0,
            same_top=float(np.concatenate(self.same).mean()),
            delta_p=float(dp.mean()),
            rms_delta_p=float(np.sqrt((dp * dp).mean())),
            text_sha256=sha,
            seconds=seconds,
        )


def _load(model: str | Path, ctx: int, n_threads: int | None, kv: tuple[str | None, str | None] = (None, None),
          placement: Mapping[str, Any] | None = None) -> Any:
    from .engine import load
    from .engine.core.options import LoadOptions

    options = LoadOptions(n_ctx=ctx, n_threads=n_threads, kv_type_k=kv[0], kv_type_v=kv[1], **dict(placement or {}))
    return load(model=str(model) if isinstance(model, Path) else model, options=options)


def _bos(engine: Any) -> int | None:
    """The BOS id when the model adds one (an empty text tokenizes to just [BOS]), else None."""
    with_special = engine.tokenize("", add_special=True)
    return with_special[0] if with_special else None


def evaluate_many(
    models: Sequence[str | Path],
    reference: str | Path | None = None,
    *,
    text: str | None = None,
    ctx: int = 512,
    chunks: int | None = None,
    store: Store | None = None,
    n_threads: int | None = None,
    save: bool = True,
    on_progress: Callable[[EvalProgress], None] | None = None,
    cache_budget_bytes: int = 1536 << 20,
    kv_type_k: str | None = None,
    kv_type_v: str | None = None,
    scored: int | None = None,
    cancel: CancelToken = None,
    placement: Mapping[str, Any] | None = None,
    model_kv_types: Sequence[tuple[str, str]] | None = None,
) -> list[EvalResult]:
    """Evaluate several models on the same chunks against one reference (computed once per chunk).

    With save=True, each store model's manifest gets the result under metrics["eval"] (and the
    reference, when it is a store model, its own PPL with KLD 0). `kv_type_k`/`kv_type_v` set the
    evaluated models' KV-cache types (the reference keeps f16); `scored` scores only the last
    `scored` positions of each chunk (default: its second half, as llama-perplexity).
    `cancel` (a threading.Event or a callable, see edgeinfer.cancel) is polled before each model
    and each chunk and raises `Cancelled`; the models finished before it keep their saved metrics.
    `placement` (LoadOptions fields n_gpu_layers, rpc, tensor_split) places every model loaded.
    `model_kv_types`: one (K, V) pair per model instead of `kv_type_k`/`kv_type_v` for all (a model
    may then be given twice, with two caches, against one reference pass).
    """
    from .store import Store

    if ctx < 16 or ctx % 2:
        raise InvalidOptionError(f"ctx must be an even number >= 16, got {ctx}")
    if scored is not None and not 1 <= scored <= ctx // 2:
        raise InvalidOptionError(f"scored positions must be in [1, {ctx // 2}] for ctx {ctx}, got {scored}")
    store = store or Store()
    text = default_eval_text() if text is None else text
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    first = ctx - 1 - scored if scored is not None else ctx // 2
    kv = (kv_type_k, kv_type_v)
    if model_kv_types is not None and len(model_kv_types) != len(models):
        raise InvalidOptionError(f"model_kv_types has {len(model_kv_types)} pairs for {len(models)} models")

    ref_engine = _load(reference, ctx, n_threads, placement=placement) if reference is not None else None
    try:
        # Tokenize with the reference's (or the first model's) tokenizer; all must share the vocabulary.
        tok_engine = ref_engine or _load(models[0], ctx, n_threads, placement=placement)
        try:
            tokens = tok_engine.tokenize(text, add_special=True)
            bos = _bos(tok_engine)
            vocab = tok_engine.n_vocab
        finally:
            if tok_engine is not ref_engine:
                tok_engine.close()
        chunk_list = make_chunks(tokens, ctx, chunks, bos)
        ref_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        per_chunk_bytes = (ctx - 1 - first) * vocab * 4
        ref_acc = _Acc()
        ref_done: set[int] = set()

        def ref_rows(i: int, chunk: list[int]) -> tuple[np.ndarray, np.ndarray]:
            if i in ref_cache:
                return ref_cache[i]
            assert ref_engine is not None
            lp = log_softmax(ref_engine.logits(chunk, start=first)[:-1])
            if i not in ref_done:
                ref_acc.add(lp, np.asarray(chunk[first + 1 :]), None)
                ref_done.add(i)
            entry = (lp.astype(np.float32), lp.argmax(axis=1))
            if (len(ref_cache) + 1) * per_chunk_bytes <= cache_budget_bytes:
                ref_cache[i] = entry
            return entry

        results = []
        ref_name = str(reference) if reference is not None else None
        for mi, model in enumerate(models):
            raise_if_cancelled(cancel, "evaluation cancelled")
            engine = _load(model, ctx, n_threads, model_kv_types[mi] if model_kv_types is not None else kv, placement)
            started = time.monotonic()
            try:
                if engine.n_vocab != vocab:
                    raise InvalidOptionError(f"{model} has a vocabulary of {engine.n_vocab}, the reference {vocab}")
                acc = _Acc()
                for i, chunk in enumerate(chunk_list):
                    raise_if_cancelled(cancel, "evaluation cancelled")
                    ref = ref_rows(i, chunk) if ref_engine is not None else None
                    lp = log_softmax(engine.logits(chunk, start=first)[:-1])
                    acc.add(lp, np.asarray(chunk[first + 1 :]), ref)
                    if on_progress is not None:
                        on_progress(EvalProgress(str(model), i + 1, len(chunk_list), mi + 1, len(models)))
                manifest = engine.manifest
            finally:
                engine.close()
            result = acc.result(manifest.ref if manifest else str(model), ref_name, ctx, len(chunk_list), sha,
                                time.monotonic() - started)
            result = replace(result, kv_types="/".join(engine.options.kv_types))
            results.append(result)
            if save and manifest is not None:
                store.update_metrics(manifest.ref, "eval", result.to_metrics())

        if save and ref_engine is not None and ref_engine.manifest is not None and len(ref_done) == len(chunk_list):
            nll = np.concatenate(ref_acc.nll)
            ppl = float(np.exp(nll.mean()))
            own = EvalResult(
                model=ref_engine.manifest.ref, reference=ref_engine.manifest.ref, ctx=ctx, chunks=len(chunk_list),
                positions=len(nll), ppl=ppl, ppl_stderr=float(nll.std(ddof=1) / np.sqrt(len(nll))), ref_ppl=ppl,
                ppl_ratio=1.0, kld=0.0, kld_stderr=0.0, same_top=1.0, delta_p=0.0, rms_delta_p=0.0,
                text_sha256=sha, seconds=0.0,
            )  # the reference against itself: exact by definition (same engine, same logits)
            store.update_metrics(ref_engine.manifest.ref, "eval", own.to_metrics())
        return results
    finally:
        if ref_engine is not None:
            ref_engine.close()


def evaluate(
    model: str | Path,
    reference: str | Path | None = "auto",
    *,
    text: str | None = None,
    ctx: int = 512,
    chunks: int | None = None,
    store: Store | None = None,
    n_threads: int | None = None,
    save: bool = True,
    on_progress: Callable[[EvalProgress], None] | None = None,
    scored: int | None = None,
    cancel: CancelToken = None,
    placement: Mapping[str, Any] | None = None,
) -> EvalResult:
    """Evaluate one model. reference="auto": the full-precision model it was derived from, if any.
    `cancel` stops it between chunks with `Cancelled` (see evaluate_many)."""
    from .store import Store

    store = store or Store()
    if reference == "auto":
        _, manifest = store.resolve(model)
        reference = default_reference(manifest, store)
    return evaluate_many([model], reference, text=text, ctx=ctx, chunks=chunks, store=store,
                         n_threads=n_threads, save=save, on_progress=on_progress, scored=scored,
                         cancel=cancel, placement=placement)[0]


def evaluate_kv(
    model: str | Path | None,
    kv_type_k: str = "f16",
    kv_type_v: str = "f16",
    *,
    text: str | None = None,
    ctx: int = 4096,
    chunks: int | None = None,
    scored: int | None = 512,
    store: Store | None = None,
    n_threads: int | None = None,
    on_progress: Callable[[EvalProgress], None] | None = None,
    cancel: CancelToken = None,
    placement: Mapping[str, Any] | None = None,
) -> EvalResult:
    """What KV-cache quantization alone costs `model`: KLD, same-top and Δp of the model with
    K/V caches of `kv_type_k`/`kv_type_v` against the same weights with an f16 cache, on chunks of
    `ctx` tokens, scoring the last `scored` positions of each (None: the second half). Not saved.
    `cancel` as in evaluate_many."""
    from .store import Store

    store = store or Store()
    path, _ = store.resolve(model)
    return evaluate_many([path], path, text=text, ctx=ctx, chunks=chunks, store=store, n_threads=n_threads,
                         save=False, on_progress=on_progress, kv_type_k=kv_type_k, kv_type_v=kv_type_v,
                         scored=scored, cancel=cancel, placement=placement)[0]
