"""Token sampling through llama.cpp's sampler chain (penalties → top-k → top-p → min-p → temp → dist).

Greedy decoding without penalties skips the chain and takes numpy's argmax of the zero-copy logits
row: the same token llama.cpp's greedy sampler picks, without building a candidates array.
"""

from __future__ import annotations

import os

import numpy as np

from ..llama_backend import backend
from .llama import LlamaRuntime, set_fields
from .options import SamplingOptions

__all__ = ["Sampler"]


class Sampler:
    """One request's sampler state (RNG, penalty history). Sample rows in order, without gaps."""

    def __init__(self, runtime: LlamaRuntime, options: SamplingOptions):
        self.runtime = runtime
        self.options = options
        self._argmax_only = options.greedy and options.repeat_penalty == 1.0
        self._chain = None
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
            seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(4), "little")
            add(ll.llama_sampler_init_dist(seed))
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

    def close(self) -> None:
        if self._chain is not None:
            backend().llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self) -> None:  # pragma: no cover - safety net
        self.close()
