"""Prompt lookup: drafts copied from earlier in the prompt and the output (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence

from .policy import LengthPolicy

__all__ = ["NgramIndex", "LookupDrafter"]


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
        self.policy.costs.at(len(history))
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
