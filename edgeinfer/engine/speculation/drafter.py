"""A request's drafter, built from an explicit context (target runtime, cost model, draft runtimes)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..llama import LlamaRuntime
from ..options import SpeculationOptions
from ..sampler import Sampler, TokenDistribution
from .draft_model import ModelDrafter
from .lookup import LookupDrafter
from .policy import CostModel, LengthPolicy

if TYPE_CHECKING:
    from ..events import SpeculationStats

__all__ = ["SpeculationContext", "AutoDrafter", "RequestDrafter", "make_drafter"]


@dataclass(frozen=True)
class SpeculationContext:
    """What drafters need from the engine, given explicitly rather than read from it.

    target: the target model's runtime; its cache holds the prompt when a drafter starts.
    costs: the target's decode costs by batch size; called with sample tokens to calibrate with
        the first time (the engine measures once and remembers the result in the store).
    draft_runtime: the runtime of the draft model that options name (a draft model, or the
        target's quantized copy), prepared beforehand (Engine.prepare_speculation).
    name: the target's name, for messages.
    """

    target: LlamaRuntime
    costs: Callable[[Sequence[int]], CostModel]
    draft_runtime: Callable[[SpeculationOptions], LlamaRuntime]
    name: str = "this model"


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

    def draft_distributions(self) -> list[TokenDistribution] | None:
        """q of the last draft when the (sampling) draft model made it; None for a lookup draft."""
        if self._last is self.model and self.model is not None and self.model.sampler is not None:
            return self.model.distributions
        return None

    def observe(self, history: Sequence[int], n_drafted: int, n_accepted: int, verify_s: float, draft_s: float) -> None:
        if self._last is not None:
            self._last.observe(history, n_drafted, n_accepted, verify_s, draft_s)
        else:
            self.lookup.policy.observe(0, 0, verify_s, draft_s)

    def close(self) -> None:
        pass


def make_drafter(ctx: SpeculationContext, spec: SpeculationOptions,
                 stats: SpeculationStats | None = None) -> RequestDrafter | None:
    """The drafter for a request, or None (with a warning) where speculation cannot work."""
    if spec.method == "off":
        return None
    if ctx.target.facts.recurrent:
        warnings.warn(
            f"speculation off: {ctx.name} is a recurrent/hybrid model whose memory cannot drop a rejected suffix",
            stacklevel=3,
        )
        return None
    return RequestDrafter(ctx, spec, stats)


class RequestDrafter:
    """Builds the real drafter at `start()`, after the prompt is in the cache, so the cost
    calibration measures decodes at the real context length (once per engine)."""

    def __init__(self, ctx: SpeculationContext, spec: SpeculationOptions, stats: SpeculationStats | None = None):
        self.ctx = ctx
        self.spec = spec
        self.stats = stats
        self.method = {"self": f"self={spec.self_quant}", "draft": "draft"}.get(spec.method, spec.method)
        self.inner: LookupDrafter | ModelDrafter | AutoDrafter | None = None
        self._model: ModelDrafter | None = None
        self._sampler: Sampler | None = None

    def use_sampler(self, sampler: Sampler) -> bool:
        """Called before `start`: a draft model will sample its drafts with the request's sampler
        (T > 0, no penalties) so the target can verify them by the rejection rule. True if so."""
        models = self.spec.method in ("draft", "self") or (self.spec.method == "auto" and bool(self.spec.draft_model))
        self._sampler = sampler if models and sampler.exact else None
        return self._sampler is not None

    def draft_distributions(self) -> list[TokenDistribution] | None:
        """The draft model's q for each token of the last proposal, or None when the proposal is
        deterministic (prompt lookup, a greedy draft): then sample-and-match verifies it."""
        if isinstance(self.inner, AutoDrafter):
            return self.inner.draft_distributions()
        if isinstance(self.inner, ModelDrafter) and self.inner.sampler is not None:
            return self.inner.distributions
        return None

    def start(self, prompt: Sequence[int]) -> None:
        ctx, spec = self.ctx, self.spec
        costs = ctx.costs(prompt)
        # Each request starts from the same prior; the policy learns within the request.
        policy = LengthPolicy(costs, spec)
        if spec.method == "lookup":
            self.inner = LookupDrafter(policy)
        elif spec.method in ("draft", "self"):
            model_policy = LengthPolicy(costs, spec, max_failed_explorations=2)
            self.inner = ModelDrafter(ctx.draft_runtime(spec), model_policy, spec.p_min, self.method, target=ctx.target)
        else:  # auto
            model = (ModelDrafter(ctx.draft_runtime(spec), LengthPolicy(costs, spec, max_failed_explorations=2),
                                  spec.p_min, target=ctx.target) if spec.draft_model else None)
            self.inner = AutoDrafter(LookupDrafter(policy), model)
        self.inner.start(prompt)
        model_drafter = getattr(self.inner, "model", self.inner)
        self._model = model_drafter if isinstance(model_drafter, ModelDrafter) else None
        if self._model is not None and self._sampler is not None:
            self._model.use_sampler(self._sampler)
        self._report()

    def _report(self) -> None:
        """Say in the stats when the draft model switched itself off (at start or later)."""
        if self._model is not None and self._model.note and self.stats is not None:
            self.stats.note = self._model.note

    def propose(self, history: Sequence[int], max_len: int) -> list[int]:
        assert self.inner is not None, "start() first"
        return self.inner.propose(history, max_len)

    def observe(self, history: Sequence[int], n_drafted: int, n_accepted: int, verify_s: float, draft_s: float) -> None:
        assert self.inner is not None, "start() first"
        self.inner.observe(history, n_drafted, n_accepted, verify_s, draft_s)
        self._report()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
