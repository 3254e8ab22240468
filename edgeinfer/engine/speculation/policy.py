"""The speculation policy: how long a draft pays, from measured costs and observed acceptance.

Pure Python (no llama.cpp): the drafters and the benchmarks' replay use it alike. Speculation pays
only when accepted tokens outnumber the extra cost of verifying a batch, which on a CPU is large
and model-dependent (a Q8_0 target verifying 8 tokens costs ~3 single steps). So every step
chooses its draft length k by maximizing expected tokens per unit of time:

    E(k) / (cost(k + 1) + k · d)      against 1 for a plain step,

where cost(b) is the measured time of a b-token decode relative to a 1-token decode on this machine
(calibrated once per engine, then tracked online), d the drafter's cost per drafted token, and
E(k) = 1 + a0 + a0·a1 + … the expected tokens gained from per-position acceptance estimates.
k = 0 means a plain step: speculation switches itself off where it does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..options import SpeculationOptions

__all__ = ["CostModel", "AcceptanceModel", "LengthPolicy", "CALIBRATION_SIZES"]

# Both sides of the tile sizes where the curve jumps; other sizes are interpolated, then learned.
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33)
# Explorations draft at most this many tokens (the length that costs least for what it may buy:
# on Q8_0 a 4-token batch is cheaper than a 3-token one).
_EXPLORE_MAX = 4


class CostModel:
    """Time of one target decode of b tokens: t1 · ratio(b).

    The ratios are the shape of the cost curve relative to a one-token step. It is bumpy (batched
    kernels tile rows, so on Q8_0 a 4-token batch costs less than a 3-token one), so it is measured
    on both sides of the usual tile edges once per model and machine, interpolated between, and
    refined by each verification of a size. t1 follows the machine's current speed from plain
    steps: other processes come and go, and a curve whose points were measured at different times
    would tell the policy that batches are cheaper or dearer than they are.
    """

    def __init__(self, seconds: dict[int, float]):
        if not seconds:
            raise ValueError("a cost model needs at least one measured batch size")
        self.t1 = seconds.get(1) or min(seconds.values())
        self._ratio = {b: t / self.t1 for b, t in seconds.items()}
        self._ratio[1] = 1.0

    def to_dict(self) -> dict[str, float]:
        return {str(b): self.t1 * r for b, r in sorted(self._ratio.items())}

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> CostModel:
        return cls({int(b): float(t) for b, t in data.items()})

    def ratio(self, b: int) -> float:
        """Cost of a b-token decode in one-token decodes (interpolated between measured sizes,
        extrapolated linearly beyond the largest)."""
        r = self._ratio
        if b in r:
            return r[b]
        sizes = sorted(r)
        if b > sizes[-1]:
            if len(sizes) == 1:
                return r[sizes[-1]] * b / sizes[-1]
            b1, b2 = sizes[-2], sizes[-1]
            return r[b2] + (r[b2] - r[b1]) / (b2 - b1) * (b - b2)
        if b < sizes[0]:
            return r[sizes[0]]
        lo = max(s for s in sizes if s < b)
        hi = min(s for s in sizes if s > b)
        w = (b - lo) / (hi - lo)
        return r[lo] * (1 - w) + r[hi] * w

    def time(self, b: int) -> float:
        return self.t1 * self.ratio(b)

    def observe(self, b: int, seconds: float, weight: float = 0.1) -> None:
        """Learn from one real decode: t1 from plain steps, the ratio of b from batched ones
        (one outlier — a preempted step — moves either by at most a factor of 1.5)."""
        if seconds <= 0 or b < 1:
            return
        if b == 1:
            self.t1 = (1 - weight) * self.t1 + weight * min(seconds, 1.5 * self.t1)
            return
        old = self.ratio(b)
        new = min(max(seconds / self.t1, old / 1.5), old * 1.5)
        self._ratio[b] = (1 - 2 * weight) * old + 2 * weight * new


@dataclass
class AcceptanceModel:
    """P(draft i accepted | drafts before it accepted), per position, with a prior and decay
    (so it follows the text: high inside a copied span, low outside)."""

    prior: float = 0.7
    prior_weight: float = 4.0
    decay: float = 0.9
    hits: list[float] = field(default_factory=list)
    tries: list[float] = field(default_factory=list)

    def prob(self, i: int) -> float:
        if i < len(self.tries):
            return (self.hits[i] + self.prior * self.prior_weight) / (self.tries[i] + self.prior_weight)
        # Beyond what was seen: the last seen position is the best guess.
        if self.tries:
            return self.prob(len(self.tries) - 1)
        return self.prior

    def update(self, n_drafted: int, n_accepted: int) -> None:
        for i in range(len(self.tries)):
            self.hits[i] *= self.decay
            self.tries[i] *= self.decay
        while len(self.tries) < n_drafted:
            self.hits.append(0.0)
            self.tries.append(0.0)
        # Positions after the first rejection were never judged.
        for i in range(min(n_drafted, n_accepted + 1)):
            self.tries[i] += 1.0
            if i < n_accepted:
                self.hits[i] += 1.0


class LengthPolicy:
    """Chooses k, the number of tokens to draft, from measured costs and acceptance.

    Two acceptance states: 'run' after a step whose drafts were all accepted (inside a copied
    span), 'fresh' otherwise. A step is worth drafting only if its expected tokens per unit of time
    beat a plain step by `margin`. The priors (0.7 fresh, 0.9 in a run, worth four observations)
    were chosen by replaying recorded outputs (benchmarks/replay_speculation.py): they gain on
    copy-heavy text and still lose under 2 % on sampled prose where lookup finds nothing.
    """

    def __init__(self, costs: CostModel, opts: SpeculationOptions, margin: float = 0.03, prior: float = 0.7,
                 max_failed_explorations: int | None = None):
        self.costs = costs
        self.opts = opts
        self.margin = margin
        self.fresh = AcceptanceModel(prior=prior)
        self.run = AcceptanceModel(prior=max(prior, 0.9))
        self.in_run = False
        # Exploration: when the estimates say "don't draft", still try a short draft now and then
        # so they can recover; the interval doubles after each failed try (overhead O(log n)).
        self._idle = 0
        self._explore_after = 8
        # A draft model must first catch up on every token since its last draft, so exploring it
        # is expensive: give up for this request after a few unprofitable tries.
        self._max_failed = max_failed_explorations
        self._failed = 0
        self._exploring = False

    def model(self) -> AcceptanceModel:
        return self.run if self.in_run else self.fresh

    def expected_rate(self, k: int, draft_cost: float, model: AcceptanceModel | None = None) -> float:
        """Expected tokens per one-token-decode time when drafting k tokens."""
        m = model or self.model()
        e, p = 1.0, 1.0
        for i in range(k):
            p *= m.prob(i)
            e += p
        return e / (self.costs.ratio(k + 1) + k * draft_cost)

    def can_pay(self, draft_cost: float, acceptance: float = 0.9) -> bool:
        """Could a drafter of this cost (in target steps per drafted token) beat plain decoding
        even if it were accepted at `acceptance` per position, as a good same-family draft is?"""
        if not self.opts.adaptive:
            return True  # a fixed draft length is the user's explicit choice
        e, p, best = 1.0, 1.0, 0.0
        for k in range(1, max(self.opts.draft_max, 1) + 1):
            p *= acceptance
            e += p
            best = max(best, e / (self.costs.ratio(k + 1) + k * draft_cost))
        return best > 1.0 + self.margin

    def choose(self, max_len: int, draft_cost: float = 0.0, quality: float = 1.0) -> tuple[int, float]:
        """(k, expected rate). `quality` scales acceptance for this particular draft (e.g. a short
        n-gram match is weaker evidence than a long one)."""
        limit = min(max_len, self.opts.draft_max)
        if not self.opts.adaptive:
            return (limit if limit >= max(self.opts.draft_min, 1) else 0), 1.0
        m = self.model()
        best_k, best = 0, 1.0 + self.margin
        least_bad_k, least_bad = 1, 0.0  # what an exploration drafts: the best short length
        e, p = 1.0, 1.0
        for k in range(1, limit + 1):
            p *= m.prob(k - 1) * (quality if k == 1 else 1.0)
            e += p
            rate = e / (self.costs.ratio(k + 1) + k * draft_cost)
            if rate > best:
                best_k, best = k, rate
            if k <= _EXPLORE_MAX and rate > least_bad:
                least_bad_k, least_bad = k, rate
        if best_k and best_k < self.opts.draft_min:
            best_k = self.opts.draft_min if self.opts.draft_min <= limit else 0
        self._exploring = False
        if best_k == 0 and limit > 0:
            self._idle += 1
            if self._idle >= self._explore_after and (self._max_failed is None or self._failed < self._max_failed):
                self._idle = 0
                self._exploring = True
                best_k = least_bad_k
        return best_k, (best if best_k else 1.0)

    def observe(self, n_drafted: int, n_accepted: int, verify_s: float = 0.0, draft_s: float = 0.0) -> None:
        """Feedback from one step: what was drafted and accepted, and what it cost."""
        t1 = self.costs.time(1)
        self.costs.observe(n_drafted + 1, verify_s)
        if n_drafted <= 0:
            return
        self.model().update(n_drafted, n_accepted)
        self.in_run = n_accepted == n_drafted
        if self._exploring:
            # Judge an exploration by what it really bought: tokens per plain-step time,
            # drafting (and a draft model catching up) included. Unprofitable: wait twice as long.
            realized = (n_accepted + 1) * t1 / max(verify_s + draft_s, 1e-9)
            if realized < 1.0 + self.margin:
                self._explore_after = min(self._explore_after * 2, 1024)
                self._failed += 1
            else:
                self._explore_after = 8
                self._failed = 0
