"""bench_suffix's `oracle` row: the engine's own ceiling for drafting from earlier answers.

replay_suffix's `any` oracle says what a chain drafter reading the request's text and the earlier
answers could reach on the recorded curve. This runs that oracle on the engine: at each position it
drafts `off`'s answer (this run's, generated before the rounds) for as far as some place of that text
continues it, at the lengths that cost least on the curve (replay_suffix.oracle_plan), padded with a
token that is not kept where more rows cost less (replay_suffix.padded), and nothing elsewhere. The
drafts it expects kept are right, so the row is what our scheduler and verification make of perfect
choices — the most any `suffix` or `auto` policy could read on this machine.

It works by a benchmark-only patch of RequestSpeculation.propose while the row runs (the package
has no oracle drafter and needs none); the row asks for `lookup` with `adaptive=False` so that each
request has a speculation state and a policy, and the scheduler drafts the oracle's length as it is
(a fixed length is not re-planned; no plain refresh steps: a ceiling, not a policy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from benchmarks.replay_suffix import corpus_texts, oracle_accepts, oracle_plan, padded


def plain_answers(engine, prompts: Sequence[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer without speculation (the tokens the oracle drafts)."""
    import edgeinfer

    opts = edgeinfer.GenerateOptions(max_tokens=tokens, sampling=edgeinfer.SamplingOptions(temperature=0.0),
                                     speculation=edgeinfer.SpeculationOptions(method="off"))
    return [engine.generate(p, opts).result().tokens for p in prompts]


class OracleDrafts:
    """For requests 2..n of a sequence: the answer and the draft length at each of its positions."""

    def __init__(self, prompts: Sequence[list[int]], outputs: Sequence[list[int]], curve: dict[int, float]):
        self.plans: list[tuple[tuple[int, ...], list[int], list[int]]] = []
        self.rows = padded(curve)  # a step of j right drafts verifies rows[j + 1] rows (padding: see padded)
        self.big = max(curve)
        self.right = 0  # positions where the corpus continues the answer at all
        self.drafted = 0  # tokens drafted while active (all of them right unless the text parted)
        for k in range(1, len(prompts)):
            earlier = corpus_texts(prompts[k], list(zip(prompts[:k], outputs[:k])))
            accepts = oracle_accepts(list(prompts[k]), list(outputs[k]), earlier, "any")
            self.right += sum(1 for a in accepts if a)
            self.plans.append((tuple(prompts[k]), list(outputs[k]), oracle_plan(accepts, curve)))

    def draft(self, history: Sequence[int], room: int) -> list[int]:
        """The oracle's draft after `history` (a prompt of the sequence and the answer so far), or []
        off its plan's path or once the text has parted from the answer."""
        for prompt, output, lengths in self.plans:
            n = len(prompt)
            if len(history) < n or tuple(history[:n]) != prompt:
                continue
            pos = len(history) - n
            if pos >= len(lengths) or list(history[n:]) != output[:pos]:
                return []
            j = lengths[pos]
            pad = self.rows[min(j + 1, self.big)] - 1 - j
            nxt = output[pos + j] if pos + j < len(output) else output[-1]
            return (output[pos : pos + j] + [nxt + 1 if nxt > 0 else 1] * pad)[:room]  # (padding never the right token)
        return []

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from edgeinfer.engine.speculation.request_speculation import Proposal, RequestSpeculation

        original = RequestSpeculation.propose

        def propose(spec: RequestSpeculation, history: list[int], room: int, slot: int):
            draft = self.draft(history, room)
            if not draft or spec.lookup_policy is None:
                return None
            self.drafted += len(draft)
            return Proposal("lookup", spec.lookup_policy, len(draft), [1.0] * len(draft), tokens=draft, fixed=True)

        RequestSpeculation.propose = propose  # type: ignore[method-assign]
        try:
            yield
        finally:
            RequestSpeculation.propose = original  # type: ignore[method-assign]
