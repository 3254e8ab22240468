"""Speed of a model on this machine, next to its memory-bandwidth roofline.

Decoding one token at batch 1 reads every weight that token touches once, so decode speed is
bounded by (memory read bandwidth) ÷ (bytes streamed per token). The bandwidth is measured here
with numpy (the best of several sums over an array much larger than the caches); the bytes per
token are all tensor bytes except the token-embedding table, of which one row is read — unless the
model ties its output projection to it, in which case the whole table is streamed for the logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .gguf_file import GGUFInfo, read_gguf

if TYPE_CHECKING:
    from .store import Store

__all__ = ["BenchProgress", "BenchResult", "measure_bandwidth", "bytes_per_token", "bench", "bench_many"]

_bandwidth_cache: dict[int, float] = {}


@dataclass(frozen=True)
class BenchProgress:
    model: str
    phase: str  # "bandwidth" | "load" | "prefill+decode"
    model_index: int
    n_models: int


@dataclass(frozen=True)
class BenchResult:
    model: str
    prompt_tokens: int
    generated_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    bytes_per_token: int
    bandwidth_bytes_s: float
    roofline_tok_s: float
    roofline_fraction: float  # decode_tok_s / roofline_tok_s
    n_threads: int
    repeats: int

    def to_metrics(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("model")
        return d


def measure_bandwidth(size_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Memory read bandwidth in bytes/s: the best of `repeats` sums over a float64 array (cached per size)."""
    if size_bytes in _bandwidth_cache:
        return _bandwidth_cache[size_bytes]
    a = np.ones(size_bytes // 8, dtype=np.float64)
    a.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    del a
    _bandwidth_cache[size_bytes] = size_bytes / best
    return _bandwidth_cache[size_bytes]


def bytes_per_token(info: GGUFInfo) -> int:
    """Weight bytes read to decode one token."""
    names = {t.name: t for t in info.tensors}
    total = info.tensor_bytes
    emb = names.get("token_embd.weight")
    if emb is not None and "output.weight" in names:
        total -= emb.n_bytes - emb.n_bytes // emb.shape[1]  # one row of a separate embedding table
    return total


def _prompt_tokens(engine: Any, n: int) -> list[int]:
    from .evaluate import default_eval_text

    tokens = engine.tokenize(default_eval_text(), add_special=True)
    return tokens[:n]


def bench(
    model: str | Path | None,
    *,
    prompt_tokens: int = 256,
    decode_tokens: int = 64,
    repeats: int = 2,
    n_threads: int | None = None,
    store: Store | None = None,
    save: bool = True,
    bandwidth: float | None = None,
) -> BenchResult:
    """Prefill and decode tok/s at batch 1 (best of `repeats`), greedy, through the engine."""
    from .engine import load
    from .engine.options import GenerateOptions, LoadOptions, SamplingOptions
    from .store import Store

    store = store or Store()
    path, manifest = store.resolve(model)
    info = read_gguf(path)
    bw = bandwidth or measure_bandwidth()
    options = LoadOptions(n_ctx=max(512, prompt_tokens + decode_tokens + 16), n_threads=n_threads)
    best_prefill = best_decode = 0.0
    generated = 0
    with load(model=manifest.ref if manifest else str(path), options=options) as engine:
        prompt = _prompt_tokens(engine, prompt_tokens)
        gen_options = GenerateOptions(max_tokens=decode_tokens, sampling=SamplingOptions(temperature=0.0))
        for _ in range(max(1, repeats)):
            done = engine.generate(prompt, gen_options).result()
            best_prefill = max(best_prefill, done.stats.prefill_tok_s or 0.0)
            best_decode = max(best_decode, done.stats.decode_tok_s or 0.0)
            generated = done.stats.generated_tokens
        threads = options.threads
    bpt = bytes_per_token(info)
    roof = bw / bpt if bpt else 0.0
    result = BenchResult(
        model=manifest.ref if manifest else str(path),
        prompt_tokens=len(prompt),
        generated_tokens=generated,
        prefill_tok_s=best_prefill,
        decode_tok_s=best_decode,
        bytes_per_token=bpt,
        bandwidth_bytes_s=bw,
        roofline_tok_s=roof,
        roofline_fraction=best_decode / roof if roof else 0.0,
        n_threads=threads,
        repeats=max(1, repeats),
    )
    if save and manifest is not None:
        store.update_metrics(manifest.ref, "bench", result.to_metrics())
    return result


def bench_many(
    models: Sequence[str | Path],
    *,
    on_progress: Callable[[BenchProgress], None] | None = None,
    **kwargs: Any,
) -> list[BenchResult]:
    """Bench several models; the bandwidth is measured once."""
    if on_progress:
        on_progress(BenchProgress("", "bandwidth", 0, len(models)))
    bw = kwargs.pop("bandwidth", None) or measure_bandwidth()
    out = []
    for i, m in enumerate(models):
        if on_progress:
            on_progress(BenchProgress(str(m), "prefill+decode", i + 1, len(models)))
        out.append(bench(m, bandwidth=bw, **kwargs))
    return out
