"""Token sampling: llama.cpp's sampler chain, its distribution in numpy, and the request's state.

The chain, in llama.cpp's order: grammar → penalties → top-k → top-p → min-p → temperature → dist
(greedy: grammar → penalties → greedy). Greedy decoding with neither penalties nor a grammar skips
the chain and takes numpy's argmax of the zero-copy logits row: the token llama.cpp's greedy
sampler picks, without building a candidates array.

Speculation with a sampling draft model needs the distributions themselves, not only a sample:
`Sampler.distribution(row)` is exactly the distribution `sample(row)` draws from in the sampler's
current state — the grammar's mask (llama.cpp's own grammar sampler applied to the row) and the
penalties (from the request's generated tokens) in float32 as llama.cpp computes them, then
`sampling_distribution`'s top-k → top-p → min-p → temperature → softmax in float64 — and
`verify_sampled_draft` is the rejection rule that makes one speculative position distributed
exactly as p.

State. A request's grammar and penalty window advance with every token it commits: `sample` and
`draw` accept the token they return; a token chosen elsewhere (the rejection rule) is committed
with `accept(token)` before the next row's distribution is asked for. Sample-and-match verification
samples rows in order and every sampled token is committed, so the state never rolls back.
`fork()` is an independent copy (llama_sampler_clone) that a draft model advances along its own
drafts and then throws away. Why grammar-constrained sampling stays lossless with speculation:
see engine/structured/grammar.py.

Seeds. A request's seed (any int64, see SamplingOptions) is mixed by BLAKE2b into the 32-bit seed of
llama.cpp's dist sampler (`llama_seed`; never 0xFFFFFFFF, llama.cpp's "random" value) and into the
seed of the numpy RNG that draws what is sampled in numpy (speculative sampling).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import weakref
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import InvalidOptionError
from ...llama_backend import backend
from ..structured.grammar import Grammar, _new_sampler
from ..structured.llg import Constraint
from ..llama.runtime import LlamaRuntime, set_fields
from .options import GenerateOptions, SamplingOptions

__all__ = ["Sampler", "TokenDistribution", "sampling_distribution", "verify_sampled_draft", "llama_seed",
           "LLAMA_DEFAULT_SEED"]

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "draw a random seed" value (llama.h)


def _seed_digest(seed: int) -> bytes:
    return hashlib.blake2b(seed.to_bytes(8, "little", signed=True), digest_size=16, person=b"edgeinfer-seed").digest()


def llama_seed(seed: int) -> int:
    """The 32-bit seed llama.cpp's dist sampler gets for a request seed (any int64): BLAKE2b of the
    seed's 8 bytes, so nearby and negative seeds give unrelated streams and no two seeds that differ
    by 2**32 collide by construction; 0xFFFFFFFF (llama.cpp's "random") is moved to 0xFFFFFFFE."""
    s = int.from_bytes(_seed_digest(seed)[:4], "little")
    return s - 1 if s == LLAMA_DEFAULT_SEED else s


@dataclass(frozen=True)
class TokenDistribution:
    """A sampling distribution over a vocabulary: `probs[i]` is the probability of token `ids[i]`
    (ids ascending, distinct); every other token has probability 0."""

    ids: np.ndarray  # int64
    probs: np.ndarray  # float64, sums to 1

    def prob(self, tokens: np.ndarray | int) -> np.ndarray:
        """The probabilities of `tokens` (0 outside the support)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        at = np.minimum(np.searchsorted(self.ids, tokens), len(self.ids) - 1)
        return np.where(self.ids[at] == tokens, self.probs[at], 0.0)

    def draw(self, rng: np.random.Generator) -> int:
        i = int(np.searchsorted(np.cumsum(self.probs), rng.random() * self.probs.sum(), side="right"))
        return int(self.ids[min(i, len(self.ids) - 1)])

    @property
    def top(self) -> float:
        return float(self.probs.max())


def sampling_distribution(logits: np.ndarray, options: SamplingOptions) -> TokenDistribution:
    """The distribution llama.cpp's chain samples from for one logits row (penalties and grammar
    already applied, if any: -inf marks a forbidden token): top-k on the logits, top-p on their
    softmax (smallest prefix by descending probability whose sum reaches top_p, at least one token),
    min-p (logit ≥ max + log min_p), then softmax(logits / temperature) over what is left. Greedy is
    the one-hot argmax. float64 on the (float32, zero-copy) row. Only what can survive is sorted:
    the top-k candidates, or (top-k off) the tokens above the min-p threshold, or a prefix of the
    order long enough to reach top_p; the top-p normalizer is then the sum over the whole row."""
    n = logits.shape[0]
    if options.greedy:
        return TokenDistribution(np.array([int(np.argmax(logits))], dtype=np.int64), np.ones(1))
    zmax = float(logits.max())
    if zmax == -np.inf:
        raise InvalidOptionError("no token is allowed here (every logit is -inf)")
    total = None  # the top-p normalizer relative to the max, when ids is not the whole candidate set
    if 0 < options.top_k < n:
        ids = np.argpartition(logits, n - options.top_k)[n - options.top_k :]
    else:
        if options.top_p < 1.0 or options.min_p > 0.0:
            total = float(np.exp(logits.astype(np.float64) - zmax).sum())
        if options.min_p > 0.0:
            ids = np.flatnonzero(logits.astype(np.float64) >= zmax + np.log(options.min_p))
        elif options.top_p < 1.0:
            m = min(n, 256)
            while True:  # the top m, grown until they hold top_p of the mass
                ids = np.argpartition(logits, n - m)[n - m :] if m < n else np.arange(n)
                if m == n or np.exp(logits[ids].astype(np.float64) - zmax).sum() >= options.top_p * total:
                    break
                m = min(n, m * 4)
        else:
            ids = np.flatnonzero(logits > -np.inf)
    z = logits[ids].astype(np.float64)
    order = np.argsort(-z, kind="stable")
    ids, z = ids[order], z[order]
    if z[-1] == -np.inf:  # forbidden tokens have probability 0: out of the support
        keep = int(np.count_nonzero(z > -np.inf))
        ids, z = ids[:keep], z[:keep]
    if options.top_p < 1.0:
        e = np.exp(z - z[0])
        cum = np.cumsum(e) / (e.sum() if total is None else total)
        keep = int(np.searchsorted(cum, options.top_p, side="left")) + 1
        ids, z = ids[:keep], z[:keep]
    if options.min_p > 0.0:
        keep = max(1, int(np.count_nonzero(z >= z[0] + np.log(options.min_p))))
        ids, z = ids[:keep], z[:keep]
    e = np.exp((z - z[0]) / options.temperature)
    order = np.argsort(ids)
    return TokenDistribution(ids[order].astype(np.int64), (e / e.sum())[order])


def verify_sampled_draft(p: TokenDistribution, q: TokenDistribution, drafted: int,
                         rng: np.random.Generator) -> tuple[bool, int]:
    """Speculative sampling's rule for one drafted token x ~ q: keep it with probability
    min(1, p(x)/q(x)), else sample from normalise(max(0, p − q)). Either way the token returned is
    distributed as p. Returns (kept, token)."""
    px, qx = float(p.prob(drafted)), float(q.prob(drafted))
    if qx > 0.0 and rng.random() * qx < px:
        return True, drafted
    residual = np.maximum(p.probs - q.prob(p.ids), 0.0)  # zero wherever p is: p's support suffices
    total = residual.sum()
    if total <= 0.0:  # p == q (a rejection has probability 0 then): rounding only
        return False, p.draw(rng)
    return False, TokenDistribution(p.ids, residual / total).draw(rng)


# llama_token_data {id int32, logit float, p float}: a numpy structured array llama.cpp reads in place.
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)

# Per model: control tokens that are not end-of-generation (role markers and the like). Their text
# is empty when detokenized, but the grammar matches them by their marker text, so a grammar could
# "accept" `<|im_start|>` inside a JSON string and the output would not be what it checked:
# a (non-lazy) grammar forbids them.
_hidden_tokens: weakref.WeakKeyDictionary[LlamaRuntime, np.ndarray] = weakref.WeakKeyDictionary()


def _hidden(runtime: LlamaRuntime) -> np.ndarray:
    ids = _hidden_tokens.get(runtime)
    if ids is None:
        ll = backend()
        vocab = runtime.vocab
        control = ll.LLAMA_TOKEN_ATTR_CONTROL
        ids = np.array([t for t in range(runtime.facts.n_vocab)
                        if ll.llama_vocab_get_attr(vocab, t) & control and not ll.llama_vocab_is_eog(vocab, t)],
                       dtype=np.int64)
        _hidden_tokens[runtime] = ids
    return ids


class Sampler:
    """One request's sampling state (chain, grammar, penalty window, RNG). Sample rows in order,
    without gaps; see the module docstring for how state advances."""

    def __init__(self, runtime: LlamaRuntime, options: SamplingOptions, grammar: Grammar | None = None):
        self.runtime = runtime
        self.options = options
        self.grammar = grammar
        self.seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(8), "little", signed=True)
        digest = _seed_digest(self.seed)
        self.llama_seed = llama_seed(self.seed)
        # The request's one RNG for what is sampled in numpy (speculative sampling's draws).
        self.rng = np.random.default_rng(int.from_bytes(digest, "little"))
        # Whether `distribution(row)` is exactly what `sample(row)` draws from (in the current state).
        self.exact = not options.greedy
        self._penalized = options.penalized
        # The generated tokens in the penalty window, for the numpy distribution.
        self._window: deque[int] | None = deque(maxlen=options.repeat_last_n) if self._penalized else None
        self._argmax_only = options.greedy and not self._penalized and grammar is None
        # Whether the distribution depends on committed tokens, and the row last asked about since the
        # last commit (see `distribution`).
        self._stateful = self._penalized or grammar is not None
        self._asked: int | None = None
        self._chain: Any = None
        self._grammar: Any = None  # llama.cpp's grammar sampler (a native grammar)
        self._llg: Constraint | None = None  # llguidance's matcher (a user's grammar or schema)
        self._cand: np.ndarray | None = None
        self._arr: Any = None
        self._one: Any = None
        self._one_data: np.ndarray | None = None
        self._hidden = np.zeros(0, dtype=np.int64)
        if self._argmax_only:
            return
        ll = backend()
        try:
            if grammar is not None:
                grammar.validate()  # llama.cpp aborts the process on a bad trigger regex (checked grammars are remembered)
                if grammar.on_llguidance:
                    self._llg = Constraint(runtime, grammar)
                else:
                    self._grammar = _new_sampler(grammar, runtime.vocab)
                for t in grammar.trigger_tokens:
                    runtime.check_token(t)
                if not grammar.lazy:
                    self._hidden = _hidden(runtime)
            self._chain = self._build_chain(ll)
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_request(cls, runtime: LlamaRuntime, options: GenerateOptions) -> Sampler:
        """The sampler of one request: its sampling options and its grammar (grammar or json_schema)."""
        return cls(runtime, options.sampling, options.resolved_grammar())

    def _build_chain(self, ll: Any) -> Any:
        o = self.options
        chain = ll.llama_sampler_chain_init(set_fields(ll.llama_sampler_chain_default_params(), no_perf=True))

        def add(s: Any) -> None:
            if not s:
                raise InvalidOptionError("llama.cpp refused a sampler setting")
            ll.llama_sampler_chain_add(chain, s)  # the chain owns it from here

        try:
            if self._penalized and self.grammar is None:  # under a grammar they are applied in numpy
                add(ll.llama_sampler_init_penalties(self.runtime.facts.n_vocab, o.repeat_last_n, o.repeat_penalty,
                                                    o.frequency_penalty, o.presence_penalty))
            if o.greedy:
                add(ll.llama_sampler_init_greedy())
            else:
                if o.top_k > 0:
                    add(ll.llama_sampler_init_top_k(o.top_k))
                if o.top_p < 1.0:
                    add(ll.llama_sampler_init_top_p(o.top_p, 1))
                if o.min_p > 0.0:
                    add(ll.llama_sampler_init_min_p(o.min_p, 1))
                add(ll.llama_sampler_init_temp(o.temperature))
                add(ll.llama_sampler_init_dist(self.llama_seed))
        except BaseException:
            ll.llama_sampler_free(chain)
            raise
        return chain

    def _buffers(self) -> None:
        """The candidates arrays llama.cpp's samplers read and write in place (made when first needed)."""
        ll = backend()
        n = self.runtime.facts.n_vocab
        self._cand = np.zeros(n, dtype=_TOKEN_DATA)
        ptr = ctypes.cast(self._cand.ctypes.data, ctypes.POINTER(ll.llama_token_data))
        self._arr = ll.llama_token_data_array(data=ptr, size=n, selected=-1, sorted=False)
        self._one_data = np.zeros(1, dtype=_TOKEN_DATA)
        one_ptr = ctypes.cast(self._one_data.ctypes.data, ctypes.POINTER(ll.llama_token_data))
        self._one = ll.llama_token_data_array(data=one_ptr, size=1, selected=-1, sorted=False)

    # -- state ------------------------------------------------------------------------------------
    def prime(self, tokens: list[int]) -> None:
        """Called with the prompt before the first sample. The prompt enters neither the penalty
        window (SamplingOptions: penalties count generated tokens only) nor the grammar (which
        constrains the output from its first token)."""

    def allows_a_start(self) -> bool:
        """Whether the grammar (before any output) allows at least one token of the vocabulary: a
        grammar that matches only text this model cannot write is refused before its request runs
        (one llama.cpp pass over the vocabulary, a few ms). Always True without a grammar, or for a
        lazy one (it constrains only once triggered)."""
        if self.grammar is None or self.grammar.lazy or (self._grammar is None and self._llg is None):
            return True
        ids = np.arange(self.runtime.facts.n_vocab, dtype=np.int64)
        allowed = self._grammar_allows(ids).copy()
        if self._hidden.size:
            allowed[self._hidden] = False
        return bool(allowed.any())

    def allowed(self, token: int) -> bool:
        """Whether the grammar (in its current state) allows `token` next; always True without one."""
        if self._grammar is None and self._llg is None:
            return True
        if self._hidden.size and int(token) in self._hidden:
            return False
        if self._llg is not None:
            return self._llg.allows(int(token))
        if self._one is None:
            self._buffers()
        one = self._one_data
        one["id"], one["logit"], one["p"] = int(token), 0.0, 0.0
        self._one.size, self._one.selected, self._one.sorted = 1, -1, False
        backend().llama_sampler_apply(self._grammar, ctypes.byref(self._one))
        return bool(one["logit"][0] != -np.inf)

    def accept(self, token: int) -> None:
        """Commit a token chosen outside this sampler (e.g. by the rejection rule): advance the grammar
        and the penalty window. A token the grammar forbids is an InvalidOptionError (llama.cpp
        would abort the process)."""
        token = self.runtime.check_token(token)
        if not self.allowed(token):
            raise InvalidOptionError(f"token {token} is not allowed by the grammar here")
        self._advance(token, chain=True)

    def _advance(self, token: int, chain: bool) -> None:
        self._asked = None
        ll = backend()
        if self._grammar is not None:
            ll.llama_sampler_accept(self._grammar, token)
        if self._llg is not None:
            self._llg.consume(token)
        if chain and self._chain is not None:
            ll.llama_sampler_accept(self._chain, token)  # the penalties' window (the others ignore it)
        if self._window is not None:
            self._window.append(token)

    def fork(self, runtime: LlamaRuntime | None = None) -> Sampler:
        """An independent copy of this sampler's state (grammar, penalty window, chain) that reads
        logits from `runtime` (default: the same; a draft model's, whose vocabulary must be the
        target's). It shares the request's RNG, so all numpy draws come from one seeded stream.
        Close it when done."""
        ll = backend()
        twin = Sampler.__new__(Sampler)
        twin.__dict__.update(self.__dict__)
        twin.runtime = runtime if runtime is not None else self.runtime
        twin._window = deque(self._window, maxlen=self._window.maxlen) if self._window is not None else None
        twin._chain = twin._grammar = twin._cand = twin._arr = twin._one = twin._one_data = None
        twin._asked = None  # its rows are the draft's
        try:
            if self._grammar is not None:
                twin._grammar = ll.llama_sampler_clone(self._grammar)
            if self._llg is not None:
                twin._llg = self._llg.fork()
            if self._chain is not None:
                twin._chain = ll.llama_sampler_clone(self._chain)
        except BaseException:
            twin.close()
            raise
        return twin

    # -- sampling ---------------------------------------------------------------------------------
    def _logits(self, row: int | np.ndarray) -> np.ndarray:
        return row if isinstance(row, np.ndarray) else self.runtime.logits_row(row)

    def _fill(self, ids: np.ndarray, values: np.ndarray | float) -> Any:
        """The candidates array holding `ids` with `values` as logits; returns the llama.cpp struct."""
        if self._cand is None:
            self._buffers()
        cand, arr = self._cand, self._arr
        assert cand is not None
        k = len(ids)
        cand["id"][:k] = ids
        cand["logit"][:k] = values
        cand["p"][:k] = 0.0
        arr.size, arr.selected, arr.sorted = k, -1, False
        return arr

    def _grammar_allows(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` the grammar allows next (llguidance's mask, or llama.cpp's grammar sampler on
        a candidates array)."""
        if self._llg is not None:
            return self._llg.mask()[ids]
        arr = self._fill(ids, 0.0)
        backend().llama_sampler_apply(self._grammar, ctypes.byref(arr))
        assert self._cand is not None
        return self._cand["logit"][: len(ids)] == 0.0

    def _penalize(self, z: np.ndarray) -> None:
        """llama.cpp's penalties sampler, in place on the float32 row `z` (same float32 arithmetic)."""
        if not self._window:
            return
        o = self.options
        counts = Counter(self._window)
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        c = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        rp = np.float32(o.repeat_penalty)
        v = z[ids]
        v = np.where(v <= 0, v * rp, v / rp).astype(np.float32)
        v -= c * np.float32(o.frequency_penalty) + np.float32(1.0) * np.float32(o.presence_penalty)
        z[ids] = v

    def _penalized_row(self, row: int | np.ndarray) -> np.ndarray:
        """The row after the penalties (and with forbidden control tokens at -inf under a grammar): a
        copy, or the raw zero-copy row (not to be written) when there is nothing to change."""
        logits = self._logits(row)
        if not self._penalized and not self._hidden.size:
            return logits
        z = np.array(logits, dtype=np.float32, copy=True)
        z[self._hidden] = -np.inf
        self._penalize(z)
        return z

    def _constrained(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The allowed tokens (ids ascending, values) that decide what the chain does with the row `z`
        under the grammar. llguidance computes the whole mask at once (≈0.1-1.5 ms): the allowed
        tokens are read off it. llama.cpp's grammar sampler is asked per token (a native grammar),
        so there it is exact without asking the grammar about the whole vocabulary: tokens
        are checked in descending order of logit, in growing chunks, until the tokens not yet
        checked (all of lower logit) can change nothing: not the max (greedy), not the top-k set,
        nor anything min-p keeps, nor where top-p cuts (its normalizer bounded from both sides).
        Raises when the grammar allows no token."""
        if self._llg is not None:
            ids = np.flatnonzero(self._llg.mask() & (z > -np.inf))
            if not len(ids):
                raise InvalidOptionError("the grammar allows no token here (no token of this model's vocabulary "
                                         "continues it, and it is not complete)")
            return ids, z[ids]
        n = len(z)
        done = 0
        ids_parts: list[np.ndarray] = []
        top = np.zeros(0, dtype=np.int64)
        for m in (64, 1024, n):  # the last round takes all the rest at once, unsorted
            if m >= n:
                rest_ids = np.ones(n, dtype=bool)
                rest_ids[top] = False
                chunk = np.flatnonzero(rest_ids & (z > -np.inf))
                if len(chunk):
                    ok = chunk[self._grammar_allows(chunk)]
                    ids_parts.append(ok[np.argsort(-z[ok], kind="stable")])
                break
            top = np.argpartition(z, n - m)[n - m :]
            top = top[np.argsort(-z[top], kind="stable")]
            chunk = top[done:m]
            chunk = chunk[z[chunk] > -np.inf]
            if len(chunk):
                ids_parts.append(chunk[self._grammar_allows(chunk)])
            done = m
            found = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int64)
            if len(found) and self._decided(z[found].astype(np.float64), float(z[top[m - 1]]), n - m):
                break
        ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int64)
        if not len(ids):
            raise InvalidOptionError("the grammar allows no token here (no token of this model's vocabulary "
                                     "continues it, and it is not complete)")
        ids = np.sort(ids)
        return ids, z[ids]

    def _decided(self, vals: np.ndarray, low: float, rest: int) -> bool:
        """Whether allowed tokens with values `vals` (descending) decide the chain's result when up to
        `rest` more allowed tokens may exist, each with a logit of at most `low`."""
        o = self.options
        if o.greedy:
            return True  # vals[0] is the largest allowed logit
        k = o.top_k
        if 0 < k <= len(vals):
            return True  # the top-k set is known
        unknown = rest if k <= 0 else min(rest, k - len(vals))
        top = vals[0]
        threshold = top + np.log(o.min_p) if o.min_p > 0.0 else -np.inf
        unknown_pass_min_p = low >= threshold
        if o.top_p >= 1.0:
            return not unknown_pass_min_p
        w = np.exp(vals - top)
        cum = np.cumsum(w)
        z_lo = cum[-1]
        z_hi = z_lo + unknown * np.exp(low - top)
        keep_lo = int(np.searchsorted(cum, o.top_p * z_lo, side="left")) + 1
        keep_hi = int(np.searchsorted(cum, o.top_p * z_hi, side="left")) + 1
        n_thr = int(np.count_nonzero(vals >= threshold))
        if keep_hi > len(vals) and unknown_pass_min_p:
            return False  # top-p may reach into the unknown tokens, and min-p would keep them
        return min(keep_lo, n_thr) == min(keep_hi, n_thr)

    def _row(self, row: int | np.ndarray) -> np.ndarray:
        """What top-k etc. see: the row penalized and, under a grammar, -inf wherever the grammar
        forbids (or where `_constrained` showed the answer does not depend on it)."""
        z = self._penalized_row(row)
        if self._grammar is None and self._llg is None:
            return z
        ids, vals = self._constrained(z)
        out = np.full(len(z), -np.inf, dtype=np.float32)
        out[ids] = vals
        return out

    def distribution(self, row: int | np.ndarray) -> TokenDistribution:
        """The distribution `sample(row)` draws from in the current state: batch row `row` of the last
        decode (or a logits row given as an array), penalized and constrained, then transformed.

        With a grammar or penalties the state moves with each committed token: after asking about
        row i, `accept` the token chosen for it before asking about another row (a RuntimeError
        says so otherwise: verifying drafts with stale state would be silently wrong)."""
        if isinstance(row, int) and self._stateful:
            if self._asked is not None and self._asked != row:
                raise RuntimeError(f"accept() the token chosen for row {self._asked} before asking for row {row}: "
                                   "this request's grammar or penalties depend on it")
            self._asked = row
        return sampling_distribution(self._row(row), self.options)

    def sample(self, row: int | np.ndarray) -> int:
        """Sample the token for batch row `row` of the last decode with llama.cpp's chain, and accept it."""
        if self._argmax_only:
            return int(np.argmax(self._logits(row)))
        ll = backend()
        constrained = self._grammar is not None or self._llg is not None
        if not constrained and not isinstance(row, np.ndarray):
            token = int(ll.llama_sampler_sample(self._chain, self.runtime.ctx, row))  # accepts into the chain
            self._advance(token, chain=False)
            return token
        if not constrained:  # a row given as an array: the same chain on our candidates array
            logits = self._logits(row)
            arr = self._fill(np.arange(len(logits), dtype=np.int32), logits)
        else:  # the chain (without penalties: they are in the row) on the allowed tokens that matter
            ids, vals = self._constrained(self._penalized_row(row))
            arr = self._fill(ids, vals)
        ll.llama_sampler_apply(self._chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise InvalidOptionError("llama.cpp's sampler selected no token")
        token = int(arr.data[arr.selected].id)
        self._advance(token, chain=True)
        return token

    def draw(self, row: int | np.ndarray) -> int:
        """Sample row `row` in numpy with the request's RNG from `distribution(row)` (not the chain's
        RNG), and accept it: the target's draws when a sampling draft model speculates."""
        token = self.distribution(row).draw(self.rng)
        self._advance(token, chain=True)
        return token

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (each the only one it allows, in turn; llguidance's
        forced continuation): drafts that are never rejected. Empty without a llguidance grammar."""
        if self._llg is None:
            return []
        out: list[int] = []
        for t in self._llg.forced():
            if self.runtime.is_eog(t):
                break
            out.append(t)
        return out

    def close(self) -> None:
        self._llg = None
        ll = None
        for name in ("_chain", "_grammar"):
            smpl = getattr(self, name, None)
            if smpl is not None:
                ll = ll or backend()
                ll.llama_sampler_free(smpl)
                setattr(self, name, None)

    def __del__(self) -> None:  # pragma: no cover - safety net
        self.close()
