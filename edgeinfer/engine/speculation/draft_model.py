"""Drafting with a second, cheaper model (another model of the same vocabulary, or a quantized copy
of the target): one context for every slot of an engine, sequence id = slot, kept in step with
the target's sequences; the drafts of every request of a step come from the same decodes."""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...errors import IncompatibleDraftError
from ..llama.runtime import DecodeRows, LlamaRuntime
from ..core.sampler import Sampler, TokenDistribution
from ..core.sequence import KVSequence, common_prefix
from .policy import CostModel, LengthPolicy

__all__ = ["DraftContext", "DraftJob", "ModelDrafter", "check_draft_compatible", "relative_draft_cost", "draft_token"]

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
# Draft runtimes whose cost in the cache was measured by drafting, not only probed.
_measured_runtimes: weakref.WeakSet[LlamaRuntime] = weakref.WeakSet()


def relative_draft_cost(target: KVSequence, draft: KVSequence, target_step: float | None = None,
                        reps: int = 3) -> float:
    """One draft-model decode in target decodes, measured once per draft runtime, each model's
    fastest of `reps` one-token decodes, alternating so both see the same machine. Each decode
    goes after what its sequence holds and is removed again (the target's after the prompt, once
    its first token is sampled: the logits it overwrites are no longer needed).

    A recurrent or hybrid target is not probed: its memory cannot drop a token again (a cut
    empties the whole sequence, and its rollback snapshots restore states only inside the decode
    that wrote them, never the state before it), so the draft's time is put over `target_step`
    (the cost curve's one-row step). A draft with such a memory is emptied after its probe, and
    reads its sequence again at its first draft."""
    if draft.runtime in _relative_step_cache:
        return _relative_step_cache[draft.runtime]
    probe_target = target.can_drop_suffix
    if not target.cached or not (probe_target or target_step):
        return 0.3  # nothing to measure after: a guess until drafting measures it
    d_last = draft.cached[-1] if draft.cached else target.cached[0]
    t_base, t_last = len(target.cached), target.cached[-1]
    best_t = best_d = float("inf")
    for _ in range(reps):
        if probe_target:
            t0 = time.perf_counter()
            target.decode([t_last])
            best_t = min(best_t, time.perf_counter() - t0)
            target.truncate(t_base)
        d_base = len(draft.cached)
        t0 = time.perf_counter()
        draft.decode([d_last])
        best_d = min(best_d, time.perf_counter() - t0)
        draft.truncate(d_base)
    relative = best_d / (best_t if probe_target else target_step)  # type: ignore[operator]
    _relative_step_cache[draft.runtime] = relative
    return relative


@dataclass
class DraftJob:
    """One request's drafting in a step: up to `k` tokens after `history`. With the request's
    `sampler` the draft follows its constraints (grammar, penalties) through a fork of it, and
    with `sampled` draws from q with its settings and RNG (else: the top token); `p_min` stops a
    draft whose top token is unsure."""

    slot: int
    history: Sequence[int]
    k: int
    sampler: Sampler | None = None
    sampled: bool = False
    p_min: float = 0.0
    tokens: list[int] = field(default_factory=list)
    qs: list[TokenDistribution] = field(default_factory=list)  # q of each token when sampled
    seconds: float = 0.0  # its share of the drafting decodes
    catch_up_s: float = 0.0  # of which a head spent catching up on a backlog (not a drafted token's cost)


def draft_token(row: np.ndarray, job: DraftJob, fork: Sampler | None) -> int | None:
    """The next draft token from a logits row, or None where p_min says stop (never before the
    first token). Stopping depends only on q, before its token is drawn: the rule stays exact.
    (A draft model's and a head's drafts alike.)"""
    if job.sampled and fork is not None:
        q = fork.distribution(row)
        if q.top < job.p_min and job.tokens:
            return None
        job.qs.append(q)
        tok = q.draw(fork.rng)
    else:
        tok = int(fork.distribution(row).ids[0]) if fork is not None else int(np.argmax(row))  # (greedy: one-hot)
        if job.p_min > 0 and job.tokens:
            z = row - row[tok]
            if 1.0 / float(np.exp(z, dtype=np.float32).sum()) < job.p_min:
                return None
    if fork is not None:
        fork.accept(tok)
    return tok


class DraftContext:
    """A draft model's runtime shared by an engine's slots: sequence i is slot i's."""

    def __init__(self, runtime: LlamaRuntime, n_slots: int, method: str = "draft"):
        self.runtime = runtime
        self.method = method
        self.seqs = [KVSequence(runtime, i) for i in range(n_slots)]
        f = runtime.facts
        # Seconds of one draft decode by rows: a prior from its size, learned from its decodes.
        self.costs = CostModel.prior(f.size_bytes, f.n_layer, f.n_embd)

    def _sync(self, seq: KVSequence, history: Sequence[int], tail: int) -> list[int]:
        """Make the sequence hold `history` but for its last `tail` tokens at most (always at least
        the last one), and return those for the next draft decode: they enter with the token it
        drafts from in one batch, not one decode per token it fell behind."""
        keep = common_prefix(seq.cached, history[:-1])
        keep = seq.truncate(keep)
        split = max(keep, len(history) - tail)
        seq.decode_all(list(history[keep:split]))
        return list(history[split:])

    def draft(self, jobs: list[DraftJob]) -> None:
        """Fill each job's tokens (and q's): the k-th draft tokens of all jobs in one decode."""
        rt = self.runtime
        pending = {id(j): self._sync(self.seqs[j.slot], j.history, min(_CATCH_UP_ROWS, rt.n_batch)) for j in jobs}
        active = [j for j in jobs if j.k > 0]
        # The drafts follow each request's grammar and penalties from its state now: a fork,
        # advanced along the draft and thrown away after it.
        forks = {id(j): j.sampler.fork(rt) for j in active if j.sampler is not None}
        t0 = time.perf_counter()
        try:
            self._draft(active, pending, forks)
        finally:
            for f in forks.values():
                f.close()
        per = (time.perf_counter() - t0) / max(len(jobs), 1)
        for j in jobs:
            j.seconds = per

    def _draft(self, active: list[DraftJob], pending: dict[int, list[int]], forks: dict[int, Sampler]) -> None:
        rt = self.runtime
        while active:
            rows = DecodeRows()
            lasts: list[int] = []
            for j in active:
                seq = self.seqs[j.slot]
                toks = pending[id(j)]
                seq.rows(toks, len(toks) - 1, into=rows)
                lasts.append(len(rows) - 1)
            if len(rows) > rt.n_batch or any(len(self.seqs[j.slot]) + len(pending[id(j)]) >= rt.n_ctx // len(self.seqs)
                                             for j in active):
                break
            t_step = time.perf_counter()
            rt.decode_batch(rows)
            self.costs.observe(len(rows), time.perf_counter() - t_step, depth=max(len(self.seqs[j.slot]) for j in active),
                               plain=False, prefill=True)
            still = []
            for j, row in zip(active, lasts):
                self.seqs[j.slot].committed(pending[id(j)])
                tok = draft_token(rt.logits_row(row), j, forks.get(id(j)))
                if tok is None:
                    continue
                j.tokens.append(tok)
                pending[id(j)] = [tok]
                if len(j.tokens) < j.k:
                    still.append(j)
            active = still

    def forget(self, slots: list[int]) -> None:
        """After a failed draft: what these slots' sequences hold is not trusted; each is read again
        at its next draft."""
        for slot in slots:
            seq = self.seqs[slot]
            try:
                seq.clear()
            finally:
                seq.forget()


class ModelDrafter:
    """One request's draft-model state: its length policy, whether the draft model can pay at
    all, and the draft step's cost in target steps (an estimate, then measured)."""

    def __init__(self, context: DraftContext, policy: LengthPolicy, p_min: float, method: str = "draft"):
        self.context = context
        self.policy = policy
        self.p_min = p_min
        self.method = method
        self.step_s = 0.0  # seconds per draft token: the estimate, then measured (EWMA)
        self.measured = False
        self.enabled = True
        self.note = ""

    def start(self, target: KVSequence, slot: int) -> None:
        """A draft that cannot pay even at high acceptance is switched off before it costs
        anything (a quantized copy of a small model is often nearly as slow as the model itself:
        its time goes to overheads)."""
        relative = relative_draft_cost(target, self.context.seqs[slot], self.policy.costs.time(1))
        self.step_s = relative * self.policy.costs.time(1)
        if not self._too_slow() and self.context.runtime not in _measured_runtimes:
            # The probe ran after a short prefix and can read cheap; drafting at the prompt's depth
            # costs what it costs. Without a draft that cost is never seen and a draft the plan
            # keeps declining stays "on" unmeasured (and unexplained): one short draft settles it.
            self.policy.explore_next()

    def draft_cost(self) -> float:
        """A drafted token's cost in target steps at the current depth."""
        t1 = self.policy.costs.time(1)
        return self.step_s / t1 if t1 > 0 and self.step_s > 0 else 0.3

    def _too_slow(self) -> bool:
        d = self.draft_cost()
        if self.enabled and not self.policy.can_pay(d):
            self.enabled = False
            self.note = (f"{self.method} off: a drafted token costs {d:.2f} target steps, too slow to pay "
                         "even at 90 % acceptance")
        return not self.enabled

    def idle_note(self) -> str:
        """Why a draft that is on has drafted nothing yet: the plan found no step worth it."""
        return (f"{self.method} off for this request so far: a drafted token costs {self.draft_cost():.2f} target "
                "steps, not worth drafting at the acceptance expected")

    def drafted(self, job: DraftJob) -> None:
        """Learn the draft step's cost from a job just drafted (for this request and the next)."""
        if not job.tokens:
            return
        per = job.seconds / len(job.tokens)
        self.step_s = 0.8 * self.step_s + 0.2 * per if self.measured else per
        self.measured = True
        _relative_step_cache[self.context.runtime] = self.draft_cost()
        _measured_runtimes.add(self.context.runtime)
        self._too_slow()
