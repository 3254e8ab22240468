"""Suffix drafting: continuations of what earlier answers said, scored by frequency (pure Python).

After SuffixDecoding (Oliaro et al., NeurIPS 2025; vLLM's `suffix` method, Snowflake's
arctic-inference suffix tree). Agents, editors and pipelines send a model the same kind of request
again and again; the answer repeats earlier *answers* more than this prompt. The paper keeps a
suffix tree over prior outputs (and one over the request's own prompt and output): the node
reached by the longest suffix of the text that occurred before holds, per next token, how often it
followed; a draft follows the most frequent child while the product of the frequencies along the
path (the estimated chance the whole draft is right) stays above `min_prob`, and may be at most
`factor · match length` long (a long match is evidence, a short one is not). Of the candidates at
each match length, the one with the highest score (the sum of those products: its expected
accepted tokens) is drafted.

Here the tree is implicit: a `TokenCorpus` keeps the texts and, for a few n-gram lengths, where each
n-gram occurred; a node's subtree is computed from the occurrences of the deepest n-gram found (the
most recent `candidates` of them), each extended backwards to its own match length. This gives the
same counts as the tree's node over those occurrences, at a cost bounded per step
(candidates × draft length), and makes removal cheap (a dropped text's entries are skipped, then
swept). Memory is bounded in tokens: the least recently used texts go first.

`SuffixMemory` holds one corpus per scope (a server keeps one per API key, so one client's answers
never draft for another; drafts are only proposals the target verifies, never served as text).
It belongs to one loaded model (its scheduler) and is used from that model's scheduler thread only.
With a `SuffixKeeper` (suffix_file.py) each scope is read from disk when it is first used and
written back after finished requests (at most every `keeper.interval` seconds) and on `save(force=True)`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .suffix_file import SuffixKeeper

__all__ = ["TokenCorpus", "SuffixMemory", "SuffixDraft", "SuffixSource", "speculate", "DEFAULT_MEMORY_TOKENS", "PROMPT_TAIL"]

# n-gram lengths indexed (longest first): the deepest found starts the match. A 1-token match
# drafts only across a gap (_gapped): alone it is a guess that costs on text where nothing repeats.
_KEYS = (8, 4, 2, 1)
# A gap: where the text's end stops agreeing with an earlier place, up to _GAP tokens on either side
# (a value: a city, a number, a function's name) are skipped and the agreement counted on before them,
# if at least _GAP_MIN tokens agree there (the frame around the value: `"city": "`).
_GAP = 4
_GAP_MIN = 3
# Places (the most recent) whose agreement is extended across a gap: bounds the work per step.
_GAP_CANDIDATES = 16
# A draft is at most this many times as long as its match (SuffixDecoding's max_spec_factor; vLLM
# uses 1): the length policy prices every draft on the measured curve, so the cap need only stop a
# short match from drafting far. At 1, a copy resuming after an edit ramps 2, 4, 8 tokens a step.
DRAFT_FACTOR = 2.0
# Tokens of earlier answers (all scopes together) a model keeps: ~51 MB of Python objects at worst
# (every n-gram distinct; 43 MB before one-token anchors were indexed, tracemalloc).
DEFAULT_MEMORY_TOKENS = 1 << 16
# Scopes (API keys) a model keeps a corpus for; the least recently used goes first.
_MAX_SCOPES = 64
# The prompt's last tokens kept before each answer: the chat template's assistant header, so the
# answer's first tokens can be drafted from how earlier answers began.
PROMPT_TAIL = 8


class TokenCorpus:
    """Texts (token lists) and where each n-gram of them occurred, bounded in tokens (LRU texts).

    `add` keeps a finished text; `extend` grows a live one (the request's own prompt and output,
    indexed as it grows: an n-gram is indexed once the token after it is known)."""

    def __init__(self, max_tokens: int = DEFAULT_MEMORY_TOKENS):
        self.max_tokens = max_tokens
        self.texts: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self.size = 0  # tokens in live texts
        self._index: dict[int, list[int]] = {}  # hash of an n-gram -> packed (text, position after it)
        self._dead = 0  # index entries of dropped texts (swept once they outnumber the live tokens)
        self._next = 0

    def add(self, tokens: Sequence[int]) -> int:
        """Keep a text; returns its id. The least recently used texts go while over the bound."""
        tid = self.open()
        self.extend(tid, tokens)
        self.trim()
        return tid

    def open(self) -> int:
        tid = self._next
        self._next += 1
        self.texts[tid] = []
        return tid

    def extend(self, tid: int, tokens: Sequence[int]) -> None:
        text = self.texts[tid]
        index = self._index
        base = tid << 32
        for t in tokens:
            L = len(text)
            for n in _KEYS:
                if L >= n:
                    index.setdefault(hash(tuple(text[L - n : L])) ^ n, []).append(base | L)
            text.append(t)
        self.size += len(tokens)

    def touch(self, tid: int) -> None:
        if tid in self.texts:
            self.texts.move_to_end(tid)

    def drop(self, tid: int) -> None:
        text = self.texts.pop(tid, None)
        if text is not None:
            self.size -= len(text)
            self._dead += len(text) * len(_KEYS)
            if self._dead > max(self.size * len(_KEYS), 4096):
                self._sweep()

    def trim(self) -> None:
        while self.size > self.max_tokens and len(self.texts) > 1:
            self.drop(next(iter(self.texts)))

    def _sweep(self) -> None:
        live = self.texts
        self._index = {k: kept for k, v in self._index.items() if (kept := [e for e in v if e >> 32 in live])}
        self._dead = 0

    def occurrences(self, context: Sequence[int], n: int, limit: int) -> list[tuple[int, list[int], int]]:
        """(text id, text, position after) of the most recent `limit` occurrences of context's last
        n tokens (hash matches: the caller checks the tokens)."""
        if len(context) < n:
            return []
        entries = self._index.get(hash(tuple(context[-n:])) ^ n)
        if not entries:
            return []
        out = []
        texts = self.texts
        for e in reversed(entries):
            text = texts.get(e >> 32)
            if text is not None:
                out.append((e >> 32, text, e & 0xFFFFFFFF))
                if len(out) >= limit:
                    break
        return out


@dataclass
class SuffixDraft:
    """A candidate: its tokens, each one's estimated chance the draft is right up to it (the
    product of frequencies along the path), the match length it came from, and the texts used."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match: int = 0
    texts: list[tuple[TokenCorpus, int]] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(self.probs)


def _agreement(text: list[int], pos: int, context: Sequence[int], depth: int) -> int:
    """How many tokens before `pos` in text equal the context's last ones (at most depth)."""
    m, end = 0, len(context)
    while m < depth and m < end and pos - 1 - m >= 0 and text[pos - 1 - m] == context[end - 1 - m]:
        m += 1
    return m


def _gapped(text: list[int], pos: int, context: Sequence[int], m: int, depth: int) -> int:
    """The agreement m extended across one gap (see _GAP): m + the longest agreement before a skip
    of h tokens of the earlier text and g of the context (h, g <= _GAP, not both 0), if that is at
    least _GAP_MIN; else m. An answer shaped like an earlier one (a tool call with other values, the
    next test) differs in a value and agrees around it: past the value its place is known."""
    ti, ci = pos - 1 - m, len(context) - 1 - m  # the first tokens that disagree
    if ti < 0 or ci < 0 or m >= depth:
        return m
    best = 0
    for h in range(_GAP + 1):
        for g in range(_GAP + 1):
            a = 0
            if h or g:
                while a < depth - m and ti - h - a >= 0 and ci - g - a >= 0 and text[ti - h - a] == context[ci - g - a]:
                    a += 1
            best = max(best, a)
    return m + best if best >= _GAP_MIN else m


def _path(occ: list[tuple[TokenCorpus, int, list[int], int]], max_tokens: int, min_prob: float) -> SuffixDraft:
    """Follow the most frequent next token among the occurrences (ties: the most recent)."""
    out = SuffixDraft()
    prob = 1.0
    cur = occ
    while len(out.tokens) < max_tokens and cur:
        counts: dict[int, int] = {}
        for _, _, text, pos in cur:
            if pos < len(text):
                tok = text[pos]
                counts[tok] = counts.get(tok, 0) + 1
        if not counts:
            break
        tok = max(counts, key=counts.__getitem__)  # the first (most recent) of the most frequent
        prob *= counts[tok] / len(cur)
        if prob < min_prob:
            break
        out.tokens.append(tok)
        out.probs.append(prob)
        cur = [(c, tid, text, pos + 1) for c, tid, text, pos in cur if pos < len(text) and text[pos] == tok]
    out.texts = list({(id(c), tid): (c, tid) for c, tid, _, _ in cur}.values())
    return out


def speculate(context: Sequence[int], corpora: Sequence[TokenCorpus], max_len: int, *, depth: int = 32,
              candidates: int = 64, factor: float = 1.0, offset: float = 0.0, min_prob: float = 0.1,
              levels: int = 3) -> SuffixDraft:
    """The best-scoring draft of at most `max_len` tokens continuing `context` in `corpora`.

    Occurrences of the deepest indexed n-gram ending the context are each extended backwards to
    their match length (<= depth; across one gap, _gapped); the candidate at match length m drafts from the occurrences
    matching at least m, at most factor·m + offset tokens. The `levels` deepest distinct match
    lengths and the shallowest are tried (bounding the work per step)."""
    if max_len <= 0:
        return SuffixDraft()
    occ: list[tuple[TokenCorpus, int, list[int], int]] = []
    agree: list[int] = []
    for n in _KEYS:
        for c in corpora:
            for i, (tid, text, pos) in enumerate(c.occurrences(context, n, candidates)):
                m = _agreement(text, pos, context, depth)
                if m < n:
                    continue
                gapped = _gapped(text, pos, context, m, depth) if i < _GAP_CANDIDATES else m
                if n > 1 or gapped > m:
                    occ.append((c, tid, text, pos))
                    agree.append(gapped)
        if occ:
            break
    if not occ:
        return SuffixDraft()
    distinct = sorted(set(agree), reverse=True)
    tried = distinct[:levels] + ([distinct[-1]] if len(distinct) > levels else [])
    best = SuffixDraft()
    for m in tried:
        at = [o for o, a in zip(occ, agree) if a >= m]
        limit = min(max_len, int(m * factor + offset + 1e-6))
        cand = _path(at, limit, min_prob)
        if cand.score > best.score:
            cand.match = m
            best = cand
    return best


class SuffixMemory:
    """One loaded model's earlier answers, a corpus per scope (an API key on a server; "" for a
    library or CLI user), bounded in tokens altogether: the least recently used scope's least
    recently used answers go first. With a `keeper`, a scope's answers kept on disk are read the
    first time the scope is used, and what changed is written back by `save`. Used from the
    model's scheduler thread only."""

    def __init__(self, max_tokens: int = DEFAULT_MEMORY_TOKENS, max_scopes: int = _MAX_SCOPES,
                 keeper: SuffixKeeper | None = None):
        self.max_tokens = max_tokens
        self.max_scopes = max_scopes
        self.keeper = keeper
        self.scopes: OrderedDict[str, TokenCorpus] = OrderedDict()
        self._dirty: set[str] = set()  # scopes with answers the disk does not have yet
        self._saved_at = float("-inf")

    def corpus(self, scope: str) -> TokenCorpus:
        c = self.scopes.get(scope)
        if c is None:
            c = self.scopes[scope] = TokenCorpus(self.max_tokens)
            if self.keeper is not None:  # (read into this scope only: the file carries its scope's digest)
                for text in self.keeper.load(scope):
                    c.add(text)
            while len(self.scopes) > self.max_scopes:
                self._put_away(*self.scopes.popitem(last=False))
            self._fit(c)
        self.scopes.move_to_end(scope)
        return c

    @property
    def size(self) -> int:
        return sum(c.size for c in self.scopes.values())

    def remember(self, scope: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Keep an answer (with the prompt's last PROMPT_TAIL tokens before it)."""
        if not output:
            return
        c = self.corpus(scope)
        c.add(list(prompt[-PROMPT_TAIL:]) + list(output))
        self._dirty.add(scope)
        self._fit(c)

    def _fit(self, c: TokenCorpus) -> None:
        """Drop the least recently used answers (other scopes' first) while over the bound."""
        while self.size > self.max_tokens:
            victim = next(iter(self.scopes.values()))
            if len(victim.texts) <= 1 and victim is c:
                break  # one answer larger than the bound: kept until the next
            victim.drop(next(iter(victim.texts)))
            if not victim.texts:
                self._dirty.discard(self.scopes.popitem(last=False)[0])  # (its file keeps what it had)

    def _put_away(self, scope: str, c: TokenCorpus) -> None:
        """A scope leaving memory (too many scopes): what the disk lacks of it is written first."""
        if self.keeper is not None and scope in self._dirty and c.texts:
            self.keeper.save(scope, list(c.texts.values()))
        self._dirty.discard(scope)

    def save(self, force: bool = False) -> None:
        """Write the scopes whose answers changed, unless the last save was under `keeper.interval`
        seconds ago (`force`: now; a model unloading)."""
        if self.keeper is None or not self._dirty:
            return
        now = time.monotonic()
        if not force and now - self._saved_at < self.keeper.interval:
            return
        self._saved_at = now
        for scope in sorted(self._dirty):
            c = self.scopes.get(scope)
            if c is not None and c.texts:
                self.keeper.save(scope, list(c.texts.values()))
        self._dirty.clear()


class SuffixSource:
    """One request's suffix drafter: its own prompt and output (a live text, `own`) and its scope's
    earlier answers (`memory`), queried together — the own text's occurrences first (ties go to it)."""

    def __init__(self, memory: TokenCorpus | None, own: bool = True):
        self.memory = memory
        self.own = TokenCorpus(max_tokens=1 << 31) if own else None
        self._own_id = self.own.open() if self.own is not None else -1

    def sync(self, history: Sequence[int]) -> None:
        """Bring the own text up to `history` (which only grows during a generation)."""
        if self.own is None:
            return
        text = self.own.texts[self._own_id]
        n = len(text)
        if len(history) < n or list(history[:n]) != text:
            self.own = TokenCorpus(max_tokens=1 << 31)
            self._own_id, n = self.own.open(), 0
        self.own.extend(self._own_id, history[n:])

    def draft(self, history: Sequence[int], max_len: int) -> SuffixDraft:
        self.sync(history)
        corpora = [c for c in (self.own, self.memory) if c is not None]
        found = speculate(history, corpora, max_len, factor=DRAFT_FACTOR)
        if self.memory is not None:
            for c, tid in found.texts:
                if c is self.memory:
                    c.touch(tid)  # a text that drafts is recently used
        return found

    def remembered(self, found: SuffixDraft) -> bool:
        """Whether the draft came (also) from earlier answers."""
        return any(c is self.memory for c, _ in found.texts)
