"""The chi-square test of sampled sequences against the target's own distribution: the exact
probabilities of the likely first tokens, by walking the tree of prefixes with llama.cpp's sampler
chain on the target's logits (test_rejection_sampling.llama_chain_distribution), and the test's power
against a given wrong distribution (what sizes a test's sample)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence

import numpy as np
from test_rejection_sampling import llama_chain_distribution

from edgeinfer.engine.core.options import SamplingOptions

# The next token's probabilities from the target's logits row after a prefix (and the prefix itself,
# for a grammar that depends on it).
Distribution = Callable[[np.ndarray, tuple[int, ...]], dict[int, float]]


def chain_distribution(sampling: SamplingOptions) -> Distribution:
    """llama.cpp's sampler chain with these options, as a Distribution."""
    return lambda row, prefix: llama_chain_distribution(row, sampling)


class memoized:
    """`distribution`, computed once per prefix (for one engine and prompt: the row follows from the
    prefix), for tests that walk the same tree more than once (next_distribution skips the row)."""

    def __init__(self, distribution: Distribution):
        self.distribution = distribution
        self.known: dict[tuple[int, ...], dict[int, float]] = {}

    def __call__(self, row: np.ndarray, prefix: tuple[int, ...]) -> dict[int, float]:
        if prefix not in self.known:
            self.known[prefix] = self.distribution(row, prefix)
        return self.known[prefix]


def next_distribution(engine, prompt: list[int], distribution: Distribution,
                      prefix: tuple[int, ...]) -> dict[int, float]:
    """The next token's probabilities after `prompt + prefix`."""
    known = distribution.known if isinstance(distribution, memoized) else {}
    if prefix in known:
        return known[prefix]
    row = engine.logits(prompt + list(prefix), start=len(prompt) + len(prefix) - 1)[-1]
    return distribution(row, prefix)


def expected_sequences(engine, prompt: Sequence[int], distribution: Distribution, n: int,
                       length: int) -> dict[tuple[int, ...], float]:
    """The exact probability of every sequence of the first `length` tokens expected at least 5
    times in `n` runs (the cells a chi-square may use; the rest is pooled)."""
    prompt = list(prompt)
    expected: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while frontier:
        prefix, p = frontier.pop()
        for token, q in next_distribution(engine, prompt, distribution, prefix).items():
            if p * q * n < 5:
                continue  # pooled with the rest
            if len(prefix) + 1 == length:
                expected[(*prefix, token)] = p * q
            else:
                frontier.append(((*prefix, token), p * q))
    return expected


def _cells(expected: dict[tuple[int, ...], float], key: Callable[[tuple[int, ...]], Hashable]):
    """(keys, their probabilities, the pooled rest's): the chi-square's cells."""
    by_key: dict[Hashable, float] = {}
    for ids, p in expected.items():
        by_key[key(ids)] = by_key.get(key(ids), 0.0) + p
    keys = sorted(by_key)
    assert len(keys) >= 3, f"the prompt's first tokens are not spread enough: {expected}"
    return keys, [by_key[k] for k in keys], 1 - sum(by_key.values())


def chi_square_of(expected: dict[tuple[int, ...], float], observed: Counter, n: int,
                  key: Callable[[tuple[int, ...]], Hashable] = lambda ids: ids):
    """The chi-square result of `observed` (counts over `n` runs, keyed by `key(token ids)`) against
    `expected` (expected_sequences), and its table."""
    from scipy import stats

    keys, probs, rest = _cells(expected, key)
    obs = [observed[k] for k in keys] + [n - sum(observed[k] for k in keys)]
    exp = [p * n for p in probs] + [n * rest]
    if exp[-1] < 1e-9:  # nothing left to pool
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp), list(zip(keys, obs, exp))


def sequence_chi_square(engine, prompt: Sequence[int], sampling: SamplingOptions, observed: Counter,
                        n: int, length: int, key: Callable[[tuple[int, ...]], Hashable] = lambda ids: ids):
    """The chi-square result of `observed` (counts of the first `length` tokens over `n` runs, keyed
    by `key(token ids)`) against the exact probabilities, every sequence expected at least 5 times
    (the rest pooled)."""
    expected = expected_sequences(engine, prompt, chain_distribution(sampling), n, length)
    return chi_square_of(expected, observed, n, key)


def chi_square_power(engine, prompt: Sequence[int], distribution: Distribution, wrong: Distribution, n: int,
                     length: int, alpha: float = 1e-3) -> tuple[float, float]:
    """(power, effect size w): the probability that the chi-square above, at level `alpha` over `n`
    runs, rejects runs drawn from `wrong` instead of `distribution` — by the noncentral chi-square
    with λ = n·w², w² = Σ (p_wrong − p)² / p over its cells (Cohen's w)."""
    from scipy import stats

    prompt = list(prompt)
    expected = expected_sequences(engine, prompt, distribution, n, length)
    keys, p0, rest0 = _cells(expected, lambda ids: ids)

    def wrong_probability(ids: tuple[int, ...]) -> float:
        p = 1.0
        for i, token in enumerate(ids):
            p *= next_distribution(engine, prompt, wrong, ids[:i]).get(token, 0.0)
        return p

    p1 = [wrong_probability(k) for k in keys]
    if rest0 > 1e-9:
        p0, p1 = [*p0, rest0], [*p1, 1 - sum(p1)]
    p0_, p1_ = np.array(p0), np.array(p1)
    w2 = float(((p1_ - p0_) ** 2 / p0_).sum())
    df = len(p0) - 1
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, n * w2)), w2 ** 0.5


def sample_sequences(engine, prompt: Sequence[int], sampling: SamplingOptions, speculation, n: int,
                     length: int) -> tuple[Counter, int, int]:
    """(counts of the first `length` tokens, drafted, accepted) over `n` generations seeded 0..n-1
    (a token more is asked for: a step drafts at most the tokens before its last)."""
    from dataclasses import replace

    from edgeinfer import GenerateOptions

    observed: Counter = Counter()
    drafted = accepted = 0
    for seed in range(n):
        done = engine.generate(list(prompt), GenerateOptions(max_tokens=length + 1, sampling=replace(sampling, seed=seed),
                                                             speculation=speculation)).result()
        observed[tuple(done.tokens[:length])] += 1
        drafted += done.stats.speculation.drafted
        accepted += done.stats.speculation.accepted
    return observed, drafted, accepted
