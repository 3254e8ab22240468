"""Successive halving over setups, within a time budget.

The whole space (rungs × cache types × flash attention × threads × speculation) is far too big for
even a short run of each on a small machine: on the 1.5B on 2 cores a load key costs seconds to
load and seconds to read the workload's prompts. So the search runs in stages, each on fewer
setups for longer:

1. screen (level 0, the short requests and 16 tokens of each answer): a baseline setup (the
   untuned defaults), and every value of each knob with the others at the baseline's — one model
   load per rung, per cache pair, per thread count, flash attention off, and every speculation on
   the baseline's load. When the whole space is not twice as big (the default model with few
   methods), every setup is screened instead.
2. combine (level 0): every combination of each knob's best values (the two fastest rungs, cache
   pairs and speculations, the faster flash attention and thread count) — the knobs interact, so
   the winners are tried together. Below the last level "fastest" is the whole workload's speed
   that the level's prompt times and decode speed predict (Measurer.projected).
3. halve (level 1: every request, 48 tokens): the fastest third of everything measured, and the
   setups on the speed/KLD frontier, re-measured.
4. final (level 2: the whole workload): the two fastest of those and the defaults, measured twice
   in alternating order (A B, then B A; prompts timed again), and again in more alternating rounds
   (up to _FINAL_ROUNDS) while a whole round still fits in the budget; medians: the choice and its
   predicted speed. One run of the default model's workload spread ±12 % on a busy machine, and a
   tune that used 175 s of its 10 minutes predicted 12.7 % below the benchmark's median of three:
   what the budget leaves buys a median of more runs.

A setup's KLD is checked before it is promoted (quality.py measures what is not known yet, for
the setups being promoted only), and a setup over `max_kld` never is: within the bound means its
KLD plus two standard errors (Arm.kld_bound) is at most `max_kld`. A load group starts only
when its estimated time ends before its stage's share of the budget does (screening up to 40 %,
combining 55 %, halving 75 %, the final stage the rest); the estimates come from what loads,
prompts and tokens took so far (Measurer.estimate), so a stage that runs out of time hands what it
measured to the next one, and a request still running when the budget ends is cancelled.
With `exhaustive`, every setup is measured at level 2 once, whatever the budget (the benchmark
the search is checked against).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .measure import LEVELS, Level, Measurement, Measurer
from .space import Setup

__all__ = ["Arm", "Search", "SearchEvent", "KLD_MARGIN"]

log = logging.getLogger(__name__)

_ETA = 3  # successive halving keeps a third
_TOP = 2  # best values of each knob combined in stage 2
_FINALISTS = 2  # setups measured on the whole workload, twice each
KLD_MARGIN = 2.0  # standard errors added to a KLD before it is held against the bound (Arm.kld_bound)
_FINAL_ROUNDS = 5  # at most, while the budget lasts (see the module)
# How far into the budget each stage may start a load group (what a stage leaves goes to the next).
_STAGE_END = {"screen": 0.4, "combine": 0.55, "halve": 0.75, "final": 1.0}


@dataclass
class Arm:
    """A setup and what is known about it."""

    setup: Setup
    memory: int  # bytes, edgeinfer.fit's estimate (its draft model's too)
    kld: float | None = None
    kld_err: float = 0.0  # the KLD's standard error: tune's chunks are a sample of the evaluation text
    results: dict[int, list[Measurement]] = field(default_factory=dict)
    failed: str | None = None

    def kld_bound(self) -> float | None:
        """The KLD held against the quality bound: the measured value plus KLD_MARGIN standard errors.
        Tune measures the text's first chunks; on the default model a Q4_K_M at 0.0492 ± 0.0013 there
        (bound 0.05) read 0.0522 ± 0.0026 on the whole text, so a choice on the measured value alone
        was over the bound."""
        return None if self.kld is None else self.kld + KLD_MARGIN * self.kld_err

    def within(self, max_kld: float, unknown_ok: bool = False) -> bool:
        """Whether the KLD bound is at most `max_kld`; an unknown KLD counts as within if `unknown_ok`."""
        bound = self.kld_bound()
        return (bound is None and unknown_ok) or (bound is not None and bound <= max_kld)

    @property
    def top_level(self) -> int | None:
        return max(self.results) if self.results else None

    def tok_s(self, level: int | None = None) -> float | None:
        level = self.top_level if level is None else level
        runs = self.results.get(level) if level is not None else None
        return statistics.median(m.tok_s for m in runs) if runs else None

    def summary(self, level: int | None = None) -> Measurement | None:
        """The runs at `level` (default: the highest) in one: the median of each figure."""
        level = self.top_level if level is None else level
        runs = self.results.get(level, []) if level is not None else []
        if not runs:
            return None
        if len(runs) == 1:
            return runs[0]

        def med(name: str) -> float:
            return statistics.median(getattr(m, name) for m in runs)

        accepted = [m.acceptance for m in runs if m.acceptance is not None]
        return Measurement(level=level, tok_s=med("tok_s"), decode_tok_s=med("decode_tok_s"), ttft_s=med("ttft_s"),
                           seconds=med("seconds"), generated=int(med("generated")),
                           acceptance=statistics.median(accepted) if accepted else None, at=runs[-1].at,
                           loadavg=med("loadavg"))


@dataclass(frozen=True)
class SearchEvent:
    stage: str
    message: str
    done: int
    total: int
    best: str | None  # the best setup so far, in words, with its speed


class Search:
    """See the module. `journal(setup, measurement)` keeps each measurement as soon as it exists."""

    def __init__(self, arms: Sequence[Arm], measurer: Measurer, *, budget_s: float, max_kld: float,
                 check_quality: Callable[[list[Arm]], None], journal: Callable[[Arm, Measurement], None],
                 progress: Callable[[SearchEvent], None] = lambda _e: None, baseline: Setup | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.arms = list(arms)
        self.by_key = {a.setup.key: a for a in self.arms}
        self.measurer = measurer
        self.budget_s = budget_s
        self.max_kld = max_kld
        self.check_quality = check_quality
        self.journal = journal
        self.progress = progress
        self.baseline = baseline
        self.clock = clock
        self.started = clock()
        self.stage = ""
        self.stopped = False  # the budget ended a stage early
        self.taken = 0  # measurements taken (the first group always runs, whatever the estimates)

    def elapsed(self) -> float:
        return self.clock() - self.started

    def best(self) -> Arm | None:
        """The fastest arm within the quality bound at the highest level measured (unknown KLD: not yet)."""
        ok = [a for a in self.arms if a.results and self._within(a)]
        if not ok:
            return None
        top = max(a.top_level for a in ok if a.top_level is not None)
        return max((a for a in ok if a.top_level == top), key=lambda a: a.tok_s() or 0.0)

    def _say(self, message: str, done: int, total: int) -> None:
        b = self.best()
        best = f"{b.setup.label()} {b.tok_s():.1f} tok/s" if b is not None else None
        self.progress(SearchEvent(self.stage, message, done, total, best))

    def _groups(self, arms: Sequence[Arm]) -> list[list[Arm]]:
        """`arms` by load key, in measuring order: the baseline first (every speed-up is against it),
        then the smaller setups: quicker to measure, and on a memory-bound machine the likelier to
        win, should the budget end the stage."""
        groups: dict[tuple, list[Arm]] = {}
        for a in arms:
            if a.failed is None:
                groups.setdefault(a.setup.load_key, []).append(a)
        return sorted(groups.values(), key=lambda g: (not any(a.setup == self.baseline for a in g),
                                                      min(a.memory for a in g)))

    def measure(self, arms: Sequence[Arm], level: Level, reps: int = 1, remeasure: bool = False,
                first_rep: int = 0) -> int:
        """Measure `arms` at `level` (load groups in order; `reps` rounds alternating the order,
        counted from `first_rep`) while the budget lasts: a group starts only when its estimated time
        ends before this stage's share of the budget does (_STAGE_END; the very first group always
        starts). Returns how many measurements were taken."""
        order = self._groups(arms)
        total = len(order) * reps
        taken = 0
        for rep in range(reps):
            for i, group in enumerate(order if (first_rep + rep) % 2 == 0 else order[::-1]):
                need = self.measurer.estimate([a.setup for a in group], level)
                end = self.budget_s * _STAGE_END.get(self.stage, 1.0)
                if self.elapsed() >= self.budget_s or (self.taken and self.elapsed() + need > end):
                    self.stopped = True
                    self._say(f"{self.stage}: no time left for {group[0].setup.label()}", rep * len(order) + i, total)
                    return taken
                self._say(f"{self.stage}: {', '.join(a.setup.label() for a in group)} (level {level.index})",
                          rep * len(order) + i, total)
                n = self._measure_group(group, level, remeasure)
                taken += n
                self.taken += n
        self._say(f"{self.stage}: done", total, total)
        return taken

    def _measure_group(self, group: list[Arm], level: Level, remeasure: bool) -> int:
        n = 0

        def on_result(setup: Setup, m: Measurement | None, why: str) -> None:
            nonlocal n
            arm = self.by_key[setup.key]
            if m is None:
                if why.startswith("stopped"):
                    return
                arm.failed = why
                log.info("%s: %s", setup.label(), why)
                return
            arm.results.setdefault(level.index, []).append(m)
            self.journal(arm, m)
            n += 1

        deadline = self.started + self.budget_s  # a request still running then is cancelled (Measurer._run)
        self.measurer.stop = lambda: self.clock() > deadline
        self.measurer.measure([a.setup for a in group], level, on_result, remeasure)
        return n

    # -- the stages ------------------------------------------------------------------------------
    def run(self, exhaustive: bool = False) -> None:
        if exhaustive:
            self.stage = "exhaustive"
            self.check_quality(self.arms)
            self.measure([a for a in self.arms if self._within(a) and LEVELS[-1].index not in a.results], LEVELS[-1])
            return
        self.stage = "screen"
        self.measure(self._todo(self._screening(), 0), LEVELS[0])
        self.stage = "combine"
        self.measure(self._todo(self._combinations(), 0), LEVELS[0])
        self.stage = "halve"
        self.measure(self._todo(self._promote(0, _ETA), 1), LEVELS[1])
        self.stage = "final"
        measured = max((a.top_level for a in self.arms if a.results and a.top_level is not None), default=0)
        finalists = self._promote(min(measured, 1), _ETA, at_least=2)[:_FINALISTS]  # from level 0 if 1 had no time
        # The untuned defaults run in the same alternating rounds: the choice is then the fastest of
        # them all on equal terms (measured apart, once, a slower finalist was kept over faster defaults).
        base = next((a for a in self.arms if a.setup == self.baseline), None)
        if base is not None and base not in finalists and base.failed is None:
            self.check_quality([base])
            if self._within(base):
                finalists.append(base)
        self.measure([a for a in finalists if len(a.results.get(2, [])) < 2], LEVELS[2], reps=2, remeasure=True)
        finalists = [a for a in finalists if a.failed is None and len(a.results.get(2, [])) >= 2]
        for rep in range(2, _FINAL_ROUNDS):  # more alternating rounds of them all, while a whole round fits
            if len(finalists) < 1 or self.stopped or not self._round_fits(finalists, LEVELS[2]):
                break
            self.measure(finalists, LEVELS[2], remeasure=True, first_rep=rep)

    def _round_fits(self, arms: Sequence[Arm], level: Level) -> bool:
        need = sum(self.measurer.estimate([a.setup for a in g], level) for g in self._groups(arms))
        return self.elapsed() + need <= self.budget_s

    def _todo(self, arms: Sequence[Arm], level: int) -> list[Arm]:
        return [a for a in arms if level not in a.results and a.failed is None and self._within(a, unknown_ok=True)]

    def _within(self, a: Arm, unknown_ok: bool = False) -> bool:
        return a.within(self.max_kld, unknown_ok)

    def _screening(self) -> list[Arm]:
        """The baseline and every arm that differs from it in one knob (a quantized V cache, which
        brings flash attention on with it, counts as one); every arm when that is not fewer."""
        base = self.baseline
        if base is None or base.key not in self.by_key:
            return self.arms
        out = [a for a in self.arms if len(_changed(a.setup, base)) <= 1]
        return self.arms if len(out) * 2 >= len(self.arms) else out

    def _combinations(self) -> list[Arm]:
        """Every arm whose knobs are all among each knob's best values at level 0."""
        measured = [a for a in self.arms if 0 in a.results and self._within(a, unknown_ok=True)]
        if not measured:
            return []

        base = self.baseline

        def best_values(knob: int, k: int) -> set[object]:
            # A knob's values are compared like for like: on the arms that differ from the baseline
            # in this knob alone (the screen's). Flash attention off, screened on the default
            # model's Q4_1 (slow prompts), lost to flash attention on with Q8_0's fast prompts,
            # though on Q4_1 itself it was the faster (the exhaustive search's best had it off).
            pool = [a for a in measured if base is not None and _changed(a.setup, base) <= {knob}]
            speed: dict[object, float] = {}
            for a in pool if len({_knobs(a.setup)[knob] for a in pool}) > 1 else measured:
                v = _knobs(a.setup)[knob]
                speed[v] = max(speed.get(v, 0.0), self._speed(a, 0))
            return set(sorted(speed, key=lambda v: -speed[v])[:k])

        keep = {"model": best_values(0, _TOP), "kv": best_values(1, _TOP), "fa": best_values(2, 1),
                "threads": best_values(3, 1), "spec": best_values(4, _TOP)}
        return [a for a in self.arms
                if a.setup.model in keep["model"] and (a.setup.kv_type_k, a.setup.kv_type_v) in keep["kv"]
                and (a.setup.flash_attn in keep["fa"] or a.setup.kv_type_v != "f16")
                and a.setup.threads in keep["threads"] and (a.setup.speculate, a.setup.draft_max) in keep["spec"]]

    def _promote(self, level: int, eta: int, at_least: int = 1) -> list[Arm]:
        """The fastest 1/eta of the arms measured at `level` (at least `at_least`) and the arms on the
        speed/KLD frontier, after their KLD is checked (an arm over the bound gives way to the next)."""
        from .pareto import pareto

        pool = sorted((a for a in self.arms if level in a.results and a.failed is None),
                      key=lambda a: -self._speed(a, level))
        want = max(at_least, -(-len(pool) // eta))
        chosen: list[Arm] = []
        while pool and len(chosen) < want:
            batch = pool[: want - len(chosen)]
            pool = pool[len(batch):]
            self.check_quality(batch)
            chosen += [a for a in batch if self._within(a)]
        frontier = pareto([a for a in chosen + pool if a.kld is not None and self._within(a)],
                          lambda a: (self._speed(a, level), -(a.kld or 0.0)))
        return chosen + [a for a in frontier if a not in chosen][:want]

    def _speed(self, a: Arm, level: int) -> float:
        """What the arm's runs at `level` say of its speed on the whole workload (Measurer.projected):
        a lower level is ranked by its prediction, not by its own mix of prompt and answer."""
        m = a.summary(level)
        return self.measurer.projected(a.setup, m) if m is not None else 0.0


def _knobs(s: Setup) -> tuple[object, ...]:
    return (s.model, (s.kv_type_k, s.kv_type_v), s.flash_attn, s.threads, (s.speculate, s.draft_max))


def _changed(s: Setup, base: Setup) -> set[int]:
    """The knobs (indices of _knobs) in which s differs from base. A quantized V cache brings flash
    attention on with it: the two count as the cache knob alone."""
    differs = {i for i, (x, y) in enumerate(zip(_knobs(s), _knobs(base))) if x != y}
    return {1} if s.kv_type_v != "f16" and differs == {1, 2} else differs
