"""Speculative decoding: drafters and the adaptive draft-length policy.

A drafter proposes tokens; the decode loop (generation.py) verifies them in one `llama_decode` and
keeps those the target itself samples, so output never changes — only speed. Speculation pays only
when accepted tokens outnumber the extra cost of verifying a batch, which on a CPU is large and
model-dependent (a Q8_0 target verifying 8 tokens costs ~3 single steps). So every step chooses its
draft length k by maximizing expected tokens per unit of time:

    E(k) / (cost(k + 1) + k · d)      against 1 for a plain step,

where cost(b) is the measured time of a b-token decode relative to a 1-token decode on this machine
(calibrated once per engine, then tracked online), d the drafter's cost per drafted token, and
E(k) = 1 + a0 + a0·a1 + … the expected tokens gained from per-position acceptance estimates.
k = 0 means a plain step: speculation switches itself off where it does not pay.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import IncompatibleDraftError, SpeculationError
from .llama import LlamaRuntime
from .options import LoadOptions, SpeculationOptions

if TYPE_CHECKING:
    from . import Engine
    from .events import SpeculationStats

__all__ = [
    "CostModel",
    "AcceptanceModel",
    "LengthPolicy",
    "NgramIndex",
    "LookupDrafter",
    "ModelDrafter",
    "AutoDrafter",
    "make_drafter",
    "check_draft_compatible",
]

# Both sides of the tile sizes where the curve jumps; other sizes are interpolated, then learned.
_CALIBRATION_SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33)
# llama.cpp's own compatibility rule for a draft vocabulary (common/speculative.cpp).
_VOCAB_MAX_SIZE_DIFFERENCE = 128
_VOCAB_CHECK_START_TOKEN_ID = 5
# Explorations draft at most this many tokens (the length that costs least for what it may buy:
# on Q8_0 a 4-token batch is cheaper than a 3-token one).
_EXPLORE_MAX = 4


# -- measured costs ---------------------------------------------------------------------------------


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

    @classmethod
    def calibrate(cls, rt: LlamaRuntime, sample_tokens: Sequence[int], reps: int = 2) -> CostModel:
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
            for b in _CALIBRATION_SIZES:
                if b > rt.n_batch or base + b >= rt.n_ctx:
                    break
                best[b] = min(best.get(b, float("inf")), timed(b))
            best[1] = min(best[1], timed(1))
        return cls(best)

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


# -- acceptance -----------------------------------------------------------------------------------


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


# -- prompt lookup --------------------------------------------------------------------------------


class NgramIndex:
    """For n in [n_min, n_max], where each n-gram occurred (the positions right after it), updated
    incrementally per token so a lookup costs O(candidates · context), not a scan of the text.

    A lookup takes the longest n-gram ending the text that occurred before and, among its last
    `candidates` occurrences, the one whose preceding tokens agree with the text's for longest
    (up to `context` tokens; ties go to the most recent): in a file being copied with edits, that
    is the place being copied, not the latest line that merely starts the same way.
    """

    def __init__(self, n_min: int = 2, n_max: int = 4, candidates: int = 16, context: int = 64):
        self.n_min, self.n_max = n_min, n_max
        self.candidates, self.context = candidates, context
        self.tokens: list[int] = []
        self._maps: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(n_min, n_max + 1)}

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            L = len(self.tokens)
            # The n-grams ending just before t now have a continuation (t at position L).
            for n in range(self.n_min, self.n_max + 1):
                if L >= n:
                    self._maps[n].setdefault(tuple(self.tokens[L - n : L]), []).append(L)
            self.tokens.append(t)

    def sync(self, history: Sequence[int]) -> None:
        """Bring the index up to `history` (which only ever grows during a generation)."""
        n = len(self.tokens)
        if len(history) < n or history[:n] != self.tokens:
            self.tokens = []
            self._maps = {k: {} for k in self._maps}
        self.extend(history[len(self.tokens) :])

    def _agreement(self, pos: int, n: int) -> int:
        """How many tokens before `pos` equal those before the end of the text (>= n)."""
        toks, end = self.tokens, len(self.tokens)
        m = n
        while m < self.context and pos - 1 - m >= 0 and toks[pos - 1 - m] == toks[end - 1 - m]:
            m += 1
        return m

    def lookup(self, max_len: int) -> tuple[list[int], int]:
        """Continuation of the longest n-gram at the end that occurred before; (draft, n)."""
        L = len(self.tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if L < n:
                continue
            places = self._maps[n].get(tuple(self.tokens[L - n :]))
            if not places:
                continue
            best, best_m = places[-1], -1
            for pos in reversed(places[-self.candidates :]):
                m = self._agreement(pos, n)
                if m > best_m:
                    best, best_m = pos, m
            return self.tokens[best : min(best + max_len, L)], n
        return [], 0


class LookupDrafter:
    """Prompt lookup: drafts are copied from earlier in the prompt + output."""

    method = "lookup"

    def __init__(self, policy: LengthPolicy):
        self.policy = policy
        self.index = NgramIndex()

    def start(self, prompt: Sequence[int]) -> None:
        self.index.sync(prompt)

    def candidate(self, history: Sequence[int], max_len: int) -> tuple[list[int], float]:
        """The draft this step would use and its expected rate."""
        self.index.sync(history)
        draft, n = self.index.lookup(self.policy.opts.draft_max)
        if not draft:
            return [], 1.0
        # A 2-gram match is weaker evidence than a 4-gram one.
        quality = 1.0 if n >= 3 or self.policy.in_run else 0.8
        k, rate = self.policy.choose(min(max_len, len(draft)), 0.0, quality)
        return draft[:k], rate

    def propose(self, history: Sequence[int], max_len: int) -> list[int]:
        return self.candidate(history, max_len)[0]

    def observe(self, history: Sequence[int], n_drafted: int, n_accepted: int, verify_s: float, draft_s: float) -> None:
        self.policy.observe(n_drafted, n_accepted, verify_s, draft_s)

    def close(self) -> None:
        pass


# -- draft model ----------------------------------------------------------------------------------


def check_draft_compatible(target: LlamaRuntime, draft: LlamaRuntime, draft_name: str) -> None:
    """The draft must tokenize exactly like the target (llama.cpp's rule, same thresholds)."""

    def fail(what: str) -> IncompatibleDraftError:
        return IncompatibleDraftError(f"draft model {draft_name} is incompatible with the target: {what}")

    if target.vocab_type != draft.vocab_type:
        raise fail(f"vocabulary type {draft.vocab_type} vs {target.vocab_type}")
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        raise fail(f"BOS token differs ({draft.bos} vs {target.bos})")
    if target.eos != draft.eos:
        raise fail(f"EOS token differs ({draft.eos} vs {target.eos})")
    nt, nd = target.facts.n_vocab, draft.facts.n_vocab
    if abs(nt - nd) > _VOCAB_MAX_SIZE_DIFFERENCE:
        raise fail(f"vocabulary sizes {nd} vs {nt} differ by more than {_VOCAB_MAX_SIZE_DIFFERENCE}")
    for i in range(_VOCAB_CHECK_START_TOKEN_ID, min(nt, nd)):
        if target.token_text(i) != draft.token_text(i):
            raise fail(f"token {i} is {draft.token_text(i)!r} in the draft but {target.token_text(i)!r} in the target")


# Draft runtime -> its one-token decode time over the target's, measured once.
_relative_step_cache: weakref.WeakKeyDictionary[LlamaRuntime, float] = weakref.WeakKeyDictionary()


def relative_draft_cost(target: LlamaRuntime, draft: LlamaRuntime, prompt: Sequence[int], reps: int = 3) -> float:
    """One draft-model decode in target decodes, measured once per draft runtime, each model's
    fastest of `reps` one-token decodes, alternating so both see the same machine. The draft
    measures after a short prefix (its cache is cleared: it catches up when it first drafts);
    the target after the prompt (called once its first token is sampled, so the logits it
    overwrites are no longer needed)."""
    if draft in _relative_step_cache:
        return _relative_step_cache[draft]
    prefix = list(prompt[:8]) or [draft.bos if draft.bos >= 0 else 0]
    draft.clear()
    draft.decode(prefix)
    base = len(target.cached)
    last = target.cached[-1] if target.cached else prefix[-1]
    best_t = best_d = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        target.decode([last])
        best_t = min(best_t, time.perf_counter() - t0)
        target.truncate(base)
        t0 = time.perf_counter()
        draft.decode([prefix[-1]])
        best_d = min(best_d, time.perf_counter() - t0)
        draft.truncate(len(prefix))
    _relative_step_cache[draft] = best_d / best_t
    return best_d / best_t


class ModelDrafter:
    """A second, cheaper model drafts greedily in its own context, kept in step with the target's;
    it stops early when its own top token's probability falls below p_min."""

    method = "draft"

    def __init__(self, runtime: LlamaRuntime, policy: LengthPolicy, p_min: float, method: str = "draft",
                 target: LlamaRuntime | None = None):
        self.rt = runtime
        self.target = target
        self.policy = policy
        self.p_min = p_min
        self.method = method
        self.step_s = 0.0  # measured seconds per draft token (EWMA)
        self.enabled = True
        self.note = ""

    def start(self, prompt: Sequence[int]) -> None:
        # A draft that cannot pay even at high acceptance is switched off before it costs
        # anything: no prefill of the prompt, no explorations (a quantized copy of a small
        # model is often nearly as slow as the model itself: its time goes to overheads).
        if self.target is not None:
            self.step_s = relative_draft_cost(self.target, self.rt, prompt) * self.policy.costs.time(1)
        if self._too_slow():
            return
        self._sync(prompt)

    def _too_slow(self) -> bool:
        d = self.draft_cost(self.policy.costs.time(1))
        if self.enabled and not self.policy.can_pay(d):
            self.enabled = False
            self.note = (f"{self.method} off: a drafted token costs {d:.2f} target steps, too slow to pay "
                         "even at 90 % acceptance")
        return not self.enabled

    def _sync(self, history: Sequence[int]) -> None:
        """Make the draft's cache hold history[:-1] (its last token is decoded when drafting)."""
        rt = self.rt
        keep = 0
        limit = min(len(rt.cached), len(history) - 1)
        while keep < limit and rt.cached[keep] == history[keep]:
            keep += 1
        rt.truncate(keep)
        missing = list(history[keep:-1])
        for s in range(0, len(missing), rt.n_batch):
            rt.decode(missing[s : s + rt.n_batch])

    def draft_cost(self, target_step_s: float) -> float:
        return self.step_s / target_step_s if target_step_s > 0 and self.step_s > 0 else 0.3

    def candidate(self, history: Sequence[int], max_len: int) -> tuple[int, float]:
        if not self.enabled:
            return 0, 1.0
        d = self.draft_cost(self.policy.costs.time(1))
        return self.policy.choose(max_len, d)

    def draft(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        rt = self.rt
        self._sync(history)
        out: list[int] = []
        last = history[-1]
        t0 = time.perf_counter()
        for _ in range(k):
            if len(rt.cached) + 1 >= rt.n_ctx:
                break
            rt.decode([last])
            row = rt.logits_row(-1)
            tok = int(np.argmax(row))
            if self.p_min > 0:
                z = row - row[tok]
                p_top = 1.0 / float(np.exp(z, dtype=np.float32).sum())
                if p_top < self.p_min and out:
                    break
            out.append(tok)
            last = tok
        if out:
            per = (time.perf_counter() - t0) / len(out)
            self.step_s = per if self.step_s == 0 else 0.8 * self.step_s + 0.2 * per
            # What drafting really costs at this context length replaces the first estimate
            # (measured after a short prefix) for the next requests.
            _relative_step_cache[self.rt] = self.draft_cost(self.policy.costs.time(1))
            self._too_slow()
        return out

    def propose(self, history: Sequence[int], max_len: int) -> list[int]:
        k, _ = self.candidate(history, max_len)
        return self.draft(history, k)

    def observe(self, history: Sequence[int], n_drafted: int, n_accepted: int, verify_s: float, draft_s: float) -> None:
        self.policy.observe(n_drafted, n_accepted, verify_s, draft_s)

    def close(self) -> None:
        pass  # the runtime belongs to the engine's draft cache


class AutoDrafter:
    """Per step, the best of prompt lookup, the draft model (when one is configured) and a plain
    step, by expected tokens per unit of time."""

    method = "auto"

    def __init__(self, lookup: LookupDrafter, model: ModelDrafter | None):
        self.lookup = lookup
        self.model = model
        self._last: LookupDrafter | ModelDrafter | None = None

    def start(self, prompt: Sequence[int]) -> None:
        self.lookup.start(prompt)
        if self.model is not None:
            self.model.start(prompt)

    def propose(self, history: Sequence[int], max_len: int) -> list[int]:
        draft, rate = self.lookup.candidate(history, max_len)
        self._last = self.lookup if draft else None
        if self.model is not None:
            k, model_rate = self.model.candidate(history, max_len)
            if k and model_rate > rate:
                self._last = self.model
                return self.model.draft(history, k)
        return draft

    def observe(self, history: Sequence[int], n_drafted: int, n_accepted: int, verify_s: float, draft_s: float) -> None:
        if self._last is not None:
            self._last.observe(history, n_drafted, n_accepted, verify_s, draft_s)
        else:
            self.lookup.policy.observe(0, 0, verify_s, draft_s)

    def close(self) -> None:
        pass


# -- construction ---------------------------------------------------------------------------------


def make_drafter(engine: Engine, spec: SpeculationOptions, stats: SpeculationStats | None = None):
    """The drafter for a request, or None (with a warning) where speculation cannot work."""
    rt = engine._runtime
    if rt.facts.recurrent:
        warnings.warn(
            f"speculation off: {engine.name} is a recurrent/hybrid model whose memory cannot drop a rejected suffix",
            stacklevel=3,
        )
        return None
    return _Deferred(engine, spec, stats)


class _Deferred:
    """Builds the real drafter at `start()`, after the prompt is in the cache, so the cost
    calibration measures decodes at the real context length (once per engine)."""

    def __init__(self, engine: Engine, spec: SpeculationOptions, stats: SpeculationStats | None = None):
        self.engine = engine
        self.spec = spec
        self.stats = stats
        self.method = {"self": f"self={spec.self_quant}", "draft": "draft"}.get(spec.method, spec.method)
        self.inner = None
        self._model: ModelDrafter | None = None

    def start(self, prompt: Sequence[int]) -> None:
        engine, spec = self.engine, self.spec
        costs = engine._speculation_costs(prompt)
        # Each request starts from the same prior; the policy learns within the request.
        policy = LengthPolicy(costs, spec)
        if spec.method == "lookup":
            self.inner = LookupDrafter(policy)
        elif spec.method in ("draft", "self"):
            model_policy = LengthPolicy(costs, spec, max_failed_explorations=2)
            self.inner = ModelDrafter(engine._draft_runtime(spec), model_policy, spec.p_min, self.method,
                                      target=engine._runtime)
        else:  # auto
            model = (ModelDrafter(engine._draft_runtime(spec), LengthPolicy(costs, spec, max_failed_explorations=2),
                                  spec.p_min, target=engine._runtime) if spec.draft_model else None)
            self.inner = AutoDrafter(LookupDrafter(policy), model)
        self.inner.start(prompt)
        model_drafter = getattr(self.inner, "model", self.inner)
        self._model = model_drafter if isinstance(model_drafter, ModelDrafter) else None
        self._report()

    def _report(self) -> None:
        """Say in the stats when the draft model switched itself off (at start or later)."""
        if self._model is not None and self._model.note and self.stats is not None:
            self.stats.note = self._model.note

    def propose(self, history: Sequence[int], max_len: int) -> list[int]:
        return self.inner.propose(history, max_len)

    def observe(self, history: Sequence[int], n_drafted: int, n_accepted: int, verify_s: float, draft_s: float) -> None:
        self.inner.observe(history, n_drafted, n_accepted, verify_s, draft_s)
        self._report()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def resolve_self_draft(engine: Engine, quant: str) -> Path:
    """A quantized copy of the target: from the store, or made by the quantizer on first use."""
    store = engine.store
    qtag = quant.lower()
    if engine.manifest is not None:
        name = engine.manifest.name
        for m in store.list():
            if m.name == name and m.tag == qtag and Path(m.file).exists():
                return Path(m.file)
        for m in store.list():
            if m.derived_from in (engine.manifest.ref, str(engine.path)) and (m.quant or "").upper() == quant.upper():
                return Path(m.file)
    try:
        from .. import quantize as quantizer
    except ImportError:
        raise SpeculationError(
            f"no {quant} copy of {engine.name} in the store and this build has no quantizer; "
            f"make one with `edgeinfer quantize {engine.name} --type {quant}`"
        ) from None
    source = engine.manifest.ref if engine.manifest is not None else str(engine.path)
    already_quantized = (engine.info.file_type or "F16").upper() not in ("F32", "F16", "BF16", "ALL_F32")
    result = quantizer.quantize_model(source, quant, store=store, allow_requantize=already_quantized)
    return Path(result.manifest.file)


def open_draft_runtime(engine: Engine, spec: SpeculationOptions) -> LlamaRuntime:
    from ..gguf_file import read_gguf

    if spec.method == "self" or (spec.method == "auto" and not spec.draft_model):
        path, label = resolve_self_draft(engine, spec.self_quant), f"self={spec.self_quant}"
    else:
        path, _ = engine.store.resolve(spec.draft_model)
        label = str(spec.draft_model)
    read_gguf(path)  # validated like any model before llama.cpp sees it
    opts = LoadOptions(n_ctx=engine.n_ctx, n_threads=engine.options.n_threads, n_batch=engine.options.n_batch)
    rt = LlamaRuntime(path, opts)
    try:
        check_draft_compatible(engine._runtime, rt, label)
    except BaseException:
        rt.close()
        raise
    return rt
