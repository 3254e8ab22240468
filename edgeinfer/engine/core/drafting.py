"""The drafting part of a scheduler step: each decoding request's proposal, sized together for the
whole batch from the cost curve (`plan_drafts`), then drafted by each drafter (a draft model, a
head) in one batched call; and the drafters' share of what a step hands back (a head's copy of
the target's hidden states, what each request's policy learns).

A drafter's failure stays with the requests it drafts for, and they go on plain: drafts are only
proposals, and no drafter writes anything the target reads (a draft model and a head keep
contexts of their own), so a request whose drafter failed loses nothing but its speed. Its
speculation is switched off and says why in its stats, the drafter forgets what it held for its
slots (a later request's drafts start from a fresh read), and the other requests of the step —
and the engine — never see it. (Ending those requests instead would fail a user's answer for an
optimization that failed.) What touches the target's own sequence is not here: a drafter's
start probes it, and a failure there ends the request (Scheduler._isolated).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from ..llama.runtime import DecodeRows, LlamaRuntime
from ..speculation.heads import HeadContext
from ..speculation.policy import CostModel, plan_drafts
from ..speculation.request_speculation import Proposal
from .request import RequestState

__all__ = ["plan", "heads_after_decode", "observe", "speculation_failed"]

log = logging.getLogger(__name__)


class StepCore(Protocol):
    """What drafting reads of the scheduler core (engine/core/scheduler.py's Scheduler)."""

    runtime: LlamaRuntime
    costs: CostModel
    slot_ctx: int
    draft_max_rows: int
    margin: float
    split: bool
    heads: Callable[[], list[HeadContext]] | None
    active: list[RequestState]

    def step_cost(self, shape: list[tuple[int, int]]) -> float: ...


def speculation_failed(r: RequestState, error: BaseException) -> None:
    """Switch off the request's speculation (it goes on plain) and say why in its stats."""
    r.speculation = None
    if r.stats.speculation is not None:
        r.stats.speculation.note = f"speculation off: its drafter failed ({type(error).__name__}: {error})"


def _plain_on_failure(r: RequestState, fn: Callable[..., Any], *args: Any) -> Any:
    """One request's drafting call; an exception switches its speculation off (None returned) and
    its drafter forgets what it held for the request's slot."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a drafter's failure: this request goes on plain
        log.exception("drafting failed; the request goes on without speculation")
        model = r.speculation.model if r.speculation is not None else None
        if model is not None and r.seq is not None:
            _forget(model.context, [r.seq.seq_id])
        speculation_failed(r, e)
        return None


def _forget(context: Any, slots: list[int]) -> None:
    try:
        context.forget(slots)
    except Exception:  # noqa: BLE001 - whatever it still holds is checked again before its next draft
        log.exception("the %s drafter could not forget its failed drafts", context.method)


def plan(core: StepCore, decoding: list[RequestState], chunks: list[tuple[RequestState, int]]) -> list[Proposal | None]:
    """Each decoding request's proposal, sized for the whole batch (see plan_drafts), and what
    a draft model then drafted for it."""
    base_rows = len(decoding) + sum(n for _, n in chunks)
    out: list[Proposal | None] = [None] * len(decoding)
    specs = [(i, r.speculation) for i, r in enumerate(decoding) if r.speculation is not None]
    # A plain step now and then re-measures t1 (the unit of every cost): all requests take it.
    due = [_plain_on_failure(decoding[i], spec.refresh_due) for i, spec in specs]
    specs = [(i, spec) for i, spec in specs if decoding[i].speculation is not None]
    if not specs or any(due):
        return out
    for i, spec in specs:
        r = decoding[i]
        assert r.seq is not None
        room = min(core.slot_ctx - len(r.seq) - 1, r.options.max_tokens - len(r.generated) - 1,
                   core.draft_max_rows)
        if core.runtime.facts.recurrent:  # a hybrid target rolls back at most n_rs_seq positions
            room = min(room, core.runtime.n_rs_seq)
        out[i] = _plain_on_failure(r, spec.propose, r.history, room, r.seq.seq_id) if room > 0 else None
    planned_at = [i for i, p in enumerate(out) if p is not None and not p.fixed]
    planned = [out[i] for i in planned_at]
    base = base_rows + sum(p.limit for p in out if p is not None and p.fixed)
    if planned:
        costs = core.costs
        models = [j for j, p in enumerate(planned) if p.kind in ("model", "head")]

        groups: dict[int, list[int]] = {}  # the proposals of each drafter (draft model, head)
        for m in models:
            groups.setdefault(id(planned[m].context), []).append(m)
        t1 = costs.time(1)

        def drafting(counts: list[int]) -> float:  # each drafter's decodes, one per position drafted
            total = 0.0
            for mine in groups.values():
                if len(mine) == 1:  # one request: its k decodes of one row (plan_drafts asks ~k times a step)
                    total += counts[mine[0]] * planned[mine[0]].draft_cost * t1
                    continue
                shape, j = planned[mine[0]].context.costs.shape, 1  # type: ignore[union-attr]
                while at := [m for m in mine if counts[m] >= j]:
                    total += max(planned[m].draft_cost for m in at) * t1 * shape(len(at))
                    j += 1
            return total

        seq_of = [decoding[i].seq.seq_id for i in planned_at]  # type: ignore[union-attr]
        base_shape = {r.seq.seq_id: 1 + (p.limit if p is not None and p.fixed else 0)  # type: ignore[union-attr]
                      for r, p in zip(decoding, out)}
        base_shape.update({r.seq.seq_id: n for r, n in chunks})  # type: ignore[union-attr]

        def ubatches(counts: list[int]) -> float:  # what the extra ubatches of a stream per slot cost
            shape = dict(base_shape)
            for seq_id, c in zip(seq_of, counts):
                shape[seq_id] += c
            return core.step_cost(sorted(shape.items())) - costs.time(sum(shape.values()))

        def extra(counts: list[int]) -> float:
            return (drafting(counts) if models else 0.0) + (ubatches(counts) if core.split else 0.0)

        counts = plan_drafts([p.gains for p in planned], base, lambda b: costs.time(b) * costs.optimism(b),
                             core.runtime.n_batch, core.margin, extra if models or core.split else None)
        for p, k in zip(planned, counts):
            p.k = k
    for i, p in enumerate(out):
        if p is not None:
            k = _plain_on_failure(decoding[i], p.policy.settle, p.k, p.limit, p.gains, p.draft_cost)
            if k is None:
                out[i] = None
            else:
                p.k = k
    jobs = [(r, p) for r, p in zip(decoding, out) if p is not None and p.job is not None and p.k > 0]
    for _, p in jobs:
        p.job.k = p.k  # type: ignore[union-attr]
    for context in {id(p.context): p.context for _, p in jobs}.values():  # a draft model, a head: each batched
        mine = [(r, p) for r, p in jobs if p.context is context]
        try:
            context.draft([p.job for _, p in mine])  # type: ignore[union-attr,misc]
        except Exception as e:  # noqa: BLE001 - a drafter's failure: its requests go on plain (see the module)
            log.exception("the %s drafter failed; its requests go on without speculation", context.method)  # type: ignore[union-attr]
            _forget(context, [p.job.slot for _, p in mine])  # type: ignore[union-attr]
            for r, p in mine:
                p.job.tokens.clear()  # type: ignore[union-attr]
                speculation_failed(r, e)
    for p in out:
        if p is not None and p.job is not None:
            p.tokens = p.job.tokens
            p.k = len(p.tokens)
    return out


def heads_after_decode(core: StepCore, rows: DecodeRows) -> None:
    """Hand every head the rows the target just decoded (prompt chunks included); a head that
    raises forgets everything, and the requests it drafts for go on plain."""
    for head in core.heads() if core.heads is not None else ():
        try:
            head.after_decode(rows)
        except Exception as e:  # noqa: BLE001 - see the module
            log.exception("the %s head failed; its requests go on without speculation", head.method)
            _forget(head, list(range(head.n_slots)))
            for r in core.active:
                if r.speculation is not None and r.speculation.model is not None and r.speculation.model.context is head:
                    speculation_failed(r, e)


def observe(r: RequestState, p: Proposal | None, n_drafted: int, n_accepted: int, step_s: float,
            plain_s: float) -> None:
    """What the request's speculation learns from its step (a failure: it goes on plain)."""
    if r.speculation is not None:
        _plain_on_failure(r, r.speculation.observe, p, n_drafted, n_accepted, step_s, plain_s)
