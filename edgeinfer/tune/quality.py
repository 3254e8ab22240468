"""A setup's quality: the KLD of its quant and KV-cache types against the model's reference.

The reference is the highest-precision model of the ladder (an F16/BF16/F32 rung, else the
full-precision ancestor `eval` would use, else the rung with the most bits per weight, said so).
KLD is `edgeinfer.evaluate`'s (llama-perplexity's method) on the first `chunks` chunks of `ctx`
tokens of the shipped evaluation text, the reference always with an f16 cache. A KLD already
measured is used as it is: `eval`'s result in the manifest (f16 cache, the same reference and
text), or an earlier tune's (kept in the store per file, reference, cache types and chunks). Only
what is missing is measured, in one `evaluate_many` call, so the reference's logits are computed
once for every rung and cache measured with it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .identity import file_identity

if TYPE_CHECKING:
    from ..store import ModelManifest, Store

__all__ = ["Quality", "choose_reference", "QUALITY_CHUNKS", "QUALITY_CTX"]

QUALITY_CTX = 512  # eval's chunk size
QUALITY_CHUNKS = 4  # 4 × 255 scored positions: KLD's standard error is a few % of it on these models
_CACHE_KIND = "tune-kld"
_FULL_PRECISION_BPW = 15.9


def choose_reference(target: ModelManifest, ladder: list[ModelManifest], store: Store) -> tuple[ModelManifest, str]:
    """The reference model and a note on it (empty when it is full precision)."""
    from ..evaluate import default_reference

    full = [m for m in ladder if m.bits_per_weight >= _FULL_PRECISION_BPW]
    if full:
        return max(full, key=lambda m: (m.bits_per_weight, -m.size)), ""
    ref = default_reference(target, store)
    found = store.find(ref) if ref and ":" in ref and "/" not in ref else None
    if found is not None:
        return found, ""
    best = max(ladder, key=lambda m: m.bits_per_weight)
    return best, (f"no full-precision model of {target.name} in the store: KLD is against {best.ref} "
                  f"({best.bits_per_weight:.2f} bits/weight; `tune --make` adds an F16 copy, or convert/pull the original)")


class Quality:
    """KLD by (rung ref, K type, V type) against one reference (see the module)."""

    def __init__(self, store: Store, reference: ModelManifest, *, chunks: int = QUALITY_CHUNKS, ctx: int = QUALITY_CTX,
                 n_threads: int | None = None, on_note: Callable[[str], None] = lambda _m: None):
        from ..evaluate import default_eval_text

        self.store = store
        self.reference = reference
        self.chunks = chunks
        self.ctx = ctx
        self.n_threads = n_threads
        self.note = on_note
        self.text_sha = hashlib.sha256(default_eval_text().encode("utf-8")).hexdigest()
        self.kld: dict[tuple[str, str, str], float] = {}
        self.err: dict[tuple[str, str, str], float] = {}  # the KLDs' standard errors, where known

    @property
    def tokens(self) -> int:
        """Tokens one model reads to measure a KLD."""
        return self.chunks * self.ctx

    def _cache_key(self, m: ModelManifest, k: str, v: str) -> str:
        ident = json.dumps([file_identity(self.reference.path), file_identity(m.path)], sort_keys=True)
        digest = hashlib.sha256(ident.encode()).hexdigest()[:24]
        return f"v1|{digest}|{k}/{v}|ctx{self.ctx}|c{self.chunks}|{self.text_sha[:16]}"

    def error(self, key: tuple[str, str, str]) -> float:
        """The standard error of a known KLD (0 when none was kept with it)."""
        return self.err.get(key, 0.0)

    def known_with_error(self, key: tuple[str, str, str]) -> tuple[float | None, float]:
        """`known` and `error` in one: the KLD (or None) and its standard error."""
        kld = self.known(key)
        return kld, self.error(key)

    def _keep(self, key: tuple[str, str, str], kld: object, err: object) -> float:
        self.kld[key] = float(kld)  # type: ignore[arg-type]
        if isinstance(err, (int, float)) and not isinstance(err, bool) and 0 <= err < 1e6:
            self.err[key] = float(err)
        return self.kld[key]

    def known(self, key: tuple[str, str, str]) -> float | None:
        """A KLD measured before (this run, an earlier tune, or `eval`), or None."""
        if key in self.kld:
            return self.kld[key]
        ref, k, v = key
        if ref == self.reference.ref and (k, v) == ("f16", "f16"):
            return 0.0
        m = self.store.find(ref)
        if m is None:
            return None
        ev = m.metrics.get("eval") if isinstance(m.metrics, dict) else None
        if (k, v) == ("f16", "f16") and isinstance(ev, dict) and ev.get("reference") == self.reference.ref \
                and ev.get("text_sha256") == self.text_sha and isinstance(ev.get("kld"), (int, float)) \
                and ev.get("kv_types", "f16/f16") == "f16/f16":
            return self._keep(key, ev["kld"], ev.get("kld_stderr"))
        try:
            cached = self.store.read_cache(_CACHE_KIND, self._cache_key(m, k, v))
        except OSError:
            cached = None
        if isinstance(cached, dict) and isinstance(cached.get("kld"), (int, float)) and not isinstance(cached["kld"], bool):
            return self._keep(key, cached["kld"], cached.get("kld_stderr"))
        return None

    def measure(self, keys: Iterable[tuple[str, str, str]], cancel: Callable[[], bool] = lambda: False) -> None:
        """Measure the KLD of every key not known yet, all in one evaluate_many call (one reference pass)."""
        from ..evaluate import evaluate_many

        missing = list(dict.fromkeys(key for key in keys if self.known(key) is None))
        if not missing or cancel():
            return
        what = ", ".join(f"{r.partition(':')[2] or r} {k if k == v else f'{k}/{v}'}" for r, k, v in missing)
        self.note(f"measuring KLD against {self.reference.ref} ({self.chunks} chunks of {self.ctx}): {what}")
        results = evaluate_many([r for r, _k, _v in missing], self.reference.ref, ctx=self.ctx, chunks=self.chunks,
                                store=self.store, n_threads=self.n_threads, save=False, cancel=cancel,
                                model_kv_types=[(k, v) for _r, k, v in missing])
        for (ref, k, v), r in zip(missing, results):
            assert r.kld is not None
            self._keep((ref, k, v), r.kld, r.kld_stderr)
            try:
                self.store.write_cache(_CACHE_KIND, self._cache_key(self.store.get(ref), k, v), {
                    "kld": r.kld, "kld_stderr": r.kld_stderr, "same_top": r.same_top, "positions": r.positions,
                    "model": ref, "reference": self.reference.ref})
            except OSError as e:
                self.note(f"KLD not kept in the store: {e}")
