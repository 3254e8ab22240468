"""One request's speculation: what it may draft each step, and what it learns from each step.

The scheduler core asks every decoding request for a `Proposal` (prompt lookup's continuation, or
a draft model's next tokens, not yet drafted; under a llguidance grammar the tokens it forces come
first), sizes all proposals of a step together with
`plan_drafts` from the batch's cost curve, has the draft model draft what was planned, verifies
everything in one target decode and reports back with `observe`.

Forced tokens (issue 46). Where the request's grammar allows exactly one token next (and the one
after, …: llguidance's forced continuation, `Sampler.forced`), those tokens are drafts that cannot
be rejected: verification samples every row from the constrained distribution, whose only token
is the forced one, so the output and the RNG's draws are those of plain decoding, token for token.
They lead the proposal with a gain of 1 each (acceptance 1: `plan_drafts` prices them as such),
followed by lookup's continuation when lookup's match begins with them; the lookup policy learns
only from the rows after them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..core.events import SpeculationStats
from ..core.options import HEAD_METHODS, SpeculationOptions
from ..core.sampler import Sampler
from ..core.sequence import KVSequence
from .draft_model import DraftContext, DraftJob, ModelDrafter
from .heads import HeadContext, HeadDrafter
from .lookup import LookupMatch, NgramIndex
from .policy import CostModel, LengthPolicy
from .suffix import SuffixSource, TokenCorpus

__all__ = ["Proposal", "RequestSpeculation", "speculation_method"]

# A 2-gram match is weaker evidence than a longer one.
_WEAK_MATCH_QUALITY = 0.8
# A suffix match this long (tokens) is a full one: the policy's estimates inside a copy price it.
_FULL_SUFFIX_MATCH = 8
# Shorter suffix matches are judged by how often a draft's first token was right after a match of
# about that length (1, 2, 3–4, 5–7 tokens): after one agreeing token the tree guesses, after six it
# mostly copies, and the tree's own frequencies (one earlier occurrence: 1.0) cannot tell them apart.
_MATCH_BUCKETS = (1, 2, 4, 7)
_MATCH_PRIOR_WEIGHT = 2.0


def speculation_method(spec: SpeculationOptions) -> str:
    """The name stats report for a method ("self=Q3_K_M" for a self-draft)."""
    return {"self": f"self={spec.self_quant}"}.get(spec.method, spec.method)


@dataclass
class Proposal:
    """What one request could draft this step."""

    kind: Literal["lookup", "suffix", "model", "head"]
    policy: LengthPolicy
    limit: int  # most rows it may draft
    gains: list[float]  # expected tokens each row would add
    tokens: list[int] = field(default_factory=list)  # lookup, suffix: the continuation found; model: after drafting
    draft_cost: float = 0.0  # a drafted token's cost in target steps (a draft model's or a head's decodes)
    forced: int = 0  # leading tokens the grammar forces (always accepted)
    fixed: bool = False  # a fixed length the user asked for (adaptive off): not planned
    k: int = 0  # what the step's plan gave it
    job: DraftJob | None = None  # a draft model's work, once planned
    context: DraftContext | HeadContext | None = None  # the draft model's or head's context
    remembered: bool = False  # suffix: drafted (also) from earlier answers
    match: int = 0  # suffix: the match length it came from


class RequestSpeculation:
    """A request's drafters (lookup and/or a draft model or head), their policies and statistics."""

    def __init__(self, spec: SpeculationOptions, costs: CostModel, stats: SpeculationStats,
                 draft: DraftContext | HeadContext | None, sampler: Sampler | None,
                 memory: TokenCorpus | None = None):
        self.spec = spec
        self.stats = stats
        self.method = speculation_method(spec)
        self.lookup: NgramIndex | None = NgramIndex() if spec.method in ("lookup", "auto") else None
        self.lookup_policy = LengthPolicy(costs, spec, copies=True) if self.lookup is not None else None
        # suffix: earlier answers (`memory`, the scope's) and the request's own text; auto: earlier
        # answers beside lookup (which reads the request's own text).
        self.suffix: SuffixSource | None = None
        if spec.method == "suffix" or (spec.method == "auto" and memory is not None):
            self.suffix = SuffixSource(memory, own=spec.method == "suffix")
        self.suffix_policy: LengthPolicy | None = None
        if self.suffix is not None:
            # A long match (the last _FULL_SUFFIX_MATCH tokens or more agree with an earlier text) is
            # evidence like a run (LengthPolicy.model): the tree's frequencies scale it along the draft.
            self.suffix_policy = LengthPolicy(costs, spec, copies=True)
        self.match_quality = MatchQuality()
        self.model: ModelDrafter | None = None
        if isinstance(draft, HeadContext) and spec.method in (*HEAD_METHODS, "auto"):
            # A head drafts from the target's own states (its catching up is one batched decode):
            # the same policy as a draft model, the same limit on unprofitable explorations.
            self.model = HeadDrafter(draft, LengthPolicy(costs, spec, max_failed_explorations=2), spec.p_min)
        elif draft is not None and spec.method in ("draft", "self", "auto"):
            self.model = ModelDrafter(draft, LengthPolicy(costs, spec, max_failed_explorations=2), spec.p_min,
                                      draft.method if spec.method == "auto" else self.method)
        self._idle_note = ""  # the note saying the draft model is on but has drafted nothing yet
        # A draft model follows the request's constraints (its sampler's forks); at T > 0 it samples
        # its drafts from q (the rejection rule verifies).
        self.sampler = sampler if self.model is not None else None
        self.sampled = self.sampler is not None and self.sampler.exact
        """Whether this request's tokens are all drawn in numpy (a sampling draft model)."""
        # The grammar whose forced continuation leads lookup's drafts (see the module).
        self.constraint = sampler if self.lookup is not None and sampler is not None and \
            sampler.grammar is not None and sampler.grammar.on_llguidance else None

    def policies(self) -> list[LengthPolicy]:
        out = [p for p in (self.lookup_policy, self.suffix_policy) if p is not None]
        return out + ([self.model.policy] if self.model is not None else [])

    def start(self, target: KVSequence, slot: int) -> None:
        """The prompt is in the target's cache (its first token sampled)."""
        if self.lookup is not None:
            self.lookup.sync(target.cached)
        if self.model is not None:
            self.model.start(target, slot)
            self._report()

    def reusable(self, seq: KVSequence) -> int:
        """How much of the slot's cached sequence a new request may keep: all of it, except what a
        head did not see (then the target reads the rest again, and the head with it)."""
        if isinstance(self.model, HeadDrafter):
            return self.model.head.reusable(seq.seq_id, seq.cached)
        return len(seq.cached)

    def refresh_due(self) -> bool:
        return any([p.refresh_due() for p in self.policies()])

    def propose(self, history: list[int], room: int, slot: int) -> Proposal | None:
        """The better of what lookup found and what the draft model would draft (`auto`), by
        expected tokens per unit of time for this request alone; None when neither has anything."""
        best: Proposal | None = None
        best_rate = 0.0
        if self.lookup is not None and self.lookup_policy is not None:
            policy = self.lookup_policy
            self.lookup.sync(history)
            forced = self.constraint.forced()[:room] if self.constraint is not None else []
            match = self.lookup.lookup(policy.limit(room))
            tail = match.tokens[len(forced):] if match.tokens[:len(forced)] == forced else []
            if match.tokens and not forced:
                policy.full_match = match.full
                policy.copied = match.agreement
            if forced or tail:
                draft = forced + tail[:max(0, room - len(forced))]
                gains = [1.0] * len(forced) + policy.gains(len(draft) - len(forced), _quality(match, policy))
                best = Proposal("lookup", policy, len(draft), gains, tokens=draft,
                                fixed=not policy.opts.adaptive and not forced, forced=len(forced))
                best_rate = _best_rate(best)
        if self.suffix is not None and self.suffix_policy is not None:
            candidate = self._suffix_proposal(history, room)
            if candidate is not None and (best is None or _best_rate(candidate) > best_rate):
                best, best_rate = candidate, _best_rate(candidate)
        model = self.model
        if model is not None and model.enabled:
            policy = model.policy
            limit = policy.limit(room)
            if isinstance(model, HeadDrafter):
                limit = min(limit, model.head.max_draft)  # Medusa: a token per head at most
            if limit > 0:
                kind = "head" if isinstance(model, HeadDrafter) else "model"
                proposal = Proposal(kind, policy, limit, policy.gains(limit), draft_cost=model.draft_cost(),
                                    fixed=not policy.opts.adaptive)
                rate = _best_rate(proposal)
                if best is None or rate > best_rate:
                    best = proposal
                    constrained = self.sampler is not None and (self.sampled or self.sampler.grammar is not None)
                    best.job = DraftJob(slot, history, 0, self.sampler if constrained else None, self.sampled,
                                        model.p_min)
                    best.context = model.context
        return best

    def _suffix_proposal(self, history: list[int], room: int) -> Proposal | None:
        """What the suffix drafter found: the policy's estimates for this source, scaled along the
        draft by the frequencies behind each token (a token that followed 2 of 3 times is worth 2/3
        of one that always did)."""
        assert self.suffix is not None and self.suffix_policy is not None
        policy = self.suffix_policy
        found = self.suffix.draft(history, policy.limit(room))
        if not found.tokens:
            return None
        policy.full_match, policy.copied = found.match >= _FULL_SUFFIX_MATCH, found.match
        quality = self.match_quality.quality(found.match, policy.model().prob(policy.origin()))
        gains = [g * p for g, p in zip(policy.gains(len(found.tokens), quality), found.probs)]
        return Proposal("suffix", policy, len(found.tokens), gains, tokens=found.tokens,
                        fixed=not policy.opts.adaptive, remembered=self.suffix.remembered(found), match=found.match)

    def observe(self, proposal: Proposal | None, n_drafted: int, n_accepted: int, step_s: float,
                plain_s: float) -> None:
        """Feedback after verification (a plain step when nothing was drafted)."""
        # A head catching up on the tokens since its last draft is a one-off (one batched decode),
        # not what drafting costs from here on: an exploration is judged without it.
        job = proposal.job if proposal is not None else None
        draft_s = job.seconds - job.catch_up_s if job is not None else 0.0
        if n_drafted == 0:
            for p in self.policies():
                p.observe(0, 0, step_s, 0.0, plain_s, learn_costs=False)
            self.stats.plain_steps += 1
            if self.model is not None and self.model.enabled and not self.stats.drafted and not self.stats.note:
                # On (the gate judges it can pay at high acceptance) yet never planned: say so.
                self.stats.note = self._idle_note = self.model.idle_note()
            return
        assert proposal is not None
        if proposal.kind == "suffix":
            self.match_quality.update(proposal.match, n_accepted > 0)
        forced = min(proposal.forced, n_drafted)  # (always accepted: not evidence about lookup)
        proposal.policy.observe(n_drafted - forced, max(0, n_accepted - forced), step_s, draft_s, plain_s,
                                learn_costs=False)
        if self._idle_note and self.stats.note == self._idle_note:
            self.stats.note = self._idle_note = ""  # it drafts after all
        self.stats.record(n_drafted, n_accepted)
        if proposal.remembered:
            self.stats.remembered += n_accepted
        if proposal.job is not None and self.model is not None:
            self.model.drafted(proposal.job)
            self.stats.draft_cost = round(self.model.draft_cost(), 4)
            self._report()
            if isinstance(self.model, HeadDrafter):  # the target now holds history[:-1]: so does the head
                self.model.head.accept(proposal.job.slot, len(proposal.job.history) - 1)

    def _report(self) -> None:
        """Say in the stats when the draft model switched itself off (at start or later)."""
        if self.model is not None and self.model.note:
            self.stats.note = self.model.note


class MatchQuality:
    """How often a suffix draft's first token was right, by the length of the match it came from
    (`_MATCH_BUCKETS`; full matches are the policy's copies): a factor on the policy's estimate
    for the first drafted row. Each bucket starts at the policy's estimate (`_MATCH_PRIOR_WEIGHT`
    observations' worth) and forgets slowly, as AcceptanceModel does."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.hits = [0.0] * len(_MATCH_BUCKETS)
        self.tries = [0.0] * len(_MATCH_BUCKETS)

    @staticmethod
    def bucket(match: int) -> int | None:
        if match >= _FULL_SUFFIX_MATCH:
            return None
        return next((i for i, top in enumerate(_MATCH_BUCKETS) if match <= top), len(_MATCH_BUCKETS) - 1)

    def quality(self, match: int, base: float) -> float:
        b = self.bucket(match)
        if b is None or base <= 0:
            return 1.0
        estimate = (self.hits[b] + base * _MATCH_PRIOR_WEIGHT) / (self.tries[b] + _MATCH_PRIOR_WEIGHT)
        return estimate / base

    def update(self, match: int, first_right: bool) -> None:
        b = self.bucket(match)
        if b is None:
            return
        self.hits[b] = self.hits[b] * self.decay + first_right
        self.tries[b] = self.tries[b] * self.decay + 1.0


def _quality(match: LookupMatch, policy: LengthPolicy) -> float:
    """A factor on the first drafted row's estimate (LengthPolicy.gains)."""
    return 1.0 if match.n >= 3 or policy.in_run else _WEAK_MATCH_QUALITY


def _best_rate(p: Proposal) -> float:
    """Expected tokens per target step of the proposal's best length, drafting alone."""
    costs = p.policy.costs
    t1 = costs.time(1)
    best, e = 1.0, 1.0
    for k, g in enumerate(p.gains, start=1):
        e += g
        rate = e / (costs.time(k + 1) * costs.optimism(k + 1) / t1 + k * p.draft_cost)
        best = max(best, rate)
    return best
