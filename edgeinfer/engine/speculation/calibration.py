"""Measuring the target's decode costs by batch size on this machine (the policy's cost curve)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..llama import LlamaRuntime
from .policy import CALIBRATION_SIZES, CostModel

__all__ = ["calibrate_costs", "measure_costs", "fit_costs"]


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


def measure_costs(rt: LlamaRuntime, tokens: Sequence[int], depths: Sequence[int] = (64, 1024),
                  reps: int = 3) -> CostModel:
    """The full curve for `edgeinfer bench`: every calibration size at two context depths (median
    of `reps`, sizes alternating so load affects them alike), fitted to t1 · (ρ(b) + α · b · d).
    The cache is cleared before and after. `tokens` fill the context (repeated as needed)."""
    pool = list(tokens) or [rt.bos if rt.bos >= 0 else 0]
    sizes = [b for b in CALIBRATION_SIZES if b <= rt.n_batch]
    depths = sorted({min(d, rt.n_ctx - max(sizes) - 1) for d in depths})
    seconds: dict[int, dict[int, float]] = {}
    for d in depths:
        rt.clear()
        rt.decode_all([pool[i % len(pool)] for i in range(d)])
        runs: dict[int, list[float]] = {b: [] for b in sizes}
        for _ in range(reps):
            for b in sizes:
                batch = [pool[(d + i) % len(pool)] for i in range(b)]
                t0 = time.perf_counter()
                rt.decode(batch, logits_from=0)
                runs[b].append(time.perf_counter() - t0)
                rt.truncate(d)
        seconds[d] = {b: sorted(v)[len(v) // 2] for b, v in runs.items()}
    rt.clear()
    return fit_costs(seconds)


def fit_costs(seconds: dict[int, dict[int, float]]) -> CostModel:
    """Fit t(b, d) = W(b) + c · b · d to decode times measured at one or more depths: c (attention
    seconds per row and context token) by least squares over every size's change with depth,
    W(b) the depth-0 part averaged over depths. Then t1 = W(1), ρ(b) = W(b) / t1, α = c / t1."""
    depths = sorted(seconds)
    num = den = 0.0
    for d0, d1 in zip(depths, depths[1:]):
        for b in seconds[d0].keys() & seconds[d1].keys():
            num += b * (seconds[d1][b] - seconds[d0][b]) * (d1 - d0)
            den += (b * (d1 - d0)) ** 2
    c = max(0.0, num / den) if den else 0.0
    sizes = set.intersection(*(set(v) for v in seconds.values()))
    w = {b: sum(seconds[d][b] - c * b * d for d in depths) / len(depths) for b in sizes}
    w = {b: max(t, 1e-6) for b, t in w.items()}
    return CostModel(w, attention=c / w[1] if 1 in w else 0.0)
