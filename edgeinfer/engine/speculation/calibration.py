"""Measuring the target's decode costs by batch size on this machine (the policy's cost curve)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from ...errors import ContextLengthError
from ..llama.runtime import DecodeAborted, LlamaRuntime
from ..core.sequence import KVSequence
from .policy import CALIBRATION_SIZES, PREFILL_SIZES, CostModel

__all__ = ["CurveMeasurement", "measure_costs", "fit_costs", "IdleCalibration", "IDLE_SIZES", "IDLE_CALIBRATION_ENV",
           "idle_calibration_default"]


class CurveMeasurement:
    """Decode times by batch size at one or more context depths, measured one decode at a time —
    the one way the cost curve is measured (`measure_costs` for `edgeinfer bench`, `IdleCalibration`
    for a server while idle).

    Each `step(seq)` times the next decode: at each depth in turn, `reps` rounds over the sizes
    (alternating, so that load affects them alike). The sequence is brought to the depth first
    (filled with `tokens`, repeated) and back to it after; a recurrent/hybrid memory, which cannot
    drop what a decode appended, is emptied and filled again. Each size is decoded as it is used:
    a drafting size (CALIBRATION_SIZES) with every row's logits (a verification reads them all), a
    larger one with its last row's only (a prompt chunk: every row's logits add ~20 % to a 512-row
    chunk of the 1.5B, which would hide what the chunk sizes themselves cost). A size keeps its
    fastest time (`fastest`: other load only ever slows a decode down) or the median of its reps."""

    def __init__(self, sizes: Sequence[int], depths: Sequence[int] = (0,), reps: int = 2, *, fastest: bool = True,
                 tokens: Sequence[int] = ()):
        self.sizes = sorted(set(sizes))
        self.depths = sorted(set(depths))
        self.fastest = fastest
        self.tokens = list(tokens)
        self.todo = [(d, b) for d in self.depths for _ in range(reps) for b in self.sizes]
        self.runs: dict[int, dict[int, list[float]]] = {}
        self._fitted = False

    def pending(self) -> bool:
        return bool(self.todo)

    def _token(self, i: int, n_vocab: int) -> int:
        return self.tokens[i % len(self.tokens)] if self.tokens else (7919 * i + 13) % n_vocab

    def _fit_to(self, rt: LlamaRuntime) -> None:
        """Keep what a sequence of this runtime holds: sizes up to n_batch, depths below them."""
        room = rt.n_ctx // rt.n_seq_max - 1
        sizes = [b for b in self.sizes if b <= min(rt.n_batch, room)]
        deepest = room - max(sizes, default=0)
        self.todo = [(min(d, deepest), b) for d, b in self.todo if b in sizes]
        self.depths = sorted({d for d, _ in self.todo})
        self._fitted = True

    def step(self, seq: KVSequence) -> bool:
        """Time the next decode on `seq`; False when it was aborted (DecodeAborted: timed again later)."""
        rt = seq.runtime
        if not self._fitted:
            self._fit_to(rt)
        if not self.todo:
            return True
        d, b = self.todo[0]
        n_vocab = rt.facts.n_vocab
        if len(seq) != d or seq.cached[:d] != [self._token(i, n_vocab) for i in range(d)]:
            seq.clear()
            seq.decode_all([self._token(i, n_vocab) for i in range(d)])
        batch = [self._token(d + i, n_vocab) for i in range(b)]
        t0 = time.perf_counter()
        try:
            seq.decode(batch, logits_from=0 if b in CALIBRATION_SIZES else b - 1)
        except DecodeAborted:
            return False
        except ContextLengthError:
            self.todo = [(dd, s) for dd, s in self.todo if not (dd == d and s >= b)]  # no room for this many cells now
            return True
        seconds = time.perf_counter() - t0
        if d and seq.can_drop_suffix:
            seq.truncate(d)
        else:
            seq.clear()  # (a recurrent memory is filled again for the next decode at this depth)
        self.todo.pop(0)
        self.runs.setdefault(d, {}).setdefault(b, []).append(seconds)
        return True

    def seconds(self) -> dict[int, dict[int, float]]:
        """Depth -> size -> seconds: each size's fastest (or median) time."""
        keep = min if self.fastest else (lambda v: sorted(v)[len(v) // 2])
        return {d: {b: keep(v) for b, v in runs.items()} for d, runs in self.runs.items()}

    def costs(self) -> CostModel:
        """The curve fitted to what was measured (fit_costs)."""
        return fit_costs(self.seconds())

    def run(self, seq: KVSequence) -> CostModel:
        """Every decode now (nothing aborts them), the sequence cleared before and after; the curve."""
        seq.clear()
        try:
            while self.pending():
                self.step(seq)
        finally:
            seq.clear()
        return self.costs()


def measure_costs(seq: KVSequence, tokens: Sequence[int], depths: Sequence[int] = (64, 1024),
                  reps: int = 3, sizes: Sequence[int] = CALIBRATION_SIZES) -> CostModel:
    """The full curve for `edgeinfer bench`: every calibration size at two context depths (median
    of `reps`), fitted to t1 · (ρ(b) + α · b · d). The sequence is cleared before and after.
    `tokens` fill the context (repeated as needed)."""
    return CurveMeasurement(sizes, depths, reps, fastest=False, tokens=tokens).run(seq)


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
    """A server's cost curve, measured while no request runs: one decode at a time (a
    CurveMeasurement at depth 0), on an empty sequence of a free slot (`sequence()`),
    interruptible (the runtime's abort callback) when a request arrives. The results go into the
    live CostModel (`adopt`) when every size has been timed."""

    def __init__(self, costs: CostModel, sequence: Callable[[], KVSequence | None]):
        self.costs = costs
        self.sequence = sequence
        self.seq: KVSequence | None = None
        self.measurement = CurveMeasurement(IDLE_SIZES, (0,), _IDLE_REPS)
        self.armed = False  # a decode is under way: a submit should abort it

    @staticmethod
    def needed(costs: CostModel, n_batch: int) -> bool:
        return not all(costs.is_measured(b) for b in IDLE_SIZES if b <= n_batch)

    def pending(self) -> bool:
        return self.measurement.pending()

    @property
    def best(self) -> dict[int, float]:
        """The fastest time of each size timed so far."""
        return self.measurement.seconds().get(0, {})

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
        if stop():
            return
        try:
            with rt.abortable():
                self.measurement.step(seq)  # (aborted: this size is timed again later)
        finally:
            rt.abort_flag.clear()
        if not self.measurement.pending() and self.best:
            self.costs.adopt(self.best)

    def summary(self) -> str:
        return ", ".join(f"{b}:{t * 1e3:.1f}ms" for b, t in sorted(self.best.items()))
