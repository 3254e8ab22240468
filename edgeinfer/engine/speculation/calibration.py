"""Measuring the target's decode costs by batch size on this machine (the policy's cost curve)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..llama import LlamaRuntime
from .policy import CALIBRATION_SIZES, CostModel

__all__ = ["calibrate_costs"]


def calibrate_costs(rt: LlamaRuntime, sample_tokens: Sequence[int], reps: int = 2) -> CostModel:
    """Time decodes of each batch size right after the prompt (fastest of `reps`: other load
    only ever slows a decode down), then drop them again."""
    base = len(rt.cached)
    pool = list(sample_tokens) or [rt.bos if rt.bos >= 0 else 0]

    def timed(b: int) -> float:
        toks = [pool[i % len(pool)] for i in range(b)]
        t0 = time.perf_counter()
        rt.decode(toks, logits_from=0)
        dt = time.perf_counter() - t0
        rt.truncate(base)
        return dt

    best: dict[int, float] = {}
    for _ in range(reps):
        for b in CALIBRATION_SIZES:
            if b > rt.n_batch or base + b >= rt.n_ctx:
                break
            best[b] = min(best.get(b, float("inf")), timed(b))
        best[1] = min(best[1], timed(1))
    return CostModel(best)
