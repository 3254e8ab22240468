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

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..core.options import DEFAULT_SPECULATION, SpeculationOptions

__all__ = ["CostModel", "AcceptanceModel", "LengthPolicy", "plan_drafts", "CALIBRATION_SIZES", "PREFILL_SIZES",
           "break_even_draft_cost"]

# Every size up to 9 and both sides of the tile sizes where the curve jumps; other sizes are
# interpolated, then learned. A size priced by interpolation is only learned once drafted, and on
# the slow AVX2 machine 7 rows cost 4.1 steps where 5 and 8 say 5.3: never drafted (see RESULTS.md,
# "What the code edits can reach on this machine").
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 32, 33)
# Prompt chunk sizes the prefill budget chooses among (the cheapest per row, see prefill_knee).
PREFILL_SIZES = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Explorations draft at most this many tokens (the length that costs least for what it may buy:
# on Q8_0 a 4-token batch is cheaper than a 3-token one).
_EXPLORE_MAX = 4
# A plain step in this many re-measures t1 (the unit every cost is expressed in): ≤ 1 % of the steps.
_T1_REFRESH = 64
_T1_MIN_GAP = 8
_UNTRIED_DISCOUNT = 0.9
# A run's estimates are kept by position in the run up to this many accepted tokens; deeper in a
# copy every position is priced as this one (bounded lists).
_RUN_DEPTH = 64
# The most a position without evidence of its own is priced at (AcceptanceModel.pooled).
FALLBACK_CAP = 0.98
# A size the curve was measured at (calibration: the faster of repeated decodes on a quiet machine)
# learns from one noisy step this much more slowly, and a step moves it by at most this factor:
# steps on a shared machine vary ±10 % and preempted ones 1.5–3×, and a curve that follows them
# flips near-tie choices (a 15- or a 31-token draft) from run to run (RESULTS.md, repeatability).
_TRUSTED_WEIGHT = 0.1
_TRUSTED_CLIP = 1.1


class CostModel:
    """Time of one target decode of b tokens after d tokens of context, in seconds:

        t(b, d) = t1 · (ρ(b) + α · b · d)

    ρ(b) (ρ(1) = 1) is the shape of the batch curve: batched kernels tile rows, so it is bumpy
    (on Q8_0 a 4-token batch costs less than a 3-token one). α is what attention adds per row and
    context token, relative to t1: on a 1.5B model after 800 tokens it makes a 16-token batch
    cost 10.7 steps instead of 7.3, so the curve must follow the depth it is used at. t1 is a
    one-token step at depth 0; it follows the machine's current speed from plain steps (other
    processes come and go). Each verification of b rows refines ρ(b); sizes never verified move
    with the ones that were (a prior's guess of the curve's level is wrong for all sizes alike).

    Two ways to get one: `prior(...)` from the model's size (no measuring, so the first request
    pays nothing), or measured (calibration.py's CurveMeasurement: `edgeinfer bench` at two depths,
    fitted; a server while idle, at depth 0). `CostModel({b: seconds})` takes decode times measured
    at `depth`.
    """

    def __init__(self, seconds: dict[int, float], *, attention: float = 0.0, depth: int = 0,
                 measured: bool = True):
        if not seconds:
            raise ValueError("a cost model needs at least one measured batch size")
        self.attention = max(0.0, attention)
        self.depth = depth  # where the policy uses it (set per step with at())
        t1 = seconds.get(1) or min(seconds.values())
        self.t1 = t1 / (1 + self.attention * depth)
        self._shape = {b: max(1.0, t / self.t1 - self.attention * b * depth) for b, t in seconds.items()}
        self._shape[1] = 1.0
        # Sizes whose shape comes from measurements (the rest are a prior's guess, interpolated).
        self._measured = set(self._shape) if measured else {1}
        # Sizes a calibration measured (not only one step): noisy steps move them slowly (observe).
        self._trusted = set(self._measured)
        # t1 is re-measured by each request's first plain step (the machine's load changes).
        self._t1_observed = False
        self.t1_stale = True
        self._suspect = False  # verifications surprised twice: shape learning waits for a new t1
        self._last_surprise = 0

    @classmethod
    def prior(cls, weight_bytes: int, n_layer: int, n_embd: int, *, slope: float = 0.45,
              bandwidth: float = 20e9, attention_rate: float = 13e9, max_b: int = 64) -> CostModel:
        """A guess from the model's size, good enough to start drafting: one step streams the
        weights (t1 = bytes / bandwidth), each extra row of a batch costs `slope` steps (0.45 on
        this 2-core CPU for 0.5B–1.5B k-quants: compute-bound by b≈4), attention does
        4 · n_layer · n_embd FLOPs per row and context token at `attention_rate`. All of it is
        then learned from the steps actually taken."""
        t1 = max(weight_bytes / bandwidth, 1e-4)
        attention = 4.0 * n_layer * n_embd / attention_rate / t1
        shape = {b: t1 * (1.0 + slope * (b - 1)) for b in range(1, max_b + 1)}
        return cls(shape, attention=attention, measured=False)

    @property
    def is_prior(self) -> bool:
        """Nothing but t1 has been measured: the curve is still a guess."""
        return self._measured <= {1}

    def to_dict(self) -> dict[str, float]:
        """Seconds by batch size at depth 0 (and "attention"): what the store keeps."""
        out = {str(b): self.t1 * r for b, r in sorted(self._shape.items()) if b in self._measured}
        out["attention"] = self.attention
        return out

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> CostModel:
        data = dict(data)
        attention = float(data.pop("attention", 0.0))
        return cls({int(b): float(t) for b, t in data.items()}, attention=attention)

    def adopt(self, seconds: dict[int, float], depth: int = 0) -> None:
        """Take a curve measured at `depth` (decode seconds by rows, one row included) as the
        shape of every size it has, made non-decreasing (a noisy bump must not say that more rows
        cost less); t1 keeps following the steps taken (the measurement seeds it if none did)."""
        t1 = seconds[1] / (1 + self.attention * depth)
        highest = 1.0
        for b in sorted(seconds):
            highest = max(highest, seconds[b] / t1 - self.attention * b * depth)
            self._shape[b] = highest
            self._measured.add(b)
            self._trusted.add(b)
        self._shape[1] = 1.0
        # Sizes still guessed (a prior's) would disagree with their measured neighbours: interpolate.
        self._shape = {b: r for b, r in self._shape.items() if b in self._measured}
        if not self._t1_observed:
            self.t1, self._t1_observed = t1, True

    def is_measured(self, b: int) -> bool:
        return b in self._measured

    def prefill_knee(self, n_max: int, tolerance: float = 0.05) -> int:
        """The smallest prompt chunk (rows, of PREFILL_SIZES) whose cost per row is within
        `tolerance` of the best the measured curve shows up to n_max; n_max itself while the curve
        is not measured that far (a prior, or only the small sizes drafting uses). Only the grid's
        sizes count: a step's odd size learned once (257 rows: a chunk and a decoding request)
        must not move the knee."""
        sizes = [b for b in PREFILL_SIZES if b <= n_max and b in self._measured]
        if not sizes or sizes[-1] < n_max // 2:
            return n_max
        per_row = {b: self._shape[b] / b for b in sizes}
        best = min(per_row.values())
        return next(b for b in sizes if per_row[b] <= best * (1 + tolerance))

    def optimism(self, b: int) -> float:
        """A factor on the predicted time of a b-row decode: sizes never verified (up to a few
        drafted rows) look a little cheaper than guessed, so each gets tried once and the curve's
        bumps are found."""
        return 1.0 if b in self._measured or b - 1 > _EXPLORE_MAX else _UNTRIED_DISCOUNT

    def new_request(self) -> None:
        """A request starts: its first plain step re-measures t1 under today's load."""
        self.t1_stale = True

    def at(self, depth: int) -> CostModel:
        """Use the curve at this context depth from now on (the drafter sets it every step)."""
        self.depth = max(0, depth)
        return self

    def shape(self, b: int) -> float:
        """ρ(b): a b-token decode at depth 0 in one-token decodes (interpolated between known
        sizes, extrapolated linearly beyond the largest)."""
        r = self._shape
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

    def ratio(self, b: int, depth: int | None = None) -> float:
        """Cost of a b-token decode in one-token decodes at `depth` (default: the current one)."""
        d = self.depth if depth is None else depth
        a = self.attention * d
        return (self.shape(b) + a * b) / (1.0 + a)

    def time(self, b: int, depth: int | None = None) -> float:
        d = self.depth if depth is None else depth
        return self.t1 * (self.shape(b) + self.attention * b * d)

    def observe(self, b: int, seconds: float, weight: float = 0.1, depth: int | None = None,
                plain: bool | None = None, prefill: bool = False) -> None:
        """Learn from one real decode: t1 from plain steps, ρ(b) from batched ones (one outlier —
        a preempted step — moves either by at most a factor of 1.5).

        A verification far off its prediction may mean the machine's speed changed, not the
        curve's shape: then `t1_stale` asks for a plain step to re-measure t1 before ρ(b) learns
        more (blaming the shape for a busier machine is what made the policy stop drafting).
        `plain`: a step without drafted rows (a batch's reference step); `prefill`: a step that
        carried prompt chunks (its size's shape is learned, but it raises no surprise: its rows
        attend over other lengths than decoding rows)."""
        if seconds <= 0 or b < 1:
            return
        d = self.depth if depth is None else depth
        a = self.attention * d
        # A plain step (no drafts) of a size whose shape is known measures t1; one row always is.
        if b == 1 or (plain and b in self._measured):
            seen_t1 = seconds / (self._shape[b] + a * b)
            if not self._t1_observed:  # a prior's or another session's t1: take the machine's now
                self.t1, self._t1_observed = seen_t1, True
            elif self.t1_stale:  # a step taken to re-measure t1: the machine's speed now
                self.t1 = min(max(seen_t1, self.t1 / 3), 3 * self.t1)
            else:
                self.t1 = (1 - weight) * self.t1 + weight * min(seen_t1, 1.5 * self.t1)
            self.t1_stale = self._suspect = False
            return
        old = self.shape(b)
        seen = max(1.0, seconds / self.t1 - a * b)
        if not prefill:
            surprise = 0 if 0.75 < seen / old < 1.33 else (1 if seen > old else -1)
            # Twice the same way in a row is the machine, not one preempted step.
            if surprise != 0 and surprise == self._last_surprise:
                self.t1_stale = self._suspect = True
            self._last_surprise = surprise
        if self._suspect:
            return  # t1 or the shape? Unclear until t1 is re-measured: learn nothing meanwhile
        w, clip = (2 * weight * _TRUSTED_WEIGHT, _TRUSTED_CLIP) if b in self._trusted else (2 * weight, 1.5)
        new = (1 - w) * old + w * min(max(seen, old / clip), old * clip)
        if old > 1.0:
            # Sizes never verified share what this one learned about the curve's level.
            scale = (new - 1.0) / (old - 1.0)
            for size in self._shape:
                if size not in self._measured:
                    self._shape[size] = 1.0 + (self._shape[size] - 1.0) * scale
        self._shape[b] = new
        self._measured.add(b)


def break_even_draft_cost(costs: CostModel, acceptance: float, *, depth: int | None = None,
                          draft_max: int = DEFAULT_SPECULATION.draft_max, margin: float = 0.03) -> float:
    """The most a drafted token may cost (in target steps) for a drafter accepted at `acceptance`
    per token to beat plain decoding by `margin` at some draft length: max over k of
    (E(k) / (1 + margin) − cost(k + 1)) / k, with E(k) = 1 + a + … + a^k. 0 if none pays."""
    best, e, p = 0.0, 1.0, 1.0
    for k in range(1, draft_max + 1):
        p *= acceptance
        e += p
        best = max(best, (e / (1 + margin) - costs.ratio(k + 1, depth)) / k)
    return best


@dataclass
class AcceptanceModel:
    """P(draft i accepted | drafts before it accepted), per position, with a prior and decay
    (so it follows the text: high inside a copied span, low outside)."""

    prior: float = 0.7
    prior_weight: float = 4.0
    decay: float = 0.9
    hits: list[float] = field(default_factory=list)
    tries: list[float] = field(default_factory=list)

    def pooled(self) -> float:
        """The per-token acceptance over every position judged lately (each decayed alike): what the
        text is doing now. A position is priced from its own evidence where it has some and from
        this where it has none, so a long draft is priced on fresh evidence: a position not tried
        for a while no longer decays back to the prior while position 0 climbs (a copy drafted 3
        tokens a step where 31 paid, RESULTS.md "What the code edits can reach"). Never below the
        prior (text that rejects often is priced as before: position by position) and at most
        FALLBACK_CAP (evidence from short drafts says little about a 30th token)."""
        pooled = (sum(self.hits) + self.prior * self.prior_weight) / (sum(self.tries) + self.prior_weight)
        return max(self.prior, min(pooled, FALLBACK_CAP))

    def prob(self, i: int) -> float:
        """P(the token at position i is accepted | the ones before it were)."""
        base = self.pooled()
        if i < len(self.tries):
            return (self.hits[i] + base * self.prior_weight) / (self.tries[i] + self.prior_weight)
        # Beyond what was seen: no better than the last seen position.
        return min(base, self.prob(len(self.tries) - 1)) if self.tries else base

    def update(self, n_drafted: int, n_accepted: int, start: int = 0) -> None:
        """A draft whose first token sits at position `start` (0: the draft's own positions; a run's
        model counts positions from the run's start, see LengthPolicy.origin)."""
        for i in range(len(self.tries)):
            self.hits[i] *= self.decay
            self.tries[i] *= self.decay
        while len(self.tries) < start + n_drafted:
            self.hits.append(0.0)
            self.tries.append(0.0)
        # Positions after the first rejection were never judged.
        for i in range(start, start + min(n_drafted, n_accepted + 1)):
            self.tries[i] += 1.0
            if i < start + n_accepted:
                self.hits[i] += 1.0


class LengthPolicy:
    """One request's drafter policy: acceptance estimates, exploration, and the draft length.

    Two acceptance states: 'run' after a step whose drafts were all accepted (inside a copied
    span) or when lookup's match is full (the text copies its source again: the drafter sets
    `full_match`), 'fresh' otherwise (see model()). A step is worth drafting only if its expected tokens per unit of time
    beat a plain step by `margin` (see `plan_drafts`, which sizes every request's draft of a step
    together from the batch's cost). The priors (0.7 outside a run, 0.9 in one, worth four observations)
    were chosen by replaying recorded outputs (benchmarks/replay_speculation.py): they gain on
    copy-heavy text and still lose under 2 % on sampled prose where lookup finds nothing.
    """

    def __init__(self, costs: CostModel, opts: SpeculationOptions, margin: float = 0.03, prior: float = 0.7,
                 max_failed_explorations: int | None = None, copies: bool = False):
        self.costs = costs
        # Drafts copied from earlier text (lookup, suffix): a run's positions count from the copy's
        # start (see origin). A draft model's or a head's i-th token is judged as the i-th of its draft.
        self.copies = copies
        self.opts = opts
        self.margin = margin
        self.fresh = AcceptanceModel(prior=prior)
        self.run = AcceptanceModel(prior=max(prior, 0.9))
        self.in_run = False
        self.streak = 0  # drafted tokens accepted in a row (the current run's length)
        # Set by a copying drafter each step: its match is full (LookupMatch.full), and how many tokens
        # before its place agree with the text's end (the copy's length so far): see model(), origin().
        self.full_match = False
        self.copied = 0
        # Exploration: when the estimates say "don't draft", still try a short draft now and then
        # so they can recover; the interval doubles after each failed try (overhead O(log n)).
        self._idle = 0
        self._explore_after = 8
        # A draft model must first catch up on every token since its last draft, so exploring it
        # is expensive: give up for this request after a few unprofitable tries.
        self._max_failed = max_failed_explorations
        self._failed = 0
        self.exploring = False
        # Costs are in units of t1, so t1 must be measured under today's load: each request's first
        # step is plain, and so is one step in `_T1_REFRESH` drafting steps (or after a surprise).
        costs.new_request()
        self._since_plain = _T1_REFRESH

    def model(self) -> AcceptanceModel:
        """The acceptance estimates for this step's evidence: inside a copy (a run of fully accepted
        drafts, or a full match: the text copies its source again after an insertion), or outside
        one (a short match, a draft model's guess). Each learns on its own, so the rejected short
        matches inside novel text (a docstring being written) do not stop drafting where the copy
        resumes."""
        return self.run if self.in_run or self.full_match else self.fresh

    def origin(self) -> int:
        """Where this step's draft starts among the estimates' positions. In a copy (a copying
        drafter's run or full match): how long the copy has gone on (the tokens its run accepted,
        or the drafter's agreement, if longer), because a copy ends where the text changes, not
        where a draft happens to end. A draft of 31 rejected at its 14th token, 55 tokens into a
        copy (a renamed name), says copies break after 55, not that drafts break after 14: by
        draft position, each resumed copy was priced short and ramped up again (3, 8, 15 before 31:
        RESULTS.md, edit-few). Otherwise a draft's positions are its own."""
        if not self.copies or not (self.in_run or self.full_match):
            return 0
        return min(max(self.streak, self.copied), _RUN_DEPTH)

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

    # -- one step ---------------------------------------------------------------------------------
    def refresh_due(self) -> bool:
        """Whether this step must be plain, to re-measure t1 under today's load (see __init__).
        On a very noisy machine surprises come often: re-measure at most once in a few steps."""
        if not self.opts.adaptive:
            return False
        due = self._since_plain >= _T1_REFRESH or (self.costs.t1_stale and self._since_plain >= _T1_MIN_GAP)
        if due:
            self.costs.t1_stale = True  # the plain step this asks for clears it
        return due

    def limit(self, max_len: int) -> int:
        return max(0, min(max_len, self.opts.draft_max))

    def gains(self, n: int, quality: float = 1.0) -> list[float]:
        """The expected tokens each of the first n drafted rows adds: the product of the acceptance
        estimates up to it. `quality` scales the first (a short n-gram match is weaker evidence)."""
        m, start = self.model(), self.origin()
        out, p = [], 1.0
        for i in range(n):
            p *= m.prob(start + i) * (quality if i == 0 else 1.0)
            out.append(p)
        return out

    def settle(self, k: int, limit: int, explore_gains: list[float], draft_cost: float = 0.0) -> int:
        """The length this request drafts given what the step's plan gave it (`k`): a fixed length
        when not adaptive, at least draft_min, and now and then a short exploration where the
        plan gave nothing (its length: the best rate among short drafts, from `explore_gains`)."""
        self.exploring = False
        if not self.opts.adaptive:
            return limit if limit >= max(self.opts.draft_min, 1) else 0
        self._since_plain += 1
        if k and k < self.opts.draft_min:
            k = self.opts.draft_min if self.opts.draft_min <= limit else 0
        if k == 0 and limit > 0:
            self._idle += 1
            if self._idle >= self._explore_after and (self._max_failed is None or self._failed < self._max_failed):
                self._idle = 0
                self.exploring = True
                return self._least_bad(explore_gains[:min(limit, _EXPLORE_MAX)], draft_cost)
        return k

    def explore_next(self) -> None:
        """Make the next step the plan gives nothing an exploration (a drafter whose cost is only
        an estimate: one short draft measures it, and its gate decides on that)."""
        self._idle = max(self._idle, self._explore_after - 1)

    def _least_bad(self, gains: list[float], draft_cost: float) -> int:
        best_k, best, e = 1, 0.0, 1.0
        for k, g in enumerate(gains, start=1):
            e += g
            rate = e / (self.costs.ratio(k + 1) * self.costs.optimism(k + 1) + k * draft_cost)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def choose(self, max_len: int, draft_cost: float = 0.0, quality: float = 1.0) -> tuple[int, float]:
        """(k, expected rate) for a request drafting alone: the one-request case of `plan_drafts`."""
        limit = self.limit(max_len)
        if self.refresh_due():
            return 0, 1.0
        gains = self.gains(limit, quality)
        t1 = self.costs.time(1)

        def cost(rows: int) -> float:  # in target steps at the current depth
            return self.costs.time(rows) * self.costs.optimism(rows) / t1 + (rows - 1) * draft_cost

        k = plan_drafts([gains], 1, cost, limit + 1, self.margin)[0] if self.opts.adaptive else limit
        k = self.settle(k, limit, gains, draft_cost)
        return k, ((1.0 + sum(gains[:k])) / cost(k + 1) if k else 1.0)

    def observe(self, n_drafted: int, n_accepted: int, verify_s: float = 0.0, draft_s: float = 0.0,
                plain_s: float | None = None, learn_costs: bool = True) -> None:
        """Feedback from one step: what was drafted and accepted, and what it cost. `plain_s`: what
        the step would have cost without this request's drafts (default: one plain step);
        `learn_costs` False when the step's time is learned elsewhere (a shared batch)."""
        baseline = self.costs.time(1) if plain_s is None else plain_s
        if learn_costs:
            self.costs.observe(n_drafted + 1, verify_s)
        if n_drafted <= 0:
            self._since_plain = 0
            return
        self.model().update(n_drafted, n_accepted, self.origin())
        self.in_run = n_accepted == n_drafted
        self.streak = self.streak + n_accepted if self.in_run else 0
        if self.exploring:
            # Judge an exploration by what it really bought: tokens per plain-step time,
            # drafting (and a draft model catching up) included. Unprofitable: wait twice as long.
            realized = (n_accepted + 1) * baseline / max(verify_s + draft_s, 1e-9)
            if realized < 1.0 + self.margin:
                self._explore_after = min(self._explore_after * 2, 1024)
                self._failed += 1
            else:
                self._explore_after = 8
                self._failed = 0


def plan_drafts(gains: Sequence[Sequence[float]], base_rows: int, cost: Callable[[int], float], max_rows: int,
                margin: float = 0.03, extra_cost: Callable[[list[int]], float] | None = None) -> list[int]:
    """How many drafted rows each request adds to a step that already has `base_rows` rows.

    gains[i][j] is what row j of request i's draft is worth: the expected tokens it adds (the
    product of acceptance estimates up to j, so it falls along a draft). Rows are taken in order
    of worth; with m of them the step yields (base_rows + their worth) tokens' worth of progress
    for cost(base_rows + m) (+ `extra_cost(counts)`: what drafting those counts costs, e.g. a draft
    model's decodes) — one unit per row already planned, a token or a prompt token. The m with the
    best rate wins if it beats m = 0 by `margin`. With a memory-bound curve (extra rows nearly
    free) that drafts; once cost grows in proportion to rows, a row worth less than one token
    never pays, so drafts shrink as the batch grows. One request drafting alone is the case
    base_rows = 1 (LengthPolicy.choose).
    """
    heap = [(-g, i, j) for i, row in enumerate(gains) for j, g in enumerate(row)]
    heapq.heapify(heap)
    value = float(base_rows)
    best_m, best_rate = 0, value / cost(base_rows) * (1 + margin)
    counts = [0] * len(gains)
    taken: list[int] = []
    while heap and base_rows + len(taken) < max_rows:
        worth, i, _ = heapq.heappop(heap)
        value -= worth
        taken.append(i)
        counts[i] += 1
        spent = cost(base_rows + len(taken)) + (extra_cost(counts) if extra_cost is not None else 0.0)
        rate = value / spent
        if rate > best_rate:
            best_m, best_rate = len(taken), rate
    out = [0] * len(gains)
    for i in taken[:best_m]:
        out[i] += 1
    return out
