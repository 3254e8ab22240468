"""Token sampling through llama.cpp's sampler chain (penalties → top-k → top-p → min-p → temp → dist).

Greedy decoding without penalties skips the chain and takes numpy's argmax of the zero-copy logits
row: the same token llama.cpp's greedy sampler picks, without building a candidates array.

Speculation with a sampling draft model needs the distributions themselves, not only a sample:
`sampling_distribution` is the chain's transforms (top-k → top-p → min-p → temperature → softmax,
as llama.cpp applies them) in numpy float64, and `verify_sampled_draft` is the rejection rule that
makes one speculative position distributed exactly as the target's p.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..llama_backend import backend
from .llama import LlamaRuntime, set_fields
from .options import SamplingOptions

__all__ = ["Sampler", "TokenDistribution", "sampling_distribution", "verify_sampled_draft"]


@dataclass(frozen=True)
class TokenDistribution:
    """A sampling distribution over a vocabulary: `probs[i]` is the probability of token `ids[i]`
    (ids ascending, distinct); every other token has probability 0."""

    ids: np.ndarray  # int64
    probs: np.ndarray  # float64, sums to 1

    def prob(self, tokens: np.ndarray | int) -> np.ndarray:
        """The probabilities of `tokens` (0 outside the support)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        at = np.minimum(np.searchsorted(self.ids, tokens), len(self.ids) - 1)
        return np.where(self.ids[at] == tokens, self.probs[at], 0.0)

    def draw(self, rng: np.random.Generator) -> int:
        i = int(np.searchsorted(np.cumsum(self.probs), rng.random() * self.probs.sum(), side="right"))
        return int(self.ids[min(i, len(self.ids) - 1)])

    @property
    def top(self) -> float:
        return float(self.probs.max())


def sampling_distribution(logits: np.ndarray, options: SamplingOptions) -> TokenDistribution:
    """The distribution llama.cpp's chain samples from for one logits row (no penalties): top-k on the
    raw logits, top-p on their softmax (smallest prefix by descending probability whose sum reaches
    top_p, at least one token), min-p (logit ≥ max + log min_p), then softmax(logits / temperature)
    over what is left. Greedy is the one-hot argmax. float64 on the (float32, zero-copy) row; only
    the top-k candidates are converted when top_k > 0."""
    n = logits.shape[0]
    if options.greedy:
        return TokenDistribution(np.array([int(np.argmax(logits))], dtype=np.int64), np.ones(1))
    if 0 < options.top_k < n:
        ids = np.argpartition(logits, n - options.top_k)[n - options.top_k :]
    else:
        ids = np.arange(n)
    z = logits[ids].astype(np.float64)
    order = np.argsort(-z, kind="stable")
    ids, z = ids[order], z[order]
    if options.top_p < 1.0:
        e = np.exp(z - z[0])
        cum = np.cumsum(e / e.sum())
        keep = int(np.searchsorted(cum, options.top_p, side="left")) + 1
        ids, z = ids[:keep], z[:keep]
    if options.min_p > 0.0:
        keep = max(1, int(np.count_nonzero(z >= z[0] + np.log(options.min_p))))
        ids, z = ids[:keep], z[:keep]
    e = np.exp((z - z[0]) / options.temperature)
    order = np.argsort(ids)
    return TokenDistribution(ids[order].astype(np.int64), (e / e.sum())[order])


def verify_sampled_draft(p: TokenDistribution, q: TokenDistribution, drafted: int,
                         rng: np.random.Generator) -> tuple[bool, int]:
    """Speculative sampling's rule for one drafted token x ~ q: keep it with probability
    min(1, p(x)/q(x)), else sample from normalise(max(0, p − q)). Either way the token returned is
    distributed as p. Returns (kept, token)."""
    px, qx = float(p.prob(drafted)), float(q.prob(drafted))
    if qx > 0.0 and rng.random() * qx < px:
        return True, drafted
    residual = np.maximum(p.probs - q.prob(p.ids), 0.0)  # zero wherever p is: p's support suffices
    total = residual.sum()
    if total <= 0.0:  # p == q (a rejection has probability 0 then): rounding only
        return False, p.draw(rng)
    return False, TokenDistribution(p.ids, residual / total).draw(rng)


class Sampler:
    """One request's sampler state (RNG, penalty history). Sample rows in order, without gaps."""

    def __init__(self, runtime: LlamaRuntime, options: SamplingOptions):
        self.runtime = runtime
        self.options = options
        self._argmax_only = options.greedy and options.repeat_penalty == 1.0
        self._chain = None
        self.seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(4), "little")
        # The request's one RNG for what is sampled in numpy (speculative sampling's draws).
        self.rng = np.random.default_rng(self.seed)
        # Whether `distribution` is exactly what the chain samples from (penalties depend on history).
        self.exact = not options.greedy and options.repeat_penalty == 1.0
        if self._argmax_only:
            return
        ll = backend()
        params = set_fields(ll.llama_sampler_chain_default_params(), no_perf=True)
        chain = ll.llama_sampler_chain_init(params)
        add = lambda s: ll.llama_sampler_chain_add(chain, s)  # noqa: E731
        if options.repeat_penalty != 1.0:
            add(ll.llama_sampler_init_penalties(options.repeat_last_n, options.repeat_penalty, 0.0, 0.0))
        if options.greedy:
            add(ll.llama_sampler_init_greedy())
        else:
            if options.top_k > 0:
                add(ll.llama_sampler_init_top_k(options.top_k))
            if options.top_p < 1.0:
                add(ll.llama_sampler_init_top_p(options.top_p, 1))
            if options.min_p > 0.0:
                add(ll.llama_sampler_init_min_p(options.min_p, 1))
            add(ll.llama_sampler_init_temp(options.temperature))
            add(ll.llama_sampler_init_dist(self.seed))
        self._chain = chain

    def prime(self, tokens: list[int]) -> None:
        """Feed the prompt into the penalty history without sampling."""
        if self._chain is not None and self.options.repeat_penalty != 1.0:
            ll = backend()
            for t in tokens[-self.options.repeat_last_n :] if self.options.repeat_last_n else []:
                ll.llama_sampler_accept(self._chain, t)

    def sample(self, row: int) -> int:
        """Sample (and accept) the token for batch row `row` of the last decode."""
        if self._argmax_only:
            return int(np.argmax(self.runtime.logits_row(row)))
        return int(backend().llama_sampler_sample(self._chain, self.runtime.ctx, row))

    def distribution(self, row: int) -> TokenDistribution:
        """The post-transform distribution of batch row `row` of the last decode (see `exact`)."""
        return sampling_distribution(self.runtime.logits_row(row), self.options)

    def draw(self, row: int) -> int:
        """Sample batch row `row` in numpy with the request's RNG (the chain's distribution, without
        its RNG): the target's draws when a sampling draft model speculates."""
        return self.distribution(row).draw(self.rng)

    def close(self) -> None:
        if self._chain is not None:
            backend().llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self) -> None:  # pragma: no cover - safety net
        self.close()
