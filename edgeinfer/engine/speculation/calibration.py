"""Measuring the target's decode costs by batch size on this machine (the policy's cost curve)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from ...errors import ContextLengthError
from ..llama.runtime import DecodeAborted, LlamaRuntime
from ..core.sequence import KVSequence
from .policy import CALIBRATION_SIZES, PREFILL_SIZES, CostModel

__all__ = ["calibrate_costs", "measure_costs", "fit_costs", "IdleCalibration", "IDLE_SIZES", "IDLE_CALIBRATION_ENV",
           "idle_calibration_default"]



def calibrate_costs(seq: KVSequence, sample_tokens: Sequence[int], reps: int = 2) -> CostModel:
    """Time decodes of each batch size after what `seq` holds (fastest of `reps`: other load only
    ever slows a decode down), then drop them again."""
    rt = seq.runtime
    base = len(seq)
    pool = list(sample_tokens) or [rt.bos if rt.bos >= 0 else 0]

    def timed(b: int) -> float:
        toks = [pool[i % len(pool)] for i in range(b)]
        t0 = time.perf_counter()
        seq.decode(toks, logits_from=0)
        dt = time.perf_counter() - t0
        seq.truncate(base)
        return dt

    best: dict[int, float] = {}
    for _ in range(reps):
        for b in CALIBRATION_SIZES:
            if b > rt.n_batch or base + b >= rt.n_ctx:
                break
            best[b] = min(best.get(b, float("inf")), timed(b))
        best[1] = min(best[1], timed(1))
    return CostModel(best)


def measure_costs(seq: KVSequence, tokens: Sequence[int], depths: Sequence[int] = (64, 1024),
                  reps: int = 3, sizes: Sequence[int] = CALIBRATION_SIZES) -> CostModel:
    """The full curve for `edgeinfer bench`: every calibration size at two context depths (median
    of `reps`, sizes alternating so load affects them alike), fitted to t1 · (ρ(b) + α · b · d).
    The sequence is cleared before and after. `tokens` fill the context (repeated as needed)."""
    rt: LlamaRuntime = seq.runtime
    pool = list(tokens) or [rt.bos if rt.bos >= 0 else 0]
    sizes = [b for b in sizes if b <= rt.n_batch]
    depths = sorted({min(d, rt.n_ctx - max(sizes) - 1) for d in depths})
    seconds: dict[int, dict[int, float]] = {}
    for d in depths:
        seq.clear()
        seq.decode_all([pool[i % len(pool)] for i in range(d)])
        runs: dict[int, list[float]] = {b: [] for b in sizes}
        for _ in range(reps):
            for b in sizes:
                batch = [pool[(d + i) % len(pool)] for i in range(b)]
                t0 = time.perf_counter()
                seq.decode(batch, logits_from=0)
                runs[b].append(time.perf_counter() - t0)
                seq.truncate(d)
        seconds[d] = {b: sorted(v)[len(v) // 2] for b, v in runs.items()}
    seq.clear()
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


# Set to "0" for engines (and `edgeinfer serve`) that do not measure the curve while idle unless told
# to (BatchOptions.calibrate_when_idle): they start from the store's curve or the size prior and
# learn from the steps they take. For machines where minutes of busy cores at start cost more than a
# measured curve buys, and for the test suite's many short-lived servers.
IDLE_CALIBRATION_ENV = "EDGEINFER_IDLE_CALIBRATION"


def idle_calibration_default() -> bool:
    """BatchOptions.calibrate_when_idle's default: on, unless $EDGEINFER_IDLE_CALIBRATION is 0."""
    return os.environ.get(IDLE_CALIBRATION_ENV, "1").strip() != "0"


# Sizes the idle calibration times: the drafting sizes, then up to a full ubatch for the prefill budget.
IDLE_SIZES = tuple(sorted(set(CALIBRATION_SIZES) | set(PREFILL_SIZES)))
_IDLE_REPS = 2  # each size twice, the faster kept: other load only ever slows a decode down


class IdleCalibration:
    """A server's cost curve, measured while no request runs: one decode at a time, on an empty
    sequence of a free slot (`sequence()`), interruptible (the runtime's abort callback) when a
    request arrives. The results go into the live CostModel (`adopt`) when every size has been
    timed."""

    def __init__(self, costs: CostModel, sequence: Callable[[], KVSequence | None]):
        self.costs = costs
        self.sequence = sequence
        self.seq: KVSequence | None = None
        sizes = [b for b in IDLE_SIZES]
        self.todo = [b for _ in range(_IDLE_REPS) for b in sizes]
        self.best: dict[int, float] = {}
        self.armed = False  # a decode is under way: a submit should abort it

    @staticmethod
    def needed(costs: CostModel, n_batch: int) -> bool:
        return not all(costs.is_measured(b) for b in IDLE_SIZES if b <= n_batch)

    def pending(self) -> bool:
        return bool(self.todo)

    def interrupt(self) -> None:
        if self.seq is not None:
            self.seq.runtime.abort_flag.set()

    def step(self, stop: Callable[[], bool]) -> None:
        """Time the next size (unless `stop()` says a request is waiting)."""
        seq = self.seq = self.sequence()
        if seq is None:
            return
        rt = seq.runtime
        rt.abort_flag.clear()
        self.todo = [b for b in self.todo if b <= min(rt.n_batch, rt.n_ctx // rt.n_seq_max - 1)]
        if stop() or not self.todo:
            return
        b = self.todo[0]
        n_vocab = rt.facts.n_vocab
        tokens = [(7919 * i + 13) % n_vocab for i in range(b)]
        seq.clear()
        t0 = time.perf_counter()
        try:
            with rt.abortable():
                # A verification asks for every row's logits, a prompt chunk for its last row's only:
                # time each size as it is used (every row's logits add ~20 % to a 512-row chunk of
                # the 1.5B, which would hide what the chunk sizes themselves cost).
                seq.decode(tokens, logits_from=0 if b in CALIBRATION_SIZES else b - 1)
        except DecodeAborted:
            return  # a request came: this size is timed again later
        except ContextLengthError:
            self.todo = [s for s in self.todo if s < b]  # no room for this many cells now
            return
        finally:
            rt.abort_flag.clear()
        seconds = time.perf_counter() - t0
        seq.clear()
        self.todo.pop(0)
        self.best[b] = min(self.best.get(b, float("inf")), seconds)
        if not self.todo:
            self.costs.adopt(self.best)

    def summary(self) -> str:
        return ", ".join(f"{b}:{t * 1e3:.1f}ms" for b, t in sorted(self.best.items()))
