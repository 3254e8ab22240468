"""One request's speculation: what it may draft each step, and what it learns from each step.

The scheduler core asks every decoding request for a `Proposal` (prompt lookup's continuation, or
a draft model's next tokens, not yet drafted), sizes all proposals of a step together with
`plan_drafts` from the batch's cost curve, has the draft model draft what was planned, verifies
everything in one target decode and reports back with `observe`.
"""

from __future__ import annotations

import warnings
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

__all__ = ["Proposal", "RequestSpeculation", "speculation_method", "recurrent_warning"]

# A 2-gram match is weaker evidence than a longer one.
_WEAK_MATCH_QUALITY = 0.8


def speculation_method(spec: SpeculationOptions) -> str:
    """The name stats report for a method ("self=Q3_K_M" for a self-draft)."""
    return {"self": f"self={spec.self_quant}"}.get(spec.method, spec.method)


@dataclass
class Proposal:
    """What one request could draft this step."""

    kind: Literal["lookup", "model", "head"]
    policy: LengthPolicy
    limit: int  # most rows it may draft
    gains: list[float]  # expected tokens each row would add
    tokens: list[int] = field(default_factory=list)  # lookup: the continuation found; model: after drafting
    draft_cost: float = 0.0  # a drafted token's cost in target steps (a draft model's or a head's decodes)
    fixed: bool = False  # a fixed length the user asked for (adaptive off): not planned
    k: int = 0  # what the step's plan gave it
    job: DraftJob | None = None  # a draft model's work, once planned
    context: DraftContext | HeadContext | None = None  # the draft model's or head's context


class RequestSpeculation:
    """A request's drafters (lookup and/or a draft model or head), their policies and statistics."""

    def __init__(self, spec: SpeculationOptions, costs: CostModel, stats: SpeculationStats,
                 draft: DraftContext | HeadContext | None, sampler: Sampler | None):
        self.spec = spec
        self.stats = stats
        self.method = speculation_method(spec)
        self.lookup: NgramIndex | None = NgramIndex() if spec.method in ("lookup", "auto") else None
        self.lookup_policy = LengthPolicy(costs, spec) if self.lookup is not None else None
        self.model: ModelDrafter | None = None
        if isinstance(draft, HeadContext) and spec.method in (*HEAD_METHODS, "auto"):
            # A head drafts from the target's own states (its catching up is one batched decode):
            # the same policy as a draft model, the same limit on unprofitable explorations.
            self.model = HeadDrafter(draft, LengthPolicy(costs, spec, max_failed_explorations=2), spec.p_min)
        elif draft is not None and spec.method in ("draft", "self", "auto"):
            self.model = ModelDrafter(draft, LengthPolicy(costs, spec, max_failed_explorations=2), spec.p_min,
                                      draft.method if spec.method == "auto" else self.method)
        # A draft model follows the request's constraints (its sampler's forks); at T > 0 it samples
        # its drafts from q (the rejection rule verifies).
        self.sampler = sampler if self.model is not None else None
        self.sampled = self.sampler is not None and self.sampler.exact
        """Whether this request's tokens are all drawn in numpy (a sampling draft model)."""

    def policies(self) -> list[LengthPolicy]:
        out = [self.lookup_policy] if self.lookup_policy is not None else []
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
            match = self.lookup.lookup(policy.limit(room))
            if match.tokens:
                policy.full_match = match.full
                draft = match.tokens
                best = Proposal("lookup", policy, len(draft), policy.gains(len(draft), _quality(match, policy)),
                                tokens=draft, fixed=not policy.opts.adaptive)
                best_rate = _best_rate(best)
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
            return
        assert proposal is not None
        proposal.policy.observe(n_drafted, n_accepted, step_s, draft_s, plain_s, learn_costs=False)
        self.stats.record(n_drafted, n_accepted)
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

    def close(self) -> None:
        pass


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


def recurrent_warning(name: str) -> None:
    warnings.warn(f"speculation off: {name} is a recurrent/hybrid model whose memory cannot drop a rejected suffix",
                  stacklevel=4)
