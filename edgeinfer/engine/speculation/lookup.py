"""Prompt lookup: drafts copied from earlier in the prompt and the output (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["NgramIndex", "LookupMatch"]


class LookupMatch(NamedTuple):
    """What a lookup found: the continuation, the n-gram it matched, and how many tokens before
    the place agree with the text's end (>= n): the evidence that the text is copying that place."""

    tokens: list[int]
    n: int
    agreement: int

    @property
    def full(self) -> bool:
        """At least as long as the longest n-gram the index keeps agrees: after an insertion
        (a docstring, a new line) the text has resumed copying, as a short match has not shown."""
        return self.agreement >= _FULL_MATCH


# Agreement (tokens) that makes a match full: the longest n-gram NgramIndex keeps by default.
_FULL_MATCH = 4


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

    def lookup(self, max_len: int) -> LookupMatch:
        """Continuation of the longest n-gram at the end that occurred before."""
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
            return LookupMatch(self.tokens[best : min(best + max_len, L)], n, best_m)
        return LookupMatch([], 0, 0)
