"""Drafting with a second, cheaper model (another model of the same vocabulary, or a quantized
copy of the target): its own llama.cpp context, kept in step with the target's."""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import numpy as np

from ...errors import IncompatibleDraftError
from ..llama import LlamaRuntime
from ..sampler import Sampler, TokenDistribution, sampling_distribution
from .policy import LengthPolicy

__all__ = ["ModelDrafter", "check_draft_compatible", "relative_draft_cost"]

# llama.cpp's own compatibility rule for a draft vocabulary (common/speculative.cpp).
_VOCAB_MAX_SIZE_DIFFERENCE = 128
_VOCAB_CHECK_START_TOKEN_ID = 5
# Tokens the draft model may be behind that enter with its first draft decode, in one batch.
_CATCH_UP_ROWS = 4


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
    """A second, cheaper model drafts in its own context, kept in step with the target's; it stops
    early when its own top token's probability falls below p_min.

    Greedy requests (and any request it is not given a sampler for) get its argmax tokens, which the
    target verifies by sample-and-match. Given the request's sampler (`use_sampler`, T > 0, no
    penalties) it SAMPLES each draft from q = the sampler's transforms (top-k → top-p → min-p →
    temperature) applied to its own logits, with the request's RNG, and keeps those q
    (`distributions`) for the target's rejection rule."""

    method = "draft"

    def __init__(self, runtime: LlamaRuntime, policy: LengthPolicy, p_min: float, method: str = "draft",
                 target: LlamaRuntime | None = None):
        self.rt = runtime
        self.target = target
        self.policy = policy
        self.p_min = p_min
        self.method = method
        self.step_s = 0.0  # seconds per draft token: the estimate, then measured (EWMA)
        self.measured = False  # whether step_s comes from drafting at the request's own depth
        self.enabled = True
        self.note = ""
        self.sampler: Sampler | None = None
        self.distributions: list[TokenDistribution] = []  # q of each token of the last draft

    def use_sampler(self, sampler: Sampler) -> None:
        """Draft by sampling from q with this request's sampler settings and RNG (see the class)."""
        self.sampler = sampler if sampler.exact else None

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

    def _sync(self, history: Sequence[int], tail: int = 1) -> list[int]:
        """Make the draft's cache hold history but for its last `tail` tokens at most (always at
        least the last one), and return those for the caller's next decode: drafting decodes them
        with the token it drafts from in one batch, not one decode per token it fell behind."""
        rt = self.rt
        keep = 0
        limit = min(len(rt.cached), len(history) - 1)
        while keep < limit and rt.cached[keep] == history[keep]:
            keep += 1
        rt.truncate(keep)
        split = max(keep, len(history) - tail)
        missing = list(history[keep:split])
        for s in range(0, len(missing), rt.n_batch):
            rt.decode(missing[s : s + rt.n_batch])
        return list(history[split:])

    def draft_cost(self, target_step_s: float) -> float:
        return self.step_s / target_step_s if target_step_s > 0 and self.step_s > 0 else 0.3

    def candidate(self, history: Sequence[int], max_len: int) -> tuple[int, float]:
        if not self.enabled:
            return 0, 1.0
        self.policy.costs.at(len(history))
        d = self.draft_cost(self.policy.costs.time(1))
        return self.policy.choose(max_len, d)

    def draft(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        rt = self.rt
        # After a step that accepted the whole draft the draft model is behind by its last drafted
        # token and the target's bonus token: both enter with the first decode below (a longer
        # catch-up, after plain steps, is decoded first and not counted as drafting time).
        pending = self._sync(history, tail=min(_CATCH_UP_ROWS, rt.n_batch))
        t0 = time.perf_counter()
        out: list[int] = []
        self.distributions = []
        sampler = self.sampler
        for _ in range(k):
            if len(rt.cached) + len(pending) >= rt.n_ctx:
                break
            rt.decode(pending)
            row = rt.logits_row(-1)
            if sampler is not None:
                # Stopping depends only on q, before its token is drawn: the rule stays exact.
                q = sampling_distribution(row, sampler.options)
                if q.top < self.p_min and out:
                    break
                tok = q.draw(sampler.rng)
                self.distributions.append(q)
            else:
                tok = int(np.argmax(row))
                if self.p_min > 0:
                    z = row - row[tok]
                    p_top = 1.0 / float(np.exp(z, dtype=np.float32).sum())
                    if p_top < self.p_min and out:
                        break
            out.append(tok)
            pending = [tok]
        if out:
            per = (time.perf_counter() - t0) / len(out)
            # The first real draft replaces the estimate (taken after a short prefix, it can be far
            # too cheap at the prompt's depth), for this request and the next ones; later drafts
            # are smoothed.
            self.step_s = 0.8 * self.step_s + 0.2 * per if self.measured else per
            self.measured = True
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
